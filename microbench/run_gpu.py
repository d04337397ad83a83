"""Every GPU microbenchmark in one prepared run, each step under its own time budget.

``run_gpu.sh`` installs the project (``scripts/install.sh test``) and calls this; it can also be run
directly with the project's Python::

    python microbench/run_gpu.py [--out DIR] [--budget SECONDS] [--only NAME ...] [--dry-run]

Steps: a check that CUDA works, then the ``test_gpu*`` benchmarks of every ``microbench/bench_*.py``
(the cost curve first), each a pytest process killed with its process group when it passes its
limit (``STEP_LIMITS``, default ``DEFAULT_LIMIT``, never more than what is left of ``--budget``).
Writes into ``--out``: ``benchmarks.json`` (every step's results merged), ``run_gpu.log`` (all output,
``nvidia-smi``, the comparison with the baseline) and the files the benchmarks write themselves.

Exit status: 0 when every step passed and at least one GPU benchmark ran; 1 when a step failed,
timed out or had no time left; 2 when no GPU benchmark ran at all (everything skipped: a run that
measured nothing is not a success); 3 when CUDA is not available; 4 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_BUDGET = 450
DEFAULT_LIMIT = 120
# The cost curve bounds itself at 230 s (SETUPS["gpu"].budget_s); the decode calibration times
# batch 1/4/8 x contexts 1K..128K; the attention benchmark runs 10 contexts x 2 layouts x up to 4
# providers.
STEP_LIMITS = {"gpu_check": 60, "bench_cost_curve": 290, "bench_decode": 150, "bench_ragged_attention": 180}
# Run first, in this order: the figures the simulator's calibration needs.
FIRST = ("bench_cost_curve", "bench_decode")
# Seconds a step needs at least to be worth starting.
MIN_STEP = 20

OK, FAILED, TIMED_OUT, SKIPPED, NO_GPU_BENCHMARK = "passed", "FAILED", "TIMED OUT", "SKIPPED", "no GPU benchmark"


@dataclass
class StepResult:
    name: str
    status: str
    seconds: float
    benchmarks: int  # GPU benchmark results the step recorded


def steps(only: list[str] | None = None) -> list[str]:
    """The benchmark files to run, by name (``FIRST`` first), filtered by ``only``."""
    names = sorted(path.stem for path in (REPO / "microbench").glob("bench_*.py"))
    names.sort(key=lambda name: FIRST.index(name) if name in FIRST else len(FIRST))
    if only:
        unknown = sorted(set(only) - set(names))
        if unknown:
            raise ValueError(f"unknown step(s) {', '.join(unknown)}; steps: {', '.join(names)}")
        names = [name for name in names if name in only]
    return names


def step_limit(name: str, left: float) -> int:
    """Seconds step ``name`` may run with ``left`` seconds of the budget left."""
    return int(min(STEP_LIMITS.get(name, DEFAULT_LIMIT), left))


def count_benchmarks(path: Path) -> int:
    """Results in a pytest-benchmark JSON (0 when missing or unreadable)."""
    try:
        return len(json.loads(path.read_text()).get("benchmarks", []))
    except (OSError, ValueError, AttributeError):
        return 0


def step_status(returncode: int, benchmarks: int) -> str:
    """A benchmark step's status from pytest's exit code and the results it recorded."""
    if returncode in (124, 137, -signal.SIGKILL, -signal.SIGTERM):
        return TIMED_OUT
    if returncode == 5 or (returncode == 0 and benchmarks == 0):
        return NO_GPU_BENCHMARK
    return OK if returncode == 0 else FAILED


def exit_status(results: list[StepResult], gpu: bool) -> int:
    """0 all passed and some GPU benchmark ran, 1 a step failed, 2 nothing ran, 3 no CUDA."""
    if not gpu:
        return 3
    if any(r.status in (FAILED, TIMED_OUT, SKIPPED) for r in results):
        return 1
    return 0 if sum(r.benchmarks for r in results) > 0 else 2


def merge(paths: list[Path], out: Path) -> int:
    """Merge pytest-benchmark JSON files into ``out``; returns the number of results."""
    merged = None
    for path in paths:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if merged is None:
            merged = data
        else:
            merged["benchmarks"].extend(data.get("benchmarks", []))
    if merged is None:
        return 0
    out.write_text(json.dumps(merged, indent=1))
    return len(merged["benchmarks"])


def run_limited(command: list[str], limit: float, log) -> int:
    """Run ``command`` in its own process group, output appended to ``log``; kill the group after
    ``limit`` seconds (returns 124 then)."""
    with subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1")) as process:
        deadline = time.monotonic() + limit
        try:
            out, _ = process.communicate(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, _ = process.communicate()
            log(out or "")
            return 124
        log(out or "")
        return process.returncode


class Log:
    def __init__(self, path: Path):
        self.path = path
        path.write_text("")

    def __call__(self, text: str, echo: bool = True) -> None:
        with self.path.open("a") as handle:
            handle.write(text if text.endswith("\n") else text + "\n")
        if echo:
            print(text.rstrip("\n")[-4000:], flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "results/gpu"), help="output folder")
    parser.add_argument("--budget", type=int, default=int(os.environ.get("TOTAL_BUDGET", DEFAULT_BUDGET)),
                        help=f"seconds for the whole run (default {DEFAULT_BUDGET})")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these bench_* steps")
    parser.add_argument("--python", default=sys.executable, help="interpreter of the benchmarks")
    parser.add_argument("--dry-run", action="store_true", help="print the steps and their limits, run nothing")
    try:
        args = parser.parse_args(argv)
        if args.budget < MIN_STEP:
            raise ValueError(f"--budget must be at least {MIN_STEP} seconds, got {args.budget}")
        names = steps(args.only)
    except ValueError as error:
        print(f"run_gpu: error: {error}", file=sys.stderr)
        return 4
    except SystemExit as error:
        return 4 if error.code else 0
    if args.dry_run:
        for name in ["gpu_check", *names]:
            print(f"{name}: limit {step_limit(name, args.budget)} s")
        return 0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / "run_gpu.log")
    start = time.monotonic()
    log(f"== run_gpu {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, budget {args.budget} s")
    smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True) if _has("nvidia-smi") else None
    log(smi.stdout if smi is not None else "nvidia-smi not available", echo=False)
    check = [args.python, "-c", "import torch, penelope.kernels; assert torch.cuda.is_available(), 'no CUDA device';"
             " print(torch.cuda.get_device_name(), torch.__version__)"]
    gpu = run_limited(check, step_limit("gpu_check", args.budget), log) == 0
    results: list[StepResult] = []
    if not gpu:
        log("== no usable CUDA GPU: nothing can be measured")
        return exit_status(results, gpu)

    step_files = []
    for name in names:
        left = args.budget - (time.monotonic() - start)
        if left < MIN_STEP:
            log(f"== {name}: SKIPPED, {left:.0f} s left of the {args.budget} s budget")
            results.append(StepResult(name, SKIPPED, 0.0, 0))
            continue
        limit = step_limit(name, left)
        json_path = out / f".{name}.json"
        json_path.unlink(missing_ok=True)
        log(f"== {name} (limit {limit} s)")
        began = time.monotonic()
        code = run_limited([args.python, "-m", "pytest", f"microbench/{name}.py", "--gpu-only", "-q", "-s",
                            "-p", "no:cacheprovider", "--benchmark-json", str(json_path), "--bench-out", str(out)],
                           limit, log)
        result = StepResult(name, "", time.monotonic() - began, count_benchmarks(json_path))
        result.status = step_status(code, result.benchmarks)
        results.append(result)
        step_files.append(json_path)
        log(f"== {name}: {result.status} in {result.seconds:.0f} s, {result.benchmarks} result(s)")

    total = merge(step_files, out / "benchmarks.json")
    for path in step_files:
        path.unlink(missing_ok=True)
    log(f"== {total} results in {out / 'benchmarks.json'}")
    if total:
        code = run_limited([args.python, "microbench/compare.py", str(out / "benchmarks.json")], 60, log)
        if code == 2:
            log("(no baseline of this machine kind yet: copy benchmarks.json to microbench/baselines/<kind>.json)")
    status = exit_status(results, gpu)
    log(f"== done in {time.monotonic() - start:.0f} s, exit status {status}")
    return status


def _has(program: str) -> bool:
    return any((Path(folder) / program).exists() for folder in os.environ.get("PATH", "").split(os.pathsep))


if __name__ == "__main__":
    sys.exit(main())
