"""Workloads for the simulator: sessions of requests described by block keys.

A request's input is a sequence of blocks of `Workload.block_size` tokens, each named by an
int64 key (a trace's hash id, moved into a key space where ids of different sessions never
collide). Equal keys mean equal token content and, in these traces, equal history before the
block, so the cache manager sees a shared prefix wherever two inputs start with equal keys.
`request_tokens` turns keys into the token ids the cache manager works on.

Two timing modes, one per format:
- closed loop (WEKA traces, synthetic): a session sends request i, waits for the reply, waits
  `think_time` seconds, then sends request i+1. The first request's `think_time` is 0.
- open loop (Mooncake JSONL): every request is sent at its `arrival`, replies or not.

Key spaces (all non-negative int64): trace ids of session number s (0-based, in load order) live
at `session_key_base(s) + id`; the tools+system prefix shared by all sessions uses keys below
`SESSION_KEY_STRIDE`; `Request.tail_key` names the partial last block of an input.

Replies: most traces name input blocks only, and a session's next input carries new keys after
the previous input, so a reply's KV is never matched. A workload whose prompts hold the replies
(the real-server load generator's, where the next prompt is the previous prompt and reply) names
the blocks of each prompt + reply after the input's whole blocks in `Request.output_blocks`: the
simulator then caches the reply at finish (`reply_tokens`) and the next request's equal keys
match it.

The types of every workload; the trace readers live in sibling modules (`weka.py`,
`mooncake.py`, `synthetic.py`) and import only these; `load.load_workload` picks one by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from penelope.errors import UsageError

TOOL, HUMAN = "tool", "human"
KINDS = (TOOL, HUMAN)

# Trace ids of one session must stay below 2**31; tail keys use the upper half of the
# session's 2**32 range, so neither can reach the next session's range.
SESSION_KEY_STRIDE = 1 << 32
MAX_TRACE_ID = 1 << 31
# The simulated clock stays below 2**32 s (136 years), where float64 still resolves 1 us: beyond
# it, a TTFT of a few ms is lost to rounding (1e17 + 0.05 == 1e17) and tables show 0.000.
MAX_CLOCK = float(2**32)


class WorkloadError(UsageError):
    """Malformed workload input; the message names the file and the line or request index."""


def session_key_base(index: int) -> int:
    """First key of session `index`'s private range; keys below `SESSION_KEY_STRIDE` are shared."""
    return (index + 1) * SESSION_KEY_STRIDE


def tail_key(index: int, ordinal: int) -> int:
    """A key no block of any session uses: the partial last block of request `ordinal` of
    session `index` (ordinal counts every request read for that session's key range)."""
    return session_key_base(index) + MAX_TRACE_ID + ordinal


@dataclass(frozen=True, eq=False)
class Request:
    """One request of a session.

    keys: int64 `[n_blocks]`, read-only; key i covers input tokens `[i*B, (i+1)*B)` with B the
        workload's block size; the last key may cover a partial block (Mooncake). Input tokens
        past `len(keys) * B` (fewer than B) are unique to this request (`tail_key`).
    input_tokens, output_tokens: token counts of the prompt and of the reply.
    think_time: seconds between the previous reply and this send (closed loop; 0 for the first).
    arrival: seconds from the start of the replay at which this request is sent (open loop), or
        None for closed-loop workloads.
    kind: `"tool"` (an agent turn carrying tool results) or `"human"` (a user turn).
    tail_key: key of the input's partial last block.
    source: where the request came from, for messages (`trace_0008.json requests[17]`).
    output_blocks: int64 `[m]`, read-only, or None (the workload does not name the reply): keys of
        the blocks of the prompt + reply after the input's whole blocks, the block holding the
        input's partial tail (if any) first and the reply's partial last block (if any) last.
        With them, `keys` name exactly the input's whole blocks, and the tail's tokens are the
        first tokens of `output_blocks[0]` (not `tail_key`'s).
    """

    keys: np.ndarray
    input_tokens: int
    output_tokens: int
    think_time: float
    arrival: float | None
    kind: str
    tail_key: int
    source: str
    output_blocks: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.keys.ndim != 1 or self.keys.dtype != np.int64:
            raise UsageError(f"{self.source}: keys must be a 1-D int64 array, got {self.keys.dtype}")
        blocks = self.output_blocks
        if blocks is not None and (not isinstance(blocks, np.ndarray) or blocks.ndim != 1 or blocks.dtype != np.int64):
            raise UsageError(f"{self.source}: output_blocks must be a 1-D int64 array or None")
        if self.input_tokens < 0 or self.output_tokens < 0 or not self.think_time >= 0:
            raise UsageError(f"{self.source}: token counts and think_time must be non-negative")
        if self.kind not in KINDS:
            raise UsageError(f"{self.source}: kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def n_blocks(self) -> int:
        return int(self.keys.shape[0])


@dataclass(frozen=True, eq=False)
class Session:
    """A conversation replayed in order. `parent` names the session a replayed sub-agent came from."""

    id: str
    requests: tuple[Request, ...]
    parent: str | None = None


@dataclass
class WorkloadSummary:
    """What a loader read and what it left out, with counts (nothing is dropped silently).

    dropped: requests left out, by reason (for example `"subagent"`, `"over_max_context"`).
    sessions_skipped: whole sessions left out, by reason.
    sessions_truncated: sessions cut before their first request over `max_context`.
    subagents: sub-agent conversations found; subagents_replayed: those replayed as sessions.
    think_time_derived: requests whose missing think_time was computed from their timestamps.
    """

    format: str
    sources: list[str] = field(default_factory=list)
    sessions: int = 0
    requests: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    sessions_skipped: dict[str, int] = field(default_factory=dict)
    sessions_truncated: int = 0
    subagents: int = 0
    subagents_replayed: int = 0
    think_time_derived: int = 0

    def drop(self, reason: str, count: int = 1) -> None:
        if count:
            self.dropped[reason] = self.dropped.get(reason, 0) + count

    def skip_session(self, reason: str) -> None:
        self.sessions_skipped[reason] = self.sessions_skipped.get(reason, 0) + 1

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True, eq=False)
class Workload:
    """Sessions to replay. `closed_loop` says how to time them (see the module docstring)."""

    sessions: tuple[Session, ...]
    block_size: int
    closed_loop: bool
    summary: WorkloadSummary

    @property
    def num_requests(self) -> int:
        return sum(len(s.requests) for s in self.sessions)

    def requests(self) -> Iterator[tuple[Session, int, Request]]:
        """Every (session, index in session, request), sessions in order."""
        for session in self.sessions:
            for i, request in enumerate(session.requests):
                yield session, i, request

    def tokens(self, request: Request) -> np.ndarray:
        """Token ids of `request`'s input (see `request_tokens`)."""
        return request_tokens(request, self.block_size)

    def reply_tokens(self, request: Request) -> np.ndarray | None:
        """Token ids of `request`'s reply, or None (see `reply_tokens`)."""
        return reply_tokens(request, self.block_size)


def frozen_keys(values, where: str) -> np.ndarray:
    """A read-only int64 1-D array of keys; raises WorkloadError for non-integers."""
    try:
        array = np.asarray(values)
    except (ValueError, TypeError, OverflowError):
        # Ragged nesting ([[1], [2, 3]]) and the like.
        raise WorkloadError(f"{where}: hash ids must be a flat list of integers") from None
    if array.ndim != 1:
        raise WorkloadError(f"{where}: hash ids must be a flat list of integers")
    if array.size == 0:
        array = np.zeros(0, dtype=np.int64)
    elif array.dtype.kind not in "iu" or array.dtype == np.uint64:
        raise WorkloadError(f"{where}: hash ids must be integers")
    array = array.astype(np.int64, copy=False)
    array.flags.writeable = False
    return array


def request_tokens(request: Request, block_size: int) -> np.ndarray:
    """Token ids of a request's input, int64 `[input_tokens]`.

    Block key k becomes tokens `k*B .. k*B+B-1` (B = block_size), so inputs that share keys share
    tokens and different keys never produce equal tokens. The last key may cover a partial block.
    Tokens past the keys get `tail_key*B + j`, unique to the request, or, where the request names
    its reply's blocks, `output_blocks[0]*B + j` (the tail's block continues into the reply)."""
    n = request.input_tokens
    if request.output_blocks is not None:
        return _sequence_tokens(request, block_size)[:n]
    offsets = np.arange(block_size, dtype=np.int64)
    covered = min(request.n_blocks * block_size, n)
    tokens = np.empty(n, dtype=np.int64)
    # [n_blocks, B] -> flat; the last key may be only partly used.
    tokens[:covered] = (request.keys[:, None] * block_size + offsets).reshape(-1)[:covered]
    tokens[covered:] = request.tail_key * block_size + offsets[: n - covered]
    return tokens


def reply_tokens(request: Request, block_size: int) -> np.ndarray | None:
    """Token ids of a request's reply as the next prompt holds them, int64 `[output_tokens]`, or
    None where the request does not name its reply's blocks (`Request.output_blocks`)."""
    if request.output_blocks is None:
        return None
    return _sequence_tokens(request, block_size)[request.input_tokens:]


def _sequence_tokens(request: Request, block_size: int) -> np.ndarray:
    """Token ids of prompt + reply, int64 `[input_tokens + output_tokens]`, from `keys` then
    `output_blocks`; refuses block counts that do not cover exactly that sequence."""
    n, total = request.input_tokens, request.input_tokens + request.output_tokens
    blocks = request.output_blocks
    if request.n_blocks != n // block_size or request.n_blocks + len(blocks) != -(-total // block_size):
        raise UsageError(f"{request.source}: {request.n_blocks} input and {len(blocks)} output block keys do not "
                         f"name the {n} // {block_size} whole input blocks and the blocks of {total} prompt + "
                         "reply tokens after them")
    keys = np.concatenate([request.keys, blocks])
    offsets = np.arange(block_size, dtype=np.int64)
    return (keys[:, None] * block_size + offsets).reshape(-1)[:total]


@dataclass(frozen=True)
class ThinkTime:
    """How closed-loop waits are replayed.

    mode: `"recorded"` keeps every wait; `"tool"` replaces each human wait (before a `human`
        request, not the first of a session) with the median recorded tool wait of the workload
        (8 s if it has none), because human waits (median 131 s, some hours) otherwise dominate
        session completion time.
    scale: factor applied after the mode; cap: upper bound in seconds applied last (None: none).
    """

    mode: str = "recorded"
    scale: float = 1.0
    cap: float | None = None

    MODES = ("recorded", "tool")

    def __post_init__(self) -> None:
        if self.mode not in self.MODES:
            raise UsageError(f"`think_time`: unknown mode {self.mode!r}; choose from {', '.join(self.MODES)}")
        if not np.isfinite(self.scale) or self.scale < 0:
            raise UsageError(f"`think_time` scale must be a non-negative number, got {self.scale}")
        if self.cap is not None and not 0 <= self.cap < np.inf:
            raise UsageError(f"`think_time` cap must be a finite non-negative number of seconds, got {self.cap}")

    def apply(self, workload: Workload) -> Workload:
        """A copy of `workload` with waits changed; arrivals of open-loop requests are untouched."""
        if self.mode == "recorded" and self.scale == 1.0 and self.cap is None:
            return workload
        tool_waits = [r.think_time for s in workload.sessions for r in s.requests[1:] if r.kind == TOOL]
        replacement = float(np.median(tool_waits)) if tool_waits else 8.0
        sessions = []
        for session in workload.sessions:
            requests = []
            for i, request in enumerate(session.requests):
                wait = request.think_time
                if self.mode == "tool" and i > 0 and request.kind == HUMAN:
                    wait = replacement
                wait *= self.scale
                if self.cap is not None:
                    wait = min(wait, self.cap)
                requests.append(dataclasses.replace(request, think_time=wait))
            sessions.append(dataclasses.replace(session, requests=tuple(requests)))
        return dataclasses.replace(workload, sessions=tuple(sessions))


def workload_stats(workload: Workload) -> dict[str, float]:
    """Statistics to compare a workload with the paper's (all token figures in tokens, waits in s).

    A transition (request i -> i+1 of a session) is an `extension` when request i's keys are a
    prefix of request i+1's, and a `compaction` when request i+1 keeps less than half of request
    i's blocks as its prefix. Percentiles use linear interpolation (numpy's default)."""
    inputs, outputs, tool_waits, human_waits = [], [], [], []
    transitions = extensions = compactions = 0
    for session in workload.sessions:
        previous = None
        for i, request in enumerate(session.requests):
            inputs.append(request.input_tokens)
            outputs.append(request.output_tokens)
            if i > 0:
                (tool_waits if request.kind == TOOL else human_waits).append(request.think_time)
            if previous is not None:
                transitions += 1
                kept = common_prefix(previous.keys, request.keys)
                extensions += kept == previous.n_blocks
                compactions += kept < previous.n_blocks / 2
            previous = request
    counts = [len(s.requests) for s in workload.sessions]

    def pct(values, q):
        return float(np.percentile(values, q)) if values else float("nan")

    return {
        "sessions": len(workload.sessions),
        "requests": workload.num_requests,
        "requests_per_session": float(np.mean(counts)) if counts else 0.0,
        "input_p10": pct(inputs, 10),
        "input_p50": pct(inputs, 50),
        "input_p90": pct(inputs, 90),
        "input_max": float(max(inputs)) if inputs else 0.0,
        "output_p50": pct(outputs, 50),
        "output_mean": float(np.mean(outputs)) if outputs else float("nan"),
        "extension_fraction": extensions / transitions if transitions else float("nan"),
        "compaction_fraction": compactions / transitions if transitions else float("nan"),
        "tool_wait_p50": pct(tool_waits, 50),
        "tool_wait_p90": pct(tool_waits, 90),
        "human_wait_p50": pct(human_waits, 50),
        "human_fraction": len(human_waits) / max(1, len(human_waits) + len(tool_waits)),
    }


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading entries `a` and `b` share."""
    n = min(a.shape[0], b.shape[0])
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n
