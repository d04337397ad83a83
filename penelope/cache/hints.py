"""Hints: what a server tells the cache about its requests besides their tokens, and the book of
waiting sessions that the agent-aware eviction policies keep from them.

The cache has no notion of time or of sessions: recency is a logical clock (docs/design.md section 3).
Policies that reason about agents need two more facts, and they get them only through
`KVCache.hint(tokens, Hint(...))`, never from globals:

- `arrived`: a request with these tokens reached the server at `now`;
- `finished`: the request with these tokens finished at `now`; its session now waits for a tool
  (`waits_for="tool"`: the reply ended in a tool call) or for a person (`"human"`), or the server
  cannot tell (None).

`now` is seconds on the caller's monotonic clock: simulated time in the simulator; in SGLang, rank
0's monotonic clock, which the plugin broadcasts to every tensor-parallel rank so that all ranks
decide alike (`integration/sglang/clock.py`). Only time-based rules read it (a TTL, an expected return); recency
stays logical. A session is recognised by its tokens alone: the record of a finished request is
its sequence's prefix hashes (`RadixTree.hasher`), so a later request that extends the sequence is
its session's next turn even after every block of it was evicted.

The offline `oracle` policy also receives `Foresight` (the session's next send time and how much
of this sequence its next request reuses). Every other policy must decide from the past, the kind
of wait and the cost model only: `KVCache.hint` refuses foresight for a policy that does not ask
for it (`EvictionPolicy.uses_foresight`).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import numpy as np

from penelope.errors import UsageError

TOOL, HUMAN = "tool", "human"
WAIT_KINDS = (TOOL, HUMAN)
ARRIVED, FINISHED = "arrived", "finished"
EVENTS = (ARRIVED, FINISHED)
# Observed waits needed before their distribution is trusted (per kind, then pooled).
MIN_OBSERVED = 3


@dataclass(frozen=True)
class Foresight:
    """The future of a finished request's session (offline oracle only).

    next_send: seconds (the caller's clock) when the session's next request is sent; `math.inf`
        when it sends none. reuse: tokens of the finished sequence that the next request starts
        with (0 when it sends none)."""

    next_send: float
    reuse: int

    def __post_init__(self) -> None:
        if math.isnan(self.next_send) or self.reuse < 0:
            raise UsageError(f"foresight needs a send time and a non-negative reuse, got {self!r}")


@dataclass(frozen=True)
class Hint:
    """One event of a request, as the server saw it (see the module docstring).

    now: seconds on the caller's monotonic clock; event: `"arrived"` or `"finished"`;
    waits_for: with `"finished"`, `"tool"`, `"human"` or None; foresight: with `"finished"`, for
    a policy with `uses_foresight` only; session: the request's session id where the server
    knows one (SGLang's `session_id`), else None; closes: with `"finished"` and a session, the
    client closes the session after this request (its last: SGLang's close_session)."""

    now: float
    event: str
    waits_for: str | None = None
    foresight: Foresight | None = None
    session: str | None = None
    closes: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.now, bool) or not isinstance(self.now, (int, float)) or not math.isfinite(self.now):
            raise UsageError(f"hint: now must be a finite number of seconds, got {self.now!r}")
        if self.event not in EVENTS:
            raise UsageError(f"hint: event must be one of {', '.join(EVENTS)}, got {self.event!r}")
        if self.waits_for is not None and self.waits_for not in WAIT_KINDS:
            raise UsageError(f"hint: waits_for must be one of {', '.join(WAIT_KINDS)} or None, "
                             f"got {self.waits_for!r}")
        if self.event == ARRIVED and (self.waits_for is not None or self.foresight is not None):
            raise UsageError("hint: an arrival carries no wait kind or foresight")
        if self.session is not None and not isinstance(self.session, str):
            raise UsageError(f"hint: session must be a string or None, got {self.session!r}")
        if self.closes is not False and (self.closes is not True or self.event != FINISHED or self.session is None):
            raise UsageError("hint: closes=True goes with a finished request of a session")


@dataclass(eq=False)
class Waiting:
    """A session between a finished request and its next arrival.

    hashes: uint64 prefix hashes of the finished sequence's whole blocks (its identity); kind:
    what it waits for; since: when it finished; pin_until: a TTL policy's pin (seconds); node:
    the tree node where the sequence ended when it finished (it may leave the tree later)."""

    hashes: np.ndarray
    kind: str | None
    since: float
    foresight: Foresight | None = None
    pin_until: float = -math.inf
    node: object = None

    @property
    def blocks(self) -> int:
        return len(self.hashes)

    def holds(self, end_block: int, end_hash: int) -> bool:
        """Whether the sequence whose last whole block is `end_block` (1-based count) with prefix
        hash `end_hash` is a prefix of this session's sequence."""
        return 0 < end_block <= len(self.hashes) and int(self.hashes[end_block - 1]) == end_hash


@dataclass
class WaitBook:
    """The sessions now waiting, the requests that arrived and have not finished (their sequences'
    hashes), the waits observed so far in this run (seconds, per kind, sorted), and the latest
    time a hint or the caller reported (`now`, never decreasing). A cached history that neither
    a waiting session nor an arrived request holds is an orphan: a branch its session left (the
    tail of a turn the next one rewrote), or a cache that never received hints.

    A returning request is recognised when its sequence contains a waiting one's, but for at most
    1/256 of that one's last blocks (in the WEKA traces 93% of turns extend the previous input
    whole and 97% keep more than 99.7% of it); a request that keeps less (a compacted context)
    starts afresh and leaves the old record waiting, where its growing wait marks it as unlikely to
    return. A first turn that is all shared prefix cannot be told apart from other sessions: any of
    them continues it."""

    waiting: list[Waiting] = field(default_factory=list)
    arrived_hashes: list[np.ndarray] = field(default_factory=list)
    observed: dict[str, list[float]] = field(default_factory=lambda: {kind: [] for kind in WAIT_KINDS})
    now: float = 0.0

    @property
    def in_system(self) -> int:
        """Requests that arrived and have not finished."""
        return len(self.arrived_hashes)

    def advance(self, now: float) -> None:
        self.now = max(self.now, float(now))

    def finished(self, hashes: np.ndarray, hint: Hint) -> Waiting:
        """Record a finished request's session as waiting; an older record of the same sequence
        (a prefix of it) is replaced. The request stops being in the system: the longest arrival
        whose sequence the finished one continues (a server may report the prompt on arrival,
        less its last token, and the prompt and reply at the finish), else the shortest one that
        continues the finished sequence (a request that ended before all its prompt was cached)."""
        shorter, longer = [], []
        for i, seen in enumerate(self.arrived_hashes):
            common = min(len(seen), len(hashes))
            if len(seen) <= len(hashes) and (not common or seen[common - 1] == hashes[common - 1]):
                shorter.append(i)
            elif len(hashes) and seen[common - 1] == hashes[common - 1]:
                longer.append(i)
        if shorter or longer:
            lengths = [len(seen) for seen in self.arrived_hashes]
            del self.arrived_hashes[max(shorter, key=lengths.__getitem__) if shorter
                                    else min(longer, key=lengths.__getitem__)]
        record = Waiting(hashes, hint.waits_for, float(hint.now), hint.foresight)
        if len(hashes):
            self.waiting = [w for w in self.waiting if not _same_session(w.hashes, hashes)]
            self.waiting.append(record)
        return record

    def arrived(self, hashes: np.ndarray, now: float) -> list[Waiting]:
        """The waiting sessions this arrival continues: their waits are observed, they stop waiting."""
        self.arrived_hashes.append(hashes)
        back = [w for w in self.waiting if _same_session(w.hashes, hashes)]
        if back:
            self.waiting = [w for w in self.waiting if not any(w is b for b in back)]
            for record in back:
                if record.kind is not None:
                    bisect.insort(self.observed[record.kind], max(0.0, float(now) - record.since))
        return back

    def sessions_of(self, end_block: int, end_hash: int) -> list[Waiting]:
        """Waiting sessions whose sequence contains the sequence ending at `end_block` blocks with
        prefix hash `end_hash` (a node's `n_blocks`-th block, by `node.end`)."""
        return [w for w in self.waiting if w.holds(end_block, end_hash)]

    def arrived_holds(self, end_block: int, end_hash: int) -> bool:
        """Whether an arrived request's sequence contains the sequence ending at `end_block` blocks
        with prefix hash `end_hash`."""
        return any(0 < end_block <= len(h) and int(h[end_block - 1]) == end_hash for h in self.arrived_hashes)

    def counts(self) -> dict[str, int]:
        """How many waits of each kind were observed and how many sessions wait now, per kind
        (`unknown`: finished without a kind), plus the requests in the system."""
        waiting = {kind: sum(w.kind == kind for w in self.waiting) for kind in WAIT_KINDS}
        return {**{f"observed_{kind}": len(waits) for kind, waits in self.observed.items()},
                **{f"waiting_{kind}": n for kind, n in waiting.items()},
                "waiting_unknown": len(self.waiting) - sum(waiting.values()), "in_system": self.in_system}

    def waits(self, kind: str | None) -> list[float]:
        """Observed waits of `kind` (all kinds pooled for None), sorted."""
        if kind is not None:
            return self.observed[kind]
        return sorted(self.observed[TOOL] + self.observed[HUMAN])

    def expected_remaining(self, record: Waiting) -> float:
        """Median of the remaining wait (seconds) of a waiting session, given how long it has
        waited: over the observed waits of its kind that are longer than that, or of all kinds while
        fewer than `MIN_OBSERVED` of its kind were seen; inf when none observed is longer (it has
        waited longer than any session came back after). Before `MIN_OBSERVED` waits of any kind
        were observed: the elapsed wait itself (a heavy-tailed wait's remaining part grows with its
        age), so the order is least recently used until the run has data."""
        elapsed = max(0.0, self.now - record.since)
        for waits in ((self.observed[record.kind],) if record.kind is not None else ()) + (self.waits(None),):
            if len(waits) >= MIN_OBSERVED:
                longer = waits[bisect.bisect_right(waits, elapsed):]
                return longer[len(longer) // 2] - elapsed if longer else math.inf
        return elapsed


def _same_session(old: np.ndarray, new: np.ndarray) -> bool:
    """`new` continues `old`: they agree on all of `old`'s blocks but at most 1/256 of them."""
    need = len(old) - len(old) // 256
    if need == 0:
        return False
    return len(new) >= need and len(old) >= need and bool(old[need - 1] == new[need - 1])
