"""How a request with holes is refilled under a scheduler's chunk budget and request rows.

A match with holes (MISSING spans before the last resident span) can be served two ways:

- Phantoms: one prefill-only phantom per hole runs in the SAME forward as the request, which
  computes from the end of its last resident span. Cheapest (one step), but the holes and at least
  one page of the request's own tokens must fit the step's chunk budget, and every phantom needs a
  request row of its own.
- Hole-first chunks: the request itself starts at its first hole and computes the holes as its own
  chunks, jumping over the resident spans between them, then computes its new tokens. It needs one
  row and progresses under any chunk budget, so a hole larger than a chunk never starves.

Either way exactly the holes and the new tokens are computed, never a resident span. Without
chunked prefill (no continuation steps), holes that get no row are dropped instead: the request
computes from the first of them, resident spans after it included.

Positions are token positions; holes and resident spans are whole blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

from penelope.errors import UsageError


@dataclass(frozen=True)
class RefillPlan:
    """The admission of one request with holes.

    `phantoms`: holes recomputed by phantoms in the request's batch. `compute_from`: where the
    request's own extend starts. `first_chunk_end`: where its first chunk must stop (the end of
    its first hole, so it never computes the resident span after it), None when unconstrained.
    `spans`: the original (start, end, resident) spans before the request's resident end; later
    chunks use them (`next_chunk`) to jump over resident spans and stop at hole ends.
    """

    phantoms: tuple[tuple[int, int], ...]
    compute_from: int
    first_chunk_end: int | None = None
    spans: tuple[tuple[int, int, bool], ...] = ()

    @property
    def phantom_tokens(self) -> int:
        return sum(end - start for start, end in self.phantoms)

    @property
    def hole_first(self) -> bool:
        """Whether the request computes its holes itself, chunk by chunk."""
        return bool(self.spans)

    @property
    def jumped_tokens(self) -> int:
        """Resident tokens a hole-first request jumps over instead of computing: they are cached
        already, so they need no slots (a scheduler that charges the request its whole prompt
        from `compute_from` must take them off)."""
        return sum(end - start for start, end, resident in self.spans if resident)


def plan_refill(holes, compute_from: int, extend_tokens: int, chunk_budget: int | None,
                free_rows: int, page_size: int, phantoms: bool = True, own_chunk: int | None = None) -> RefillPlan:
    """Decide how a request whose match has `holes` ((start, end) pairs, in order, all before
    `compute_from`) is admitted.

    `extend_tokens`: tokens the request computes from `compute_from` (>= 1). `chunk_budget`: tokens
    the step can still compute (None: chunked prefill is off, one step runs any length).
    `free_rows`: request rows left for this request and its phantoms (>= 1). `phantoms`: whether
    phantoms may ride in the request's batch at all (False where the attention backend reads a
    batch's cached prefix before it stores the batch's K/V: a phantom's hole would be read before
    it is written). `own_chunk`: the fewest of its own tokens the request may compute beside its
    phantoms (default: one page; a scheduler that aligns chunk ends needs one alignment unit, or
    the whole extend when that is shorter).
    """
    holes = tuple((int(a), int(b)) for a, b in holes)
    _check(holes, compute_from, extend_tokens, free_rows, page_size)
    if not holes:
        return RefillPlan((), compute_from)
    hole_tokens = sum(b - a for a, b in holes)
    phantom_rows = free_rows - 1 if phantoms else 0
    if chunk_budget is None:
        # One step computes everything: drop the holes that get no row; the request computes from
        # the first dropped one.
        kept = holes[:phantom_rows]
        start = compute_from if len(kept) == len(holes) else holes[len(kept)][0]
        return RefillPlan(kept, start)
    own = min(-(-extend_tokens // page_size) * page_size, page_size if own_chunk is None else own_chunk)
    if len(holes) <= phantom_rows and hole_tokens + own <= chunk_budget:
        return RefillPlan(holes, compute_from)
    spans = []
    previous = holes[0][0]
    for a, b in holes:
        if a > previous:
            spans.append((previous, a, True))
        spans.append((a, b, False))
        previous = b
    if compute_from > previous:
        spans.append((previous, compute_from, True))
    return RefillPlan((), holes[0][0], holes[0][1], tuple(spans))


def next_chunk(plan: RefillPlan, position: int) -> tuple[int, int | None]:
    """Where a hole-first request continues from `position` (the end of its last chunk): the
    position after jumping every resident span that starts there, and the end of the hole that
    chunk must stop at (None once the holes are done)."""
    for start, end, resident in plan.spans:
        if resident and start == position:
            position = end
        elif not resident and start <= position < end:
            return position, end
    return position, None


def _check(holes, compute_from: int, extend_tokens: int, free_rows: int, page_size: int) -> None:
    if page_size < 1 or free_rows < 1 or extend_tokens < 1:
        raise UsageError(f"plan_refill needs page_size, free_rows and extend_tokens >= 1, got "
                         f"{page_size}, {free_rows}, {extend_tokens}")
    previous = 0
    for a, b in holes:
        if not previous <= a < b <= compute_from:
            raise UsageError(f"holes must be ordered, disjoint and before {compute_from}: {holes}")
        previous = b
