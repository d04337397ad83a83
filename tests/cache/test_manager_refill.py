"""KVCache.refill: a locked path's holes made resident with new slots (what SGLang's phantoms do
before their forward), against insert's result for the same slots."""
from __future__ import annotations

import numpy as np
import pytest
from cache_helpers import serve

from penelope.cache.manager import KVCache
from penelope.errors import UsageError

BS = 4
S = list(range(1000, 1008))


def holed() -> tuple[KVCache, np.ndarray]:
    """A cache whose history A lost positions [8, 12) (its front after the shared prefix)."""
    cache = KVCache(256, block_size=BS)
    a = np.asarray(S + list(range(100, 116)), dtype=np.int64)
    serve(cache, a[:16])
    serve(cache, a)
    serve(cache, np.asarray(S + list(range(200, 208)), dtype=np.int64))
    cache.evict(4)
    assert cache.match(a).holes == [(8, 12)]
    return cache, a


def test_refill_makes_the_hole_resident_with_the_new_slots():
    cache, a = holed()
    handle = cache.lock(cache.match(a))
    new = cache.alloc(4)
    free = cache.free_size()
    kept = cache.refill(handle, 8, new)
    assert np.array_equal(kept, new)
    match = cache.match(a)
    assert match.holes == [] and np.array_equal(match.spans[0].slots[8:12], new)
    assert cache.protected_size() == len(a) and cache.free_size() == free
    cache.check_invariants()
    cache.unlock(handle)
    cache.check_invariants()


def test_refill_of_resident_blocks_keeps_the_trees_slots():
    cache, a = holed()
    handle = cache.lock(cache.match(a))
    first = cache.alloc(4)
    cache.refill(handle, 8, first)
    again = cache.alloc(8)
    kept = cache.refill(handle, 4, again)
    tree = cache.match(a).spans[0].slots
    assert np.array_equal(kept, tree[4:12])
    assert not np.isin(again, kept).any()  # none taken: they are the caller's to free
    cache.free(again)
    cache.unlock(handle)
    cache.check_invariants()


def test_refill_gives_the_tree_what_insert_would():
    slots = {}
    for how in ("insert", "refill"):
        cache, a = holed()
        match = cache.match(a)
        handle = cache.lock(match)
        new = cache.alloc(4)
        if how == "insert":
            row = np.concatenate([match.spans[0].slots, new, match.spans[2].slots])
            cache.insert(a, row)
        else:
            cache.refill(handle, 8, new)
        cache.unlock(handle)
        cache.check_invariants()
        slots[how] = (cache.match(a).spans[0].slots.tolist(), cache.free_size(), cache.evictable_size())
    assert slots["insert"] == slots["refill"]


@pytest.mark.parametrize(("start", "n", "message"), [
    (6, 4, "whole blocks"), (8, 3, "whole blocks"), (20, 8, "past the locked path"),
])
def test_bad_refills_change_nothing(start, n, message):
    cache, a = holed()
    handle = cache.lock(cache.match(a))
    new = cache.alloc(n)
    before = (cache.match(a).holes, cache.free_size(), cache.outstanding_size())
    with pytest.raises(UsageError, match=message):
        cache.refill(handle, start, new)
    assert (cache.match(a).holes, cache.free_size(), cache.outstanding_size()) == before
    cache.check_invariants()


def test_refill_refuses_slots_it_holds_or_an_unlocked_handle():
    cache, a = holed()
    match = cache.match(a)
    handle = cache.lock(match)
    with pytest.raises(UsageError, match="held by the cache"):
        cache.refill(handle, 8, match.spans[0].slots[:4])
    cache.unlock(handle)
    with pytest.raises(UsageError, match="active handle"):
        cache.refill(handle, 8, cache.alloc(4))
