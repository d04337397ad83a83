"""Command-line options of a workload, shared by `simulate`, `analyze`, `load` and `ab`: which
workload to load, which of its turns, how to replay its waits (`penelope.sim.workloads.load.WorkloadSpec`)."""

from __future__ import annotations

import dataclasses

from penelope.costmodel.shapes import model_path
from penelope.errors import UsageError
from penelope.sim.workloads.load import DEFAULT_MAX_CONTEXT, FORMATS, WorkloadSpec, check, infer_format, load
from penelope.sim.workloads.turns import BELOW_FROM_CONTEXT
from penelope.sim.workloads.types import Workload
from penelope.sim.workloads.weka import OVERFLOW_MODES, SUBAGENT_MODES
from penelope.units import MAX_SIZE

__all__ = ["DEFAULT_MAX_CONTEXT", "add_turn_arguments", "add_workload_arguments", "load_from_args", "workload_spec"]

# Options that apply to some workloads only, with their defaults (attribute -> (default, what it
# applies to)). `simulate`, `analyze`, `load` and `ab` leave them unset (`leave_scoped_unset`), so
# that one given for a workload it does not apply to is refused with one line
# (`check_workload_options`) instead of being ignored: closed-loop options with an open-loop
# (Mooncake) trace, WEKA options with another format. `no_shared_prefix` is a flag: given when set.
# (`--prime` with an open-loop trace is refused by `penelope.loadgen.prime.check_prime`.)
CLOSED_LOOP, WEKA = "closed loop", "weka"
SCOPED = {"sessions": (4, CLOSED_LOOP), "think_time": ("recorded", CLOSED_LOOP),
          "overflow": ("truncate", WEKA), "subagents": ("skip", WEKA), "no_shared_prefix": (False, WEKA)}
# The attribute on a command's options that holds the scoped options the user gave.
_GIVEN = "_scoped_options_given"
# A context bound no trace request reaches (token counts are below 2**31): a trace read before the
# server says its context is read whole.
UNBOUNDED = MAX_SIZE


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


def workload_inputs(args, path: str | None) -> dict[str, str | None]:
    """The files and folders a command's workload options read, by option (for output checks)."""
    return {"--trace" if hasattr(args, "trace") else "PATH": path,
            "--calibration": getattr(args, "calibration", None),
            "--model": model_path(getattr(args, "model", None))}


def add_turn_arguments(parser) -> None:
    """--turns and --from-context."""
    parser.add_argument("--turns", type=int, metavar="N",
                        help="replay at most N requests of each session (from --from-context's, else the first)")
    parser.add_argument("--from-context", metavar="TOKENS",
                        help="start each session at its first request of at least TOKENS trace tokens (e.g. 96K; "
                        "before --scale), its whole history as the first prompt; sessions that never reach it "
                        "are left out")


def workload_spec(args, path: str | None) -> WorkloadSpec:
    """The `WorkloadSpec` of a command's workload options; `path`: the trace (`--trace` or PATH)."""
    return WorkloadSpec(trace=path, format=args.format, max_context=args.max_context, overflow=args.overflow,
                        subagents=args.subagents, shared_prefix=not args.no_shared_prefix, seed=args.seed,
                        limit_sessions=args.limit_sessions, think_time=args.think_time,
                        from_context=getattr(args, "from_context", None), turns=getattr(args, "turns", None))


def leave_scoped_unset(parser) -> None:
    """`SCOPED`'s valued options default to None on `parser` (called after they are added):
    `fill_scoped_defaults` tells the given ones."""
    parser.set_defaults(**{name: None for name, (default, _) in SCOPED.items() if default is not False})


def fill_scoped_defaults(args) -> set[str]:
    """Set `SCOPED`'s options that were not given to their defaults; returns the names of those given.
    The names are kept on `args`, so a second call on the same options returns them again rather
    than taking the defaults it set for given options."""
    given = getattr(args, _GIVEN, None)
    if given is not None:
        return set(given)
    given = set()
    for name, (default, _) in SCOPED.items():
        value = getattr(args, name, None)
        if value is None:
            setattr(args, name, default)
        elif value is not False:
            given.add(name)
    setattr(args, _GIVEN, frozenset(given))
    return given


def check_workload_options(args, path: str | None, given: set[str] = frozenset()) -> str:
    """The workload options checked before a command starts a server or writes a model
    (`penelope.sim.workloads.load.check`), and that every option in `given` (`fill_scoped_defaults`)
    applies to the workload; returns its format."""
    spec = workload_spec(args, path)
    fmt = infer_format(spec.trace, spec.format)
    # An option given for a workload it does not apply to is named before its value is read.
    for name in sorted(given, key=list(SCOPED).index) if fmt in FORMATS else ():
        flag = "--" + name.replace("_", "-")
        applies = SCOPED[name][1]
        if applies == CLOSED_LOOP and fmt == "mooncake":
            raise UsageError(f"{flag} applies to closed-loop workloads (WEKA, synthetic) only: a Mooncake trace is "
                             "replayed open loop, every request at its recorded time")
        if applies == WEKA and fmt != "weka":
            raise UsageError(f"{flag} applies to WEKA traces only, not to "
                             + ("a Mooncake trace" if fmt == "mooncake" else "the synthetic workload"))
    return check(spec)[0]


def load_from_args(args, path: str | None, max_context: int | str | None = None) -> tuple[Workload, dict]:
    """The workload the options describe and how it was loaded (`penelope.sim.workloads.load.load`);
    `max_context`: in place of `args.max_context` (e.g. `UNBOUNDED`)."""
    spec = workload_spec(args, path)
    if max_context is not None:
        spec = dataclasses.replace(spec, max_context=max_context)
    return load(spec)


def read_early(args, path: str | None) -> tuple[Workload, dict, bool] | None:
    """The workload read before any server is contacted or started, so that a trace that does not
    parse or leaves no request to replay is named first: (workload, description, final). With
    `args.max_context` it is the workload to replay (final); without it (the server's or the model's
    context will set it) a trace is read whole (`UNBOUNDED`), to check it, and read again once the
    bound is known (not final): a bound only leaves requests out. None: the synthetic workload
    without `args.max_context` (nothing to read; it is generated for its context)."""
    if args.max_context is not None:
        return (*load_from_args(args, path), True)
    if path is not None:
        return (*load_from_args(args, path, max_context=UNBOUNDED), False)
    return None


def left_out_line(workload: Workload, from_context: int | None) -> str | None:
    """What `--from-context` left out, for the command's header (None: nothing)."""
    count = workload.summary.sessions_skipped.get(BELOW_FROM_CONTEXT, 0)
    if not count:
        return None
    sessions = "1 session that never reaches it" if count == 1 else f"{count:,} sessions that never reach it"
    return f"--from-context {from_context:,}: left out {sessions}"
