"""Command-line options shared by `penelope simulate` and `penelope analyze`: which workload to
load and how to replay its waits."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from penelope.costmodel.shapes import model_path
from penelope.errors import UsageError
from penelope.sim.replay import check_clock_range
from penelope.sim.workloads.load import FORMATS, load_workload
from penelope.sim.workloads.turns import select_turns, turn_arguments
from penelope.sim.workloads.types import ThinkTime, Workload
from penelope.sim.workloads.weka import OVERFLOW_MODES, SUBAGENT_MODES
from penelope.units import parse_size

DEFAULT_MAX_CONTEXT = "128K"


def add_workload_arguments(parser, trace_flag: bool = True) -> None:
    """Workload options; the trace path is `--trace` when `trace_flag`, else the caller adds it."""
    if trace_flag:
        parser.add_argument(
            "--trace", metavar="PATH", help="WEKA trace folder or file, or Mooncake JSONL (default: synthetic)"
        )
    parser.add_argument(
        "--format",
        help=f"workload format: {' | '.join(FORMATS)} (default: from the path; synthetic without one)",
    )
    parser.add_argument(
        "--max-context",
        default=DEFAULT_MAX_CONTEXT,
        help="largest input in tokens (the model's window); longer requests are handled by --overflow",
    )
    parser.add_argument(
        "--overflow",
        default="truncate",
        choices=OVERFLOW_MODES,
        help=f"WEKA sessions with a longer request: {' | '.join(OVERFLOW_MODES)} (cut the session before it, "
        "drop only it, or skip the session)",
    )
    parser.add_argument(
        "--subagents", default="skip", choices=SUBAGENT_MODES,
        help=f"WEKA sub-agents: {' | '.join(SUBAGENT_MODES)} (skipped ones are counted)"
    )
    parser.add_argument(
        "--no-shared-prefix",
        action="store_true",
        help="WEKA: do not map the tools+system prefix to one id space shared by all sessions",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic workload")
    parser.add_argument("--limit-sessions", type=int, metavar="N", help="replay only the first N sessions")
    parser.add_argument(
        "--think-time",
        default="recorded",
        help="closed-loop waits: recorded | tool (human waits become the median tool wait), "
        "optionally with scale:X and cap:SECONDS, comma-separated (e.g. tool,cap:60)",
    )


def infer_format(path: str | None, given: str | None) -> str:
    """The workload format: `given`, else synthetic without a path, weka for a folder or
    `.json`, mooncake for `.jsonl`."""
    if given:
        return given
    if path is None:
        return "synthetic"
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{path}: no such trace file or folder")
    if p.is_dir() or p.suffix == ".json":
        return "weka"
    if p.suffix == ".jsonl":
        return "mooncake"
    raise UsageError(f"cannot tell the format of {path}; give --format ({', '.join(FORMATS)})")


def parse_think_time(text: str) -> ThinkTime:
    """`recorded`, `tool`, `scale:X`, `cap:S`, comma-separated (`tool,scale:0.5,cap:60`)."""
    mode, scale, cap = "recorded", 1.0, None
    given: set[str] = set()
    for item in (part.strip() for part in str(text).split(",")):
        if not item:
            continue
        kind = "recorded|tool" if item in ThinkTime.MODES else item.partition(":")[0]
        if kind in given:
            raise UsageError(f"--think-time {text}: {item!r} contradicts or repeats an earlier item")
        given.add(kind)
        if item in ThinkTime.MODES:
            mode = item
            continue
        name, _, value = item.partition(":")
        if name not in ("scale", "cap") or not value:
            raise UsageError(
                f"--think-time: cannot read {item!r} (use recorded, tool, scale:X or cap:SECONDS)"
            )
        try:
            number = float(value)
        except ValueError:
            raise UsageError(f"--think-time: {name} needs a number, got {value!r}") from None
        if name == "scale":
            scale = number
        else:
            cap = number
    return ThinkTime(mode=mode, scale=scale, cap=cap)


def workload_inputs(args, path: str | None) -> dict[str, str | None]:
    """The files and folders a command's workload options read, by option (for output checks)."""
    return {"--trace" if hasattr(args, "trace") else "PATH": path,
            "--calibration": getattr(args, "calibration", None),
            "--model": model_path(getattr(args, "model", None))}


def load_from_args(args, path: str | None) -> tuple[Workload, dict]:
    """The workload the options describe (think times applied, sessions limited), and a
    JSON-ready description of how it was loaded."""
    fmt = infer_format(path, args.format)
    max_context = parse_size(args.max_context, "--max-context")
    if not 0 <= args.seed < 2**63:
        raise UsageError(f"--seed must be in [0, 2**63), got {args.seed}")
    if args.limit_sessions is not None and args.limit_sessions < 1:
        raise UsageError(f"--limit-sessions must be at least 1, got {args.limit_sessions}")
    think = parse_think_time(args.think_time)
    from_context, turns = turn_arguments(args)
    options = {}
    if fmt == "weka":
        options = dict(shared_prefix=not args.no_shared_prefix, subagents=args.subagents, overflow=args.overflow)
    workload = load_workload(fmt, path, max_context=max_context, seed=args.seed, **options)
    loaded_sessions = len(workload.sessions)
    workload = select_turns(workload, from_context=from_context, turns=turns)
    if args.limit_sessions is not None:
        workload = dataclasses.replace(workload, sessions=workload.sessions[: args.limit_sessions])
    workload = think.apply(workload)
    if not workload.num_requests:
        raise UsageError("the workload has no requests to replay")
    check_clock_range(workload)
    description = {
        "format": fmt,
        "trace": path,
        "max_context": max_context,
        "seed": args.seed if fmt == "synthetic" else None,
        "think_time": dataclasses.asdict(think),
        "limit_sessions": args.limit_sessions,
        "from_context": from_context,
        "turns": turns,
        "sessions_loaded": loaded_sessions,
        "sessions": len(workload.sessions),
        "requests": workload.num_requests,
        "loader": workload.summary.as_dict(),
    }
    if fmt == "weka":
        description.update(options)
    return workload, description
