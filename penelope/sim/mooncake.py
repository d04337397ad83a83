"""Loader of Mooncake-style JSONL traces: open-loop arrivals.

One JSON object per line: `timestamp` (ms since the start of the trace), `input_length`,
`output_length` (tokens), `hash_ids` (one id per block of `block_size` input tokens, the last
block possibly partial: `ceil(input_length / block_size)` ids, or `floor(...)` when the partial
block has none), and optionally a session field (`session_id`, `chat_id` or `conversation_id`).
Ids are global: equal ids in different requests are the same content, which is how these traces
encode shared prefixes, so they are used as keys unchanged. Blank lines are allowed.

Every request is sent at `timestamp / 1000` seconds whatever the replies do. Requests with a
session field are grouped into that session in arrival order (for session completion time);
requests without one form a session each. Requests over `max_context` input tokens are left out
and counted under `dropped["over_max_context"]`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from penelope.errors import UsageError
from penelope.sim.workloads import (
    HUMAN,
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


def load_mooncake(path: str | Path, *, block_size: int = 512, max_context: int | None = None) -> Workload:
    """Load a Mooncake-style JSONL file as an open-loop workload (see the module docstring).

    block_size: tokens per hash id in the file (512 in Mooncake's published traces); it need not
    equal the cache's block size, since `request_tokens` produces plain token ids."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: no such trace file")
    if block_size <= 0:
        raise UsageError(f"block_size must be positive, got {block_size}")
    if max_context is not None and max_context <= 0:
        raise UsageError(f"max_context must be positive, got {max_context}")
    summary = WorkloadSummary(format="mooncake", sources=[str(path)])
    # session id -> [(arrival, line number, request)]
    grouped: dict[str, list[tuple[float, int, Request]]] = {}
    ordinal = 0
    with path.open() as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            here = f"{path.name}:{number}"
            request, session_id = _parse_line(line, here, block_size, ordinal)
            ordinal += 1
            if max_context is not None and request.input_tokens > max_context:
                summary.drop("over_max_context")
                continue
            key = session_id or f"line{number}"
            grouped.setdefault(key, []).append((request.arrival, number, request))
    if not grouped:
        raise WorkloadError(f"{path}: no requests")
    sessions = []
    for session_id, items in grouped.items():
        items.sort(key=lambda item: (item[0], item[1]))
        sessions.append(Session(id=session_id, requests=tuple(item[2] for item in items)))
    # Sessions in order of their first arrival, so a replay can walk them in time order.
    sessions.sort(key=lambda s: s.requests[0].arrival)
    summary.sessions = len(sessions)
    summary.requests = sum(len(s.requests) for s in sessions)
    return Workload(sessions=tuple(sessions), block_size=block_size, closed_loop=False, summary=summary)


def _parse_line(line: str, here: str, block_size: int, ordinal: int) -> tuple[Request, str | None]:
    """The request on one line and its session (None without a session field)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise WorkloadError(f"{here}: not valid JSON ({err.msg})") from None
    if not isinstance(obj, dict):
        raise WorkloadError(f"{here}: expected a JSON object")
    timestamp = obj.get("timestamp")
    if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)) or not timestamp >= 0:
        raise WorkloadError(f"{here}: 'timestamp' must be a non-negative number of ms, got {timestamp!r}")
    if not np.isfinite(timestamp):
        raise WorkloadError(f"{here}: 'timestamp' must be finite, got {timestamp!r}")
    lengths = {}
    for field, minimum in (("input_length", 1), ("output_length", 0)):
        value = obj.get(field)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise WorkloadError(f"{here}: '{field}' must be an integer >= {minimum}, got {value!r}")
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


def _session_of(obj: dict, here: str) -> str | None:
    for field in SESSION_FIELDS:
        value = obj.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise WorkloadError(f"{here}: '{field}' must be a string or an integer, got {value!r}")
        return f"{field}={value}"
    return None
