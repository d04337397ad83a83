"""`simulate --scale S`: the workload as `penelope load --scale S` sends it to a server.

The load generator (`penelope.loadgen.tokens`) divides every token count B of the trace by S:
a block of B tokens becomes `max(1, round(B / S))` tokens, a prompt or a reply of n tokens
`max(1, round(n / S))` (`TokenSpace.count`). It lays each prompt out with `layout`: a first
turn is its blocks' key tokens then fresh tokens up to its length; a turn that extends its
history is the previous prompt, the previous reply, then fresh tokens (so a prompt can be longer
than its scaled trace count, never shorter than its history); a compaction keeps the shared
blocks' tokens of the previous prompt and reply, then its own blocks' key tokens, then fresh ones.

`scale_workload` replays exactly those prompts: it lays them out with the load generator's own
`layout` and `TokenSpace.count`, replies of the length asked for (the server stops there, end
tokens ignored), and names every token by a key of its own (a workload of block size 1), so a
prompt's tokens are equal to another's wherever the load generator's are:
- key token j of trace key k: `k * per_block + j` (per_block the scaled block size), shared by
  every prompt that holds key k (the prefix all sessions share among them);
- fresh tokens and reply tokens: keys from `FRESH_BASE` up, new for every segment, carried on in
  the prompts that hold that segment.
Every request names its reply's tokens (`Request.output_blocks`, one key a token): the simulator
caches prompt and reply at finish, as the server does, and a next turn that holds the reply
matches it. A server caches every reply, those no later prompt holds too (open loop, a session's
last turn), so every reply is named.

Applied after `--from-context`, `--turns`, `--limit-sessions` and think times, as the load
generator applies its scale: those options count trace tokens.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from penelope.errors import UsageError
from penelope.loadgen.tokens import TokenSpace, layout, planned_lengths
from penelope.memory import check_memory
from penelope.sim.workloads.types import Request, Session, Workload, frozen_keys

# Keys of fresh and reply tokens start here; key tokens of trace keys stay below it.
FRESH_BASE = 1 << 62


def check_scale(scale) -> float:
    """`scale` as a float; UsageError unless a finite number of at least 1."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale < 1:
        raise UsageError(f"`scale` must be a number of at least 1 (it divides token counts), got {scale!r}")
    return float(scale)


def scale_workload(workload: Workload, scale: float) -> Workload:
    """`workload` as the load generator sends it at `scale` (see the module docstring): block size
    1, every request's keys its prompt's tokens, `input_tokens` and `output_tokens` scaled."""
    space = TokenSpace(vocab=2, scale=check_scale(scale))
    per_block = space.count(workload.block_size)
    largest = max((int(r.keys.max()) for _, _, r in workload.requests() if r.n_blocks), default=0)
    if (largest + 1) * per_block > FRESH_BASE:
        raise UsageError(f"`scale` {scale:g}: the trace's keys (up to {largest:,}) leave no room for fresh tokens")
    total = sum(_planned_total(space, workload.block_size, session, workload.closed_loop)
                for session in workload.sessions)
    check_memory(8 * total, f"`scale` {scale:g}: the {total:,} prompt tokens of the scaled workload")
    fresh = _Fresh()
    sessions = tuple(_scaled_session(session, space, per_block, workload.closed_loop, fresh)
                     for session in workload.sessions)
    return dataclasses.replace(workload, sessions=sessions, block_size=1)


class _Fresh:
    """Keys never used before, from `FRESH_BASE` up."""

    def __init__(self) -> None:
        self.next = FRESH_BASE

    def take(self, n: int) -> np.ndarray:
        keys = np.arange(self.next, self.next + n, dtype=np.int64)
        self.next += n
        return keys


def _planned_total(space: TokenSpace, block_size: int, session: Session, closed_loop: bool) -> int:
    return sum(prompt for prompt, _ in planned_lengths(space, block_size, session, closed_loop))


def _scaled_session(session: Session, space: TokenSpace, per_block: int, closed_loop: bool,
                    fresh: _Fresh) -> Session:
    offsets = np.arange(per_block, dtype=np.int64)
    ids = np.zeros(0, dtype=np.int64)
    reply = np.zeros(0, dtype=np.int64)
    previous: Request | None = None
    requests = []
    for request in session.requests:
        before = previous if closed_loop else None
        history = ids.size + reply.size if before is not None else 0
        plan = layout(before, request, history, per_block, space.count(request.input_tokens))
        # [blocks, per_block] -> flat: key k's tokens k * per_block + j.
        keyed = (request.keys[plan.first_block:, None] * per_block + offsets).reshape(-1)[: plan.keyed]
        kept = np.concatenate([ids, reply])[: plan.keep] if before is not None else ids[:0]
        ids = np.concatenate([kept, keyed, fresh.take(plan.fresh)])
        output = space.count(request.output_tokens)
        reply = fresh.take(output)
        requests.append(dataclasses.replace(request, keys=frozen_keys(ids, request.source), input_tokens=int(ids.size),
                                            output_tokens=output, output_blocks=frozen_keys(reply, request.source)))
        previous = request
    return dataclasses.replace(session, requests=tuple(requests))
