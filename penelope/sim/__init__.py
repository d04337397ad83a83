"""The trace-replay simulator: agent sessions replayed through the real KV cache under a serving-
time model. The front door is `penelope.sim.api` (see penelope/sim/README.md for the layout):

    from penelope.sim import SimulationSpec, WorkloadSpec, prepare, simulate
"""

# The front door, importable from the package (loaded on first use, so importing one module of
# the package does not import them all).
_EXPORTS = {
    "SimulationSpec": "penelope.sim.api", "Setup": "penelope.sim.api", "prepare": "penelope.sim.api",
    "simulate": "penelope.sim.api", "WorkloadSpec": "penelope.sim.workloads.load",
    "load": "penelope.sim.workloads.load",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'penelope.sim' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
