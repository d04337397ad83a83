"""One stage of the GPU script in its own process, so that the runner can kill it at its limit.

    python microbench/run_stage.py NAME --out DIR --shapes full|reduced --limit SECONDS [--module M]

Imports Penelope from the working tree (``gpu_stages/source_tree.py``), then runs ``run(ctx)`` of
the module ``gpu_stages.NAME`` (or ``--module``), whose points go to ``DIR/points.jsonl``. Exits with
the stage's status (``gpu_stages/context.py``), after an ``end`` point with that status; an
exception is written as an ``error`` point and exits 1.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_stages.source_tree import use_source_tree  # noqa: E402

use_source_tree()

from gpu_stages.points import POINTS_FILE, PointLog  # noqa: E402

# Seconds a stage keeps in hand before its limit: the runner kills it at the limit.
MARGIN = 8.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--shapes", choices=("full", "reduced"), default="full")
    parser.add_argument("--limit", type=float, required=True, help="seconds before the runner kills this stage")
    parser.add_argument("--module", help="the stage's module (default gpu_stages.NAME)")
    args = parser.parse_args(argv)
    began = time.monotonic()
    log = PointLog(args.out / POINTS_FILE, args.name)
    try:
        from gpu_stages.context import StageContext

        module = importlib.import_module(args.module or f"gpu_stages.{args.name}")
        deadline = began + args.limit - min(MARGIN, 0.2 * args.limit)
        code = module.run(StageContext(log, args.out, args.shapes == "full", deadline))
        # The stage's work is done: a kill during the interpreter's teardown does not undo its status.
        log.write("end", returncode=code, seconds=round(time.monotonic() - began, 1))
        return code
    except Exception as error:
        log.write("error", error=f"{type(error).__name__}: {error}"[:1000], traceback=traceback.format_exc()[-4000:])
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
