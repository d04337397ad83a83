"""The APIs the load generator speaks, by name, and their paths (no heavy imports: the CLI's
parser reads them)."""

GENERATE, OPENAI = "generate", "openai"
APIS = (GENERATE, OPENAI)
PATHS = {GENERATE: "/generate", OPENAI: "/v1/completions"}
