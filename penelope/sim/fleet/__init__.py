"""Several simulated servers behind a router: routers (`router`, `router_tree`), results per
replica and for the fleet (`summary`), whether each replica kept up (`saturation`), and their
text (`report`)."""
