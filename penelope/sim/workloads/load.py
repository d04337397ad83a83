"""Loading a workload: by format name (`load_workload`, the one place that knows every trace
reader), or whole from a `WorkloadSpec` (`load`: format inferred from the path, turns selected,
sessions limited, think times applied). Errors name the spec's fields in backquotes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from penelope.errors import UsageError
from penelope.sim.replay import check_clock_range
from penelope.sim.workloads.mooncake import load_mooncake
from penelope.sim.workloads.synthetic import SyntheticConfig, generate
from penelope.sim.workloads.turns import parse_turns, select_turns
from penelope.sim.workloads.types import ThinkTime, Workload
from penelope.sim.workloads.weka import load_weka
from penelope.units import parse_size

FORMATS = ("weka", "mooncake", "synthetic")
DEFAULT_MAX_CONTEXT = "128K"


@dataclass(frozen=True)
class WorkloadSpec:
    """Which workload to replay and which part of it. `trace`: a WEKA folder or file, or a Mooncake
    JSONL (None: the synthetic workload); `format`: from the path when None; sizes as numbers or
    K/M/G text; `think_time`: recorded | tool, optionally with scale:X and cap:SECONDS."""

    trace: str | None = None
    format: str | None = None
    max_context: int | str = DEFAULT_MAX_CONTEXT
    overflow: str = "truncate"
    subagents: str = "skip"
    shared_prefix: bool = True
    seed: int = 0
    limit_sessions: int | None = None
    think_time: str = "recorded"
    from_context: int | str | None = None
    turns: int | None = None


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
    raise UsageError(f"cannot tell the format of {path}; give `format` ({', '.join(FORMATS)})")


def parse_think_time(text: str) -> ThinkTime:
    """`recorded`, `tool`, `scale:X`, `cap:S`, comma-separated (`tool,scale:0.5,cap:60`)."""
    mode, scale, cap = "recorded", 1.0, None
    given: set[str] = set()
    for item in (part.strip() for part in str(text).split(",")):
        if not item:
            continue
        kind = "recorded|tool" if item in ThinkTime.MODES else item.partition(":")[0]
        if kind in given:
            raise UsageError(f"`think_time` {text}: {item!r} contradicts or repeats an earlier item")
        given.add(kind)
        if item in ThinkTime.MODES:
            mode = item
            continue
        name, _, value = item.partition(":")
        if name not in ("scale", "cap") or not value:
            raise UsageError(
                f"`think_time`: cannot read {item!r} (use recorded, tool, scale:X or cap:SECONDS)"
            )
        try:
            number = float(value)
        except ValueError:
            raise UsageError(f"`think_time`: {name} needs a number, got {value!r}") from None
        if name == "scale":
            scale = number
        else:
            cap = number
    return ThinkTime(mode=mode, scale=scale, cap=cap)


def check(spec: WorkloadSpec) -> tuple[str, ThinkTime, int | None, int | None]:
    """Every field of `spec` that can be checked without reading the trace (the path must exist;
    `max_context` may still be None, for a caller that sets it later); returns (format, think
    time, from_context, turns). A command calls it before it starts a server or writes a model."""
    fmt = infer_format(spec.trace, spec.format)
    if fmt not in FORMATS:
        raise UsageError(f"unknown workload format {fmt!r}; choose from {', '.join(FORMATS)}")
    check_trace_given(fmt, spec.trace)
    if spec.max_context is not None:
        parse_size(spec.max_context, "`max_context`")
    if not 0 <= spec.seed < 2**63:
        raise UsageError(f"`seed` must be in [0, 2**63), got {spec.seed}")
    if spec.limit_sessions is not None and spec.limit_sessions < 1:
        raise UsageError(f"`limit_sessions` must be at least 1, got {spec.limit_sessions}")
    think = parse_think_time(spec.think_time)
    from_context, turns = parse_turns(spec.from_context, spec.turns)
    return fmt, think, from_context, turns


def load(spec: WorkloadSpec) -> tuple[Workload, dict]:
    """The workload `spec` describes (turns selected, sessions limited, think times applied), and a
    JSON-ready description of how it was loaded."""
    fmt, think, from_context, turns = check(spec)
    max_context = parse_size(spec.max_context, "`max_context`")
    options = {}
    if fmt == "weka":
        options = dict(shared_prefix=spec.shared_prefix, subagents=spec.subagents, overflow=spec.overflow)
    workload = load_workload(fmt, spec.trace, max_context=max_context, seed=spec.seed, **options)
    loaded_sessions = len(workload.sessions)
    workload = select_turns(workload, from_context=from_context, turns=turns)
    if spec.limit_sessions is not None:
        workload = dataclasses.replace(workload, sessions=workload.sessions[: spec.limit_sessions])
    workload = think.apply(workload)
    if not workload.num_requests:
        raise UsageError("the workload has no requests to replay")
    check_clock_range(workload)
    description = {
        "format": fmt,
        "trace": spec.trace,
        "max_context": max_context,
        "seed": spec.seed if fmt == "synthetic" else None,
        "think_time": dataclasses.asdict(think),
        "limit_sessions": spec.limit_sessions,
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


def check_trace_given(format: str, path) -> None:
    """A trace path where `format` reads one, none where it generates its workload."""
    if format == "weka" and path is None:
        raise UsageError("`format` weka needs a `trace` (a trace folder or files)")
    if format == "mooncake" and path is None:
        raise UsageError("`format` mooncake needs a `trace` (a JSONL file)")
    if format == "synthetic" and path is not None:
        raise UsageError("`format` synthetic takes no `trace`")


def load_workload(
    format: str,
    path: str | Path | list[str | Path] | None = None,
    *,
    max_context: int | None = None,
    seed: int = 0,
    **options,
) -> Workload:
    """Load a workload by format name (`FORMATS`). `path` is required except for `synthetic`;
    `options` go to the format's loader (`load_weka`, `load_mooncake`, `SyntheticConfig`)."""
    check_trace_given(format, path)
    if format == "weka":
        return load_weka(path, max_context=max_context, **options)
    if format == "mooncake":
        return load_mooncake(path, max_context=max_context, **options)
    if format == "synthetic":
        if max_context is not None:
            options["max_context"] = max_context
        return generate(SyntheticConfig(seed=seed, **options))
    raise UsageError(f"unknown workload format {format!r}; choose from {', '.join(FORMATS)}")
