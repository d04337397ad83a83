"""Phantom batch plans: from a cache match to the segments of ONE prefill (docs/design.md sections 1, 3, 5).

After Penelope evicts the front of a private history, the next request of that history finds a
hole: MISSING blocks before KV that is still resident. The real request computes only from
`compute_from`, but its queries attend to every earlier position, the hole included. A phantom
refills each hole in the same batch: a prefill-only segment of the SAME request row at the
hole's original positions, whose K/V goes to fresh slots that the request's `req_to_token` row
points at. Every engine layer stores the whole batch's K/V before attending, so the real
request reads the hole's K/V written in the same layer. Phantom rows produce no output token.

One request, in this order (the cache protocol of `penelope.cache.manager`)::

    plan = plan_request(cache, tokens)    # match, lock the path, load CPU spans, allocate hole + new slots
    layout = build_batch([plan])          # tokens, req_to_token, segments of one prefill
    ...forward; for each decode step:
    plan.append(cache, [token])           # one more position, its slot
    layout = build_batch([plan])          # a 1-token segment at the next position
    finish_request(cache, plan)           # insert the whole sequence, unlock

Two tiers (a `penelope.cache.host_tier.TieredCache`): the matched path's CPU spans are loaded
back by `plan_request` (`penelope.cache.admission.admit`), and loads and allocations may
demote other KV to the CPU tier. The cache only decides; the copies are `TierPlan`s it queues.
The caller must run every queued plan on its real pools, in order, after each call here that
touches the cache (`plan_request` even when it raises, `append`, `finish_request`) and before the
next forward, so the KV tensors always hold what the cache believes they hold.

`release_request` undoes a plan that will not finish (slots freed, path unlocked; loads and
demotions already made stand). This module is numpy only; the engine turns a `BatchLayout` into
tensors and runs the tier plans.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from penelope.cache.admission import admit
from penelope.cache.manager import InsertResult, KVCache, LockHandle, Span
from penelope.cache.slots import EMPTY_SLOTS
from penelope.errors import UsageError


@dataclass(frozen=True)
class PlanSegment:
    """Positions [start, end) of a request computed in the next forward; `phantom` segments
    refill a hole and give no output token."""

    start: int
    end: int
    phantom: bool

    def __len__(self) -> int:
        return self.end - self.start


@dataclass
class RequestPlan:
    """Where every position of one running request keeps its KV, and what the next forward computes.

    - `tokens` int64 `[n]`: the sequence so far (prompt, then tokens appended by decoding).
    - `slots` int64 `[n]`: pool slot of every position: the cache's slots for resident spans, the
      request's own slots for holes and computed positions. This is the request's `req_to_token`
      row.
    - `segments`: what the next forward computes: one phantom per hole (in position order), then
      the real segment; after `append`, only the appended positions.
    - `holes`: from the match. `compute_from`: first position the real request computes (at
      most n - 1, so the last prompt token always yields logits).
    - `loaded`: the CPU spans `plan_request` brought back (GPU spans, positions as in the
      match, with their new GPU slots); `loaded_tokens` of which `swapped_tokens` came through
      the swap buffer.
    - `owned` int64: the slots this request allocated (holes, new and appended positions); they
      are the caller's until `finish_request` hands them to the cache.
    """

    tokens: np.ndarray
    slots: np.ndarray
    segments: list[PlanSegment]
    holes: list[tuple[int, int]]
    compute_from: int
    lock: LockHandle
    owned: np.ndarray = field(default_factory=lambda: EMPTY_SLOTS)
    hit_tokens: int = 0
    loaded: list[Span] = field(default_factory=list)
    loaded_tokens: int = 0
    swapped_tokens: int = 0

    @property
    def phantom_tokens(self) -> int:
        """Tokens of the holes the prefill recomputes."""
        return sum(end - start for start, end in self.holes)

    def append(self, cache: KVCache, tokens) -> np.ndarray:
        """Extend the sequence by `tokens` (ints `[k]`, k >= 1) at the next positions, with new
        slots from `cache` (evicting other histories if needed, never this locked path). The next
        forward computes exactly these positions. Returns their slots, int64 `[k]`."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if not len(tokens):
            raise UsageError("append needs at least one token")
        start = len(self.tokens)
        new = cache.alloc(len(tokens))
        self.tokens = np.concatenate([self.tokens, tokens])
        self.slots = np.concatenate([self.slots, new])
        self.owned = np.concatenate([self.owned, new])
        self.segments = [PlanSegment(start, start + len(tokens), phantom=False)]
        return new


def plan_request(cache: KVCache, tokens) -> RequestPlan:
    """Admit `tokens` (ints `[n]`, n >= 1; `penelope.cache.admission.admit`: match, lock the
    matched path, load its CPU spans back to the GPU on a tiered cache, allocate slots for the
    holes and for the positions from `compute_from` on) and plan its first forward: one phantom
    per hole, then the real segment.

    Loading and allocation may demote or evict other histories; the lock keeps this request's
    KV. When the whole prompt is cached, the last token is still computed (its logits give the
    first output token) into a slot of its own, which `finish_request` frees as a duplicate.
    Raises `CacheFullError` (nothing left locked) when the cache cannot free enough slots; a load
    made before that stands, so its queued plans must still run.
    """
    admission = admit(cache, tokens)
    match, loaded = admission.match, admission.loaded
    segments = [PlanSegment(start, end, phantom=True) for start, end in match.holes]
    segments.append(PlanSegment(admission.compute_from, len(admission.slots), phantom=False))
    return RequestPlan(admission.tokens, admission.slots, segments,
                       list(match.holes), admission.compute_from, admission.handle, admission.owned,
                       match.hit_tokens, loaded.spans, loaded.loaded_tokens, loaded.swapped_tokens)


def finish_request(cache: KVCache, plan: RequestPlan) -> InsertResult:
    """Insert the plan's whole sequence with its slots (holes become resident again, new blocks
    are cached, duplicates and the partial last block are freed), then unlock its path. If the
    cache refuses the insert, the plan's slots are freed and its path unlocked before raising."""
    try:
        result = cache.insert(plan.tokens, plan.slots)
    except Exception:
        release_request(cache, plan)
        raise
    cache.unlock(plan.lock)
    return result


def release_request(cache: KVCache, plan: RequestPlan) -> None:
    """Give back what a plan holds without caching anything: its slots and its lock."""
    try:
        cache.free(plan.owned)
    finally:
        cache.unlock(plan.lock)


@dataclass(frozen=True)
class BatchLayout:
    """One forward for several request plans (request row r = plans[r]), as the engine wants it.

    - `tokens` int64 `[T]`: the query tokens, segment after segment (phantoms first).
    - `req_to_token` int32 `[R, width]`: each plan's slot row, -1 past its length.
    - `segments` int32 `[N, 4]`: rows `(req_row, q_start, pos_start, length)`.
    - `phantom` bool `[T]`: rows of phantom segments (no output token).
    - `positions` int64 `[T]`: each row's absolute position.
    - `output_rows` int64 `[R]`: the row of each request's last real token, whose logits give
      the next token.
    """

    tokens: np.ndarray
    req_to_token: np.ndarray
    segments: np.ndarray
    phantom: np.ndarray
    positions: np.ndarray
    output_rows: np.ndarray

    @property
    def phantom_tokens(self) -> int:
        return int(np.count_nonzero(self.phantom))


def segment_rows(spans) -> np.ndarray:
    """The segments of one forward, int32 `[N, 4]` rows `(req_row, q_start, pos_start, length)`,
    from its `(req_row, pos_start, length)` spans in batch order: each span's queries follow the
    previous span's. The one place a batch's holes and new tokens are laid out, for this
    package's engine and for the SGLang plugin's phantom batches."""
    rows, q_start = [], 0
    for req_row, pos_start, length in spans:
        rows.append((req_row, q_start, pos_start, length))
        q_start += length
    return np.asarray(rows, dtype=np.int32).reshape(-1, 4)


def build_batch(plans: list[RequestPlan]) -> BatchLayout:
    """Lay out the next forward of `plans`: every plan's segments (phantoms, then the real one).

    Raises UsageError when a position has no slot or when a plan's real segment is empty.
    """
    if not plans:
        raise UsageError("a batch needs at least one request plan")
    width = max(len(plan.slots) for plan in plans)
    table = np.full((len(plans), width), -1, dtype=np.int32)
    tokens, spans, phantom, positions, output_rows = [], [], [], [], []
    row = 0
    for req_row, plan in enumerate(plans):
        if np.any(plan.slots < 0):
            raise UsageError(f"request {req_row}: position {int(np.argmax(plan.slots < 0))} has no KV slot")
        table[req_row, : len(plan.slots)] = plan.slots
        real = [s for s in plan.segments if not s.phantom]
        if len(real) != 1 or not len(real[0]):
            raise UsageError(f"request {req_row}: a plan needs exactly one non-empty real segment")
        for segment in sorted(plan.segments, key=lambda s: (not s.phantom, s.start)):
            if not len(segment):
                continue
            spans.append((req_row, segment.start, len(segment)))
            tokens.append(plan.tokens[segment.start : segment.end])
            positions.append(np.arange(segment.start, segment.end, dtype=np.int64))
            phantom.append(np.full(len(segment), segment.phantom))
            row += len(segment)
            if not segment.phantom:
                output_rows.append(row - 1)
    return BatchLayout(
        tokens=np.concatenate(tokens),
        req_to_token=table,
        segments=segment_rows(spans),
        phantom=np.concatenate(phantom),
        positions=np.concatenate(positions),
        output_rows=np.asarray(output_rows, dtype=np.int64),
    )
