"""Admission of one request into the cache, the one path every caller takes.

    admission = admit(cache, tokens, reserve=k)
    # match the tokens, lock the matched path, load its CPU spans back to the GPU (tiered
    # caches), allocate slots for the holes, the positions from `compute_from` on and `k` more

If the request cannot fit now, nothing is left locked and `CacheFullError` says so: before
anything changes when even evicting every unlocked token could not make room, else after the
lock is undone (a load made before a failed allocation stands; its queued tier plans must run).

Callers: the reference engine (`penelope.cache.phantom.plan_request`), the simulator's scheduler
(`penelope.sim.scheduler`, which reserves the reply's slots up front) and the SGLang adapter
(`integration/sglang/radix_cache.py`, whose slots SGLang's own scheduler allocates, so it takes
the load step, `load_path`, only).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from penelope.cache.arguments import count, int_array
from penelope.cache.host_tier import LoadResult, TieredCache
from penelope.cache.manager import KVCache, LockHandle, MatchResult, Span
from penelope.cache.tree import BlockState
from penelope.errors import CacheFullError, InvariantError, UsageError


@dataclass(frozen=True)
class Admission:
    """A request admitted into the cache.

    - `tokens` int64 `[n]`: the request's tokens, as checked.
    - `match`: what the cache held of it; `handle`: the lock on its matched path.
    - `compute_from`: the first position the request computes (at most n - 1, so the last
      token always yields logits); `computed`: the spans it computes, its holes in position
      order then `(compute_from, n)`.
    - `slots` int64 `[n]`: the KV slot of every position (resident, loaded or its own).
    - `owned` int64: the slots allocated for it, the computed spans' in order, then the
      `reserve` ones (`reserved`); they are the caller's until inserted or freed.
    - `loaded`: the CPU spans brought back to the GPU.
    """

    tokens: np.ndarray
    match: MatchResult
    handle: LockHandle
    compute_from: int
    computed: list[tuple[int, int]]
    slots: np.ndarray
    owned: np.ndarray
    loaded: LoadResult

    @property
    def reserved(self) -> np.ndarray:
        """The slots allocated beyond the computed positions."""
        return self.owned[sum(end - start for start, end in self.computed):]


def admit(cache: KVCache, tokens, match_tokens: int | None = None, reserve: int = 0) -> Admission:
    """Admit `tokens` (ints `[n]`, n >= 1) into `cache` (see the module docstring).

    `match_tokens`: match only the first `match_tokens` tokens (SGLang matches a prompt without
    its last token); default all. `reserve`: slots to allocate beyond the computed positions
    (a reply's). Raises UsageError when the request could never fit (its tokens and the reserve
    exceed the GPU capacity) and CacheFullError (nothing locked) when it cannot fit now."""
    tokens = int_array(tokens, "tokens")
    n = len(tokens)
    if n == 0:
        raise UsageError("a request needs at least one token")
    reserve = count(reserve, "reserve")
    if match_tokens is not None and count(match_tokens, "match_tokens") > n:
        raise UsageError(f"match_tokens {match_tokens} is beyond the request's {n} tokens")
    if n + reserve > cache.capacity:
        raise UsageError(f"a request of {n} tokens{f' and {reserve} reserved slots' if reserve else ''} can never "
                         f"fit in a cache of {cache.capacity} tokens")
    match = cache.match(tokens if match_tokens is None else tokens[:match_tokens])
    compute_from = min(match.compute_from, n - 1)
    computed = [*match.holes, (compute_from, n)]
    need = sum(end - start for start, end in computed) + reserve
    to_load = sum(len(span) for span in match.loads)
    # Locking only turns evictable tokens into protected ones, so this bound is necessary.
    if need + to_load > cache.free_size() + cache.evictable_size():
        raise CacheFullError(f"a request of {n} tokens needs {need + to_load} GPU slots now; "
                             f"{cache.free_size()} are free and {cache.evictable_size()} evictable")
    handle = cache.lock(match)
    try:
        # Load, then allocate: loaded blocks are on the locked path, so the allocation's
        # demotions never send them back.
        loaded = load_path(cache, handle, match.loads)
        owned = cache.alloc(need)
    except Exception:
        cache.unlock(handle, admitted=False)
        raise
    slots = np.full(n, -1, dtype=np.int64)
    for span in match.spans:
        if span.state == BlockState.GPU:
            slots[span.start:span.end] = span.slots
    for span in loaded.spans:
        slots[span.start:span.end] = span.slots
    # Computed positions last: with the whole prompt cached, the last token still gets its own slot.
    offset = 0
    for start, end in computed:
        slots[start:end] = owned[offset:offset + end - start]
        offset += end - start
    return Admission(tokens, match, handle, compute_from, computed, slots, owned, loaded)


def load_path(cache: KVCache, handle: LockHandle, loads: list[Span]) -> LoadResult:
    """Bring the CPU spans `loads` of `handle`'s locked path to the GPU (nothing to do without).
    A cache without a CPU tier never reports any; a tiered cache must load exactly them."""
    if not loads:
        return LoadResult([], 0, 0)
    if not isinstance(cache, TieredCache):
        raise UsageError(f"the match has {len(loads)} CPU spans but {type(cache).__name__} has no CPU tier")
    result = cache.load(handle)
    got = [(span.start, span.end) for span in result.spans]
    if got != [(span.start, span.end) for span in loads]:
        raise InvariantError(f"the cache loaded spans {got}, the match reported {[(s.start, s.end) for s in loads]}")
    return result
