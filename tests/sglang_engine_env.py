"""SGLang Engine tests' set-up: the agent traffic and an Engine process's environment (CPU stub on its path)."""

import os
from pathlib import Path

from penelope.integration.sglang.engine_check import AgentTraffic

TRAFFIC = AgentTraffic()


def engine_env(*paths: Path, **extra) -> dict:
    path = os.pathsep.join(p for p in (str(STUB), *map(str, paths), os.environ.get("PYTHONPATH", "")) if p)
    # Untimed unless a test asks (a developer's shell may set PENELOPE_TIME_CACHE).
    return {"PYTHONPATH": path, "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1",
            "SGLANG_CHECK_KV_PAGE_INVARIANTS": "1", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
            "PENELOPE_TIME_CACHE": "0", **extra}


STUB = Path(__file__).parent / "engine_stub"


