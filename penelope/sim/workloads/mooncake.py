"""Loader of Mooncake-style JSONL traces: open-loop arrivals.

One JSON object per line: `timestamp` (ms since the start of the trace), `input_length`,
`output_length` (tokens), `hash_ids` (one id per block of `block_size` input tokens, the last
block possibly partial: `ceil(input_length / block_size)` ids, or `floor(...)` when the partial
block has none), and optionally a session field (`session_id`, `chat_id` or `conversation_id`).
Ids are global: equal ids in different requests are the same content, which is how these traces
encode shared prefixes, so they are used as keys unchanged. Blank lines are allowed.

Every request is sent at `timestamp / 1000` seconds whatever the replies do; timestamps must stay
below 2**32 s (136 years, `penelope.sim.replay.MAX_CLOCK`), which epoch milliseconds do and epoch
micro- or nanoseconds do not (they would be taken for ms, and TTFT lost to rounding). Requests
with a session field are grouped into that session in arrival order (for session completion
time); requests without one form a session each. A session value is a string or an integer, and
one file may not use both forms of one value (`1` and `"1"`: one session or two?). Requests over
`max_context` input tokens are left out and counted under `dropped["over_max_context"]`.
"""

from __future__ import annotations

from pathlib import Path

from penelope.errors import UsageError
from penelope.jsonfile import parse_json
from penelope.sim.workloads.types import (
    HUMAN,
    MAX_CLOCK,
    Request,
    Session,
    Workload,
    WorkloadError,
    WorkloadSummary,
    frozen_keys,
)

SESSION_FIELDS = ("session_id", "chat_id", "conversation_id")
# Ids must stay below this so that tail keys (above it) never collide with them.
MAX_ID = 1 << 40
# Token counts of one request: no context comes near 2G tokens.
MAX_TOKENS = 2**31 - 1


def load_mooncake(path: str | Path, *, block_size: int = 512, max_context: int | None = None) -> Workload:
    """Load a Mooncake-style JSONL file as an open-loop workload (see the module docstring).

    block_size: tokens per hash id in the file (512 in Mooncake's published traces); it need not
    equal the cache's block size, since `request_tokens` produces plain token ids."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path}: no such trace file")
    if not path.is_file():
        raise UsageError(f"{path}: not a regular file (a folder, a device or a pipe); give a JSONL trace file")
    if block_size <= 0:
        raise UsageError(f"block_size must be positive, got {block_size}")
    if max_context is not None and max_context <= 0:
        raise UsageError(f"max_context must be positive, got {max_context}")
    summary = WorkloadSummary(format="mooncake", sources=[str(path)])
    # (field, value) or line number -> [(arrival, line number, request)]
    grouped: dict[object, list[tuple[float, int, Request]]] = {}
    ordinal = 0
    try:
        # Bytes, decoded line by line, so that a bad byte is reported with its line.
        with path.open("rb") as lines:
            for number, raw in enumerate(lines, start=1):
                here = f"{path.name}:{number}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise WorkloadError(f"{here}: not UTF-8 text (byte {err.start} of the line)") from None
                if not line.strip():
                    continue
                request, session = _parse_line(line, here, block_size, ordinal)
                ordinal += 1
                if max_context is not None and request.input_tokens > max_context:
                    summary.drop("over_max_context")
                    continue
                grouped.setdefault(session or number, []).append((request.arrival, number, request))
    except OSError as err:
        raise WorkloadError(f"{path}: cannot read it ({err.strerror})") from None
    if not grouped:
        if ordinal:
            raise WorkloadError(f"{path}: all {ordinal:,} requests are longer than `max_context` {max_context:,}")
        raise WorkloadError(f"{path}: no requests")
    sessions = []
    names: dict[str, int] = {}
    for key, items in grouped.items():
        items.sort(key=lambda item: (item[0], item[1]))
        name = f"{key[0]}={key[1]}" if isinstance(key, tuple) else f"line{key}"
        if name in names:
            raise WorkloadError(f"{path.name}:{names[name]} and {path.name}:{items[0][1]}: {key[0]} {key[1]!r} appears "
                                "both as a string and as an integer; write one form, so the sessions are unambiguous")
        names[name] = items[0][1]
        sessions.append(Session(id=name, requests=tuple(item[2] for item in items)))
    # Sessions in order of their first arrival, so a replay can walk them in time order.
    sessions.sort(key=lambda s: s.requests[0].arrival)
    summary.sessions = len(sessions)
    summary.requests = sum(len(s.requests) for s in sessions)
    return Workload(sessions=tuple(sessions), block_size=block_size, closed_loop=False, summary=summary)


def _parse_line(line: str, here: str, block_size: int, ordinal: int) -> tuple[Request, tuple | None]:
    """The request on one line and its session (None without a session field)."""
    obj = parse_json(line, here, WorkloadError)
    if not isinstance(obj, dict):
        raise WorkloadError(f"{here}: expected a JSON object")
    timestamp = obj.get("timestamp")
    if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)) or not timestamp >= 0:
        raise WorkloadError(f"{here}: 'timestamp' must be a non-negative number of ms, got {timestamp!r}")
    if not timestamp <= MAX_CLOCK * 1000:
        raise WorkloadError(f"{here}: 'timestamp' {timestamp!r} ms is beyond 2**32 s (136 years); Mooncake "
                            "timestamps are milliseconds (convert epoch micro- or nanoseconds)")
    lengths = {}
    for field, minimum in (("input_length", 1), ("output_length", 0)):
        value = obj.get(field)
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_TOKENS:
            raise WorkloadError(f"{here}: '{field}' must be an integer in [{minimum}, {MAX_TOKENS}], got {value!r}")
        lengths[field] = value
    ids = obj.get("hash_ids")
    if not isinstance(ids, list):
        raise WorkloadError(f"{here}: 'hash_ids' must be a list, got {type(ids).__name__}")
    keys = frozen_keys(ids, here)
    if keys.size and (keys.min() < 0 or keys.max() >= MAX_ID):
        raise WorkloadError(f"{here}: hash ids must be in [0, 2**40), got {keys.min()}..{keys.max()}")
    n = lengths["input_length"]
    full, partial = divmod(n, block_size)
    if keys.size not in (full, full + (partial > 0)):
        raise WorkloadError(
            f"{here}: {keys.size} hash_ids for {n} input tokens in blocks of {block_size} "
            f"(expected {full if not partial else f'{full} or {full + 1}'})"
        )
    request = Request(
        keys=keys,
        input_tokens=n,
        output_tokens=lengths["output_length"],
        think_time=0.0,
        arrival=float(timestamp) / 1000.0,
        kind=HUMAN,
        tail_key=MAX_ID + ordinal,
        source=here,
    )
    return request, _session_of(obj, here)


def _session_of(obj: dict, here: str) -> tuple[str, str | int] | None:
    """(field, value) naming the request's session; the value keeps its JSON type."""
    for field in SESSION_FIELDS:
        value = obj.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise WorkloadError(f"{here}: '{field}' must be a string or an integer, got {value!r}")
        return field, value
    return None
