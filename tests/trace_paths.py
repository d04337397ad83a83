"""Where the real WEKA Claude Code traces are: `$PENELOPE_WEKA_TRACES`, else the project's
`shared/` folder beside the repository (as in development and CI)."""
import os
from pathlib import Path

WEKA_TRACES = Path(
    os.environ.get("PENELOPE_WEKA_TRACES")
    or Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "weka-claude-code"
).resolve()
