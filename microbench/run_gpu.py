"""The GPU script: every GPU measurement of the project in one run of at most 8 minutes, with only
what the GPU machine has (no network: nothing is installed or downloaded).

    python microbench/run_gpu.py [--out DIR] [--budget SECONDS] [--only STAGE ...] [--shapes full|reduced]
                                 [--dry-run]

Stages, in order of value, each a process (``run_stage.py``) killed with its process group at its
own limit (``STAGES``), never past what is left of ``--budget`` less the calibration's reserve:
environment, attention, cost_curve, swap, decode, phantom (``gpu_stages/``), then calibration,
which always runs and writes the simulator's calibration file last. Every measured point is
appended to ``DIR/points.jsonl`` the moment it is measured, so a stage killed at its limit keeps
what it had; the runner adds one ``status`` point per stage (with the count of points it skipped
for lack of time). ``DIR/run_gpu.log`` holds the stages' output and ``nvidia-smi``; a run first
removes the files an earlier one left there (``gpu_stages/files.py``). ``--shapes reduced`` runs
every stage on the CPU with the kernels interpreted, under limits sized for that (the code paths,
not the figures).

SIGINT, SIGTERM or SIGHUP (``stage_group.py``): the running stage is killed with its process group
and recorded ``INTERRUPTED``, the stages after it do not start, the calibration still runs on the
points so far (a second signal stops it too), and the exit status is 128 + the signal (130, 143,
129).

Exit status: 0 every stage passed; 1 a stage failed, timed out or was skipped for lack of time;
3 no CUDA GPU (after the environment point; full shapes only); 4 bad arguments or an output folder
that cannot be written; 5 a required package is missing (named on one line) or does not import
(after the environment point); 130, 143, 129 stopped by SIGINT, SIGTERM, SIGHUP.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from gpu_stages.source_tree import use_source_tree  # noqa: E402

# The points helper is Penelope's JSON code: imported from this working tree (standard library only).
use_source_tree()

from gpu_stages.files import LOG_FILE, OUTPUT_FILES  # noqa: E402
from gpu_stages.points import POINTS_FILE, PointLog, read_points  # noqa: E402
from stage_group import STOPPED, StopSignals, run_group  # noqa: E402
from stage_group import TIMED_OUT as TIMED_OUT_GROUP  # noqa: E402


@dataclass(frozen=True)
class Stage:
    name: str
    limit: int  # seconds on the GPU (full shapes)
    module: str | None = None  # default gpu_stages.<name>
    # Seconds with reduced shapes on the CPU, kernels interpreted (default: ``limit``). Sized for a
    # shared 2-core machine: a load of 10 stretched each stage's wall time to 4-7 times its CPU
    # time (attention, which imports SGLang where it is installed: 58 s of CPU 17 s).
    reduced_limit: int | None = None

    def limit_for(self, shapes: str) -> int:
        return self.limit if shapes == "full" or self.reduced_limit is None else self.reduced_limit


STAGES = (
    # Imports and versions; no figure.
    Stage("environment", 30, reduced_limit=45),
    # Compiles of two kernel configurations, the fp32 checks, 4 batches x 4 providers.
    Stage("attention", 110, reduced_limit=120),
    # Qwen3-8B's 36 layers at 5 contexts, 3 rounds each; the 128K tail request alone is seconds.
    Stage("cost_curve", 150, reduced_limit=90),
    Stage("swap", 60, reduced_limit=60),
    Stage("decode", 60, reduced_limit=45),
    Stage("phantom", 40, reduced_limit=45),
)
CALIBRATION = Stage("calibration", 20, reduced_limit=40)
DEFAULT_BUDGET = 480
# Seconds a stage needs at least to be worth starting.
MIN_STAGE = 10
# What the stages import; the bench_* modules they reuse import pytest.
REQUIRED = ("torch", "triton", "numpy", "pytest")
# Without them: no NVML telemetry, no cost-curve plot.
OPTIONAL = ("pynvml", "matplotlib")

PASSED, FAILED, TIMED_OUT, SKIPPED, NO_GPU_STATUS = "passed", "FAILED", "TIMED OUT", "SKIPPED", "no GPU"
INTERRUPTED, BROKEN_PACKAGE = "INTERRUPTED", "package does not import"
EXIT_OK, EXIT_FAILED, EXIT_NO_GPU, EXIT_BAD_ARGS, EXIT_MISSING = 0, 1, 3, 4, 5
STAGE_NO_GPU, STAGE_BROKEN = 3, 5  # gpu_stages.context.NO_GPU, BROKEN


def missing(packages: tuple[str, ...] | None = None) -> list[str]:
    """The packages (default ``REQUIRED``) this interpreter cannot import (looked up, not imported)."""
    return [name for name in packages or REQUIRED if importlib.util.find_spec(name) is None]


def plan(only: list[str] | None = None) -> list[Stage]:
    """The stages to run, in order: the environment first, the calibration last, the measuring
    stages between (all of them, or those named in ``only``)."""
    names = [stage.name for stage in STAGES[1:]]
    unknown = sorted(set(only or ()) - set(names))
    if unknown:
        raise ValueError(f"unknown stage(s) {', '.join(unknown)}; stages: {', '.join(names)}")
    return [STAGES[0], *(s for s in STAGES[1:] if not only or s.name in only), CALIBRATION]


def stage_limit(stage: Stage, left: float, shapes: str = "full") -> int:
    """Seconds ``stage`` may run with ``left`` seconds of the budget left: its own limit for
    ``shapes``, clipped to what is left after the calibration's reserve (the calibration itself
    gets what is left)."""
    if stage is CALIBRATION:
        return int(max(MIN_STAGE, min(stage.limit_for(shapes), left)))
    return int(min(stage.limit_for(shapes), left - CALIBRATION.limit_for(shapes)))


def run_stage(stage: Stage, limit: float, out: Path, shapes: str, log, stop: StopSignals) -> tuple[str, int]:
    """Run one stage in its own process group, its output appended to the open file ``log``; kill
    the group after ``limit`` seconds or at a stop signal. Returns its status and exit code (124
    when killed at its limit, 128 + the signal's number when stopped)."""
    command = [sys.executable, str(HERE / "run_stage.py"), stage.name, "--out", str(out), "--shapes", shapes,
               "--limit", str(limit)]
    if stage.module:
        command += ["--module", stage.module]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if shapes == "reduced":
        # Tiny shapes on a shared CPU: more intra-op threads only contend (torch's spinning
        # threads against the interpreter, which holds the GIL).
        env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    log.flush()
    outcome, code = run_group(command, limit, stop, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    if outcome == TIMED_OUT_GROUP:
        # Killed after run() had returned (its end point is in), in the interpreter's exit: the
        # stage's own status stands.
        end = read_points(out / POINTS_FILE, stage=stage.name, kind="end")
        if not end:
            return TIMED_OUT, 124
        code = end[-1]["returncode"]
    if outcome == STOPPED:
        return INTERRUPTED, 128 + int(stop.received[-1])
    if code == 0:
        return PASSED, code
    return {STAGE_NO_GPU: NO_GPU_STATUS, STAGE_BROKEN: BROKEN_PACKAGE}.get(code, FAILED), code


def exit_status(statuses: list[str]) -> int:
    if BROKEN_PACKAGE in statuses:
        return EXIT_MISSING
    if NO_GPU_STATUS in statuses:
        return EXIT_NO_GPU
    return EXIT_OK if statuses and all(status == PASSED for status in statuses) else EXIT_FAILED


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or REPO / "results" / "gpu"),
                        help="output folder (default $OUT, else results/gpu)")
    parser.add_argument("--budget", type=int,
                        help=f"seconds for the whole run (default $TOTAL_BUDGET, else {DEFAULT_BUDGET})")
    parser.add_argument("--only", nargs="+", metavar="STAGE", help="run only these measuring stages")
    parser.add_argument("--shapes", choices=("full", "reduced"), default="full",
                        help="full: the GPU experiment; reduced: small shapes on the CPU, kernels interpreted")
    parser.add_argument("--dry-run", action="store_true", help="print the stages and their limits, run nothing")
    args = parser.parse_args(argv)
    if args.budget is None:
        # Read only when --budget is not given: a bad value there must not stop a run that sets it.
        budget = os.environ.get("TOTAL_BUDGET") or str(DEFAULT_BUDGET)
        try:
            args.budget = int(budget)
        except ValueError:
            raise ValueError(f"TOTAL_BUDGET must be whole seconds, got {budget!r}") from None
    floor = STAGES[0].limit_for(args.shapes) + CALIBRATION.limit_for(args.shapes)
    if args.budget < floor:
        raise ValueError(f"--budget must be at least {floor} seconds, got {args.budget}")
    args.stages = plan(args.only)
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(argv)
    except ValueError as error:
        print(f"run_gpu: error: {error}", file=sys.stderr)
        return EXIT_BAD_ARGS
    except SystemExit as error:
        return EXIT_BAD_ARGS if error.code else EXIT_OK
    if args.dry_run:
        left = args.budget
        for stage in args.stages:
            # As a real run whose every stage takes its whole limit.
            limit = stage_limit(stage, left, args.shapes)
            if limit < MIN_STAGE:
                print(f"{stage.name}: {skipped_line(args, left)}")
                continue
            print(f"{stage.name}: limit {limit} s")
            left -= limit
        return EXIT_OK

    out = args.out.resolve()
    try:
        clear_outputs(out)
        log = (out / LOG_FILE).open("w")
    except OSError as error:
        print(f"run_gpu: error: cannot write the output folder {out}: {error.strerror or error}", file=sys.stderr)
        return EXIT_BAD_ARGS
    with log, StopSignals() as stop:
        def say(text: str, stream=sys.stdout) -> None:
            log.write(text + "\n")
            log.flush()
            try:
                print(text, file=stream, flush=True)
            except OSError:
                # The terminal is gone (the SIGHUP of a closed window): the log still has it.
                pass

        absent = missing()
        if absent:
            say(f"run_gpu: missing package(s): {', '.join(absent)} (nothing is installed or downloaded here: "
                "install them in this Python, or carry their wheels)", sys.stderr)
            PointLog(out / POINTS_FILE, "run_gpu").write("missing", packages=absent, python=sys.executable)
            return EXIT_MISSING
        return run_all(args, out, log, say, stop)


def clear_outputs(out: Path) -> None:
    """Create the output folder, or remove from it what an earlier run wrote (only the script's own
    files); raises OSError where it cannot."""
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUT_FILES:
        (out / name).unlink(missing_ok=True)


def skipped_line(args: argparse.Namespace, left: float) -> str:
    return f"{SKIPPED}, {left:.0f} s left of the {args.budget} s budget"


def run_all(args: argparse.Namespace, out: Path, log, say, stop: StopSignals) -> int:
    """Every planned stage in turn; after a stop signal, the stage running is killed, the stages
    after it are not started and the calibration runs (a second signal stops it too)."""
    start = time.monotonic()
    statuses = []
    say(f"== run_gpu {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}: {args.shapes} shapes, budget "
        f"{args.budget} s, python {sys.version.split()[0]}, optional packages missing: "
        f"{', '.join(missing(OPTIONAL)) or 'none'}")
    _nvidia_smi(log, stop)
    told = False
    for stage in args.stages:
        if stop.received and not told:
            say(f"== stopped by {stop.first.name}: the stages left do not run; the calibration does, from the "
                "points so far (a second signal stops it)")
            told = True
        if stop.received and stage is not CALIBRATION:
            continue
        left = args.budget - (time.monotonic() - start)
        limit = stage_limit(stage, left, args.shapes)
        status_log = PointLog(out / POINTS_FILE, stage.name)
        if limit < MIN_STAGE:
            say(f"== {stage.name}: {skipped_line(args, left)}")
            status_log.write("status", status=SKIPPED, limit_s=limit, seconds=0.0)
            statuses.append(SKIPPED)
            continue
        say(f"== {stage.name} (limit {limit} s)")
        began = time.monotonic()
        status, code = run_stage(stage, limit, out, args.shapes, log, stop)
        seconds = time.monotonic() - began
        extra = {"signal": stop.received[-1].name} if status == INTERRUPTED else {}
        # A stage passes when it skipped points for lack of time: the status says how many.
        skipped = len(read_points(out / POINTS_FILE, stage=stage.name, kind="skipped"))
        status_log.write("status", status=status, returncode=code, limit_s=limit, seconds=round(seconds, 1),
                         skipped_points=skipped, **extra)
        statuses.append(status)
        notes = [extra["signal"]] if extra else []
        if skipped:
            notes.append(f"{skipped} point{'s' * (skipped != 1)} skipped: see their reasons in {POINTS_FILE}")
        say(f"== {stage.name}: {status} in {seconds:.0f} s" + (f" ({'; '.join(notes)})" if notes else ""))
        if status == NO_GPU_STATUS:
            say("== no usable CUDA GPU: nothing can be measured (--shapes reduced runs on the CPU)")
            break
        if status == BROKEN_PACKAGE:
            errors = read_points(out / POINTS_FILE, stage=stage.name, kind="error")
            say(f"== {errors[-1]['error'] if errors else 'a required package does not import'}: no stage can run")
            break
    code = stop.exit_status() or exit_status(statuses)
    say(f"== done in {time.monotonic() - start:.0f} s, exit status {code}; points in {out / POINTS_FILE}")
    return code


def _nvidia_smi(log, stop: StopSignals) -> None:
    """``nvidia-smi``'s report into ``log`` (at most 20 s; a stop signal ends it)."""
    log.flush()
    try:
        run_group(["nvidia-smi"], 20, stop, stdout=log, stderr=subprocess.STDOUT)
    except OSError:
        log.write("nvidia-smi not available\n")


if __name__ == "__main__":
    sys.exit(main())
