"""Calibrate the simulator on SGLang's real HTTP server on CPU, set up as the real-server table's.

    python scripts/sglang_cpu_calibration.py --out results/cpu/calibration   # about 10 minutes on 2 cores

Starts one `sglang.launch_server` (127.0.0.1, its own process group, stopped at the end) with the
scale model of `--model` (default `scale:7`, the model of scripts/sglang_ab_table.py), Penelope's
cache, the prefix-aware CPU attention, pages of 16 and chunks of 1024, a pool large enough for
the decode points, then runs `penelope calibrate` against it. Writes OUT/calibration.json (what
`penelope simulate --model OUT/model --calibration OUT/calibration.json` reads), OUT/points.json
(every point, the fits and their R^2) and the server's log.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    from penelope.cli import main as penelope
    from penelope.loadgen.ab_configs import ServerSetup, make_config
    from penelope.loadgen.models import prepare_model
    from penelope.loadgen.server import CPU_ENV, ServerSpec, SGLangServer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--model", default="scale:7", help="tiny, scale:S or a checkpoint folder (default scale:7)")
    parser.add_argument("--pool", type=int, default=81920, help="KV pool in tokens (default 81,920)")
    parser.add_argument("--chunk", type=int, default=1024, help="--chunked-prefill-size (default 1024)")
    args, rest = parser.parse_known_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model = prepare_model(args.model, args.out / "model")
    setup = ServerSetup(model=str(model), pool=args.pool, chunk=args.chunk, attention="torch_native_prefix")
    path = os.pathsep.join(p for p in (str(ROOT / "tests" / "engine_stub"), os.environ.get("PYTHONPATH")) if p)
    spec = ServerSpec(model=str(model), log=args.out / "server.log",
                      args=(*setup.common_args(), *make_config("penelope", setup).args),
                      env={**CPU_ENV, "PYTHONPATH": path}, startup_timeout=900)
    print(f"starting SGLang on CPU with {model} (log {spec.log})", flush=True)
    with SGLangServer(spec) as server:
        return penelope(["calibrate", "--url", server.url, "--model", str(model),
                         "--out", str(args.out / "calibration.json"), "--points", str(args.out / "points.json"),
                         *rest])


if __name__ == "__main__":
    sys.exit(main())
