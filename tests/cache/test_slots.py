"""SlotAllocator: the free list of KV pool slots and its ownership checks."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from penelope.cache.slots import SlotAllocator
from penelope.errors import InvariantError, UsageError


def test_fresh_pool_hands_out_contiguous_blocks_in_order():
    pool = SlotAllocator(16, block_size=4)
    assert pool.alloc(4).tolist() == [0, 1, 2, 3]
    assert pool.alloc(6).tolist() == [4, 5, 6, 7, 8, 9]
    assert pool.free_size() == 6 and pool.outstanding_size() == 10
    assert pool.alloc(7) is None and pool.free_size() == 6


def test_free_then_alloc_reuses_slots():
    pool = SlotAllocator(8)
    slots = pool.alloc(8)
    pool.free(slots[2:5])
    assert sorted(pool.alloc(3).tolist()) == [2, 3, 4]
    pool.check(np.empty(0, dtype=np.int64))


def test_adopt_and_release_move_slots_through_the_cache():
    pool = SlotAllocator(8)
    slots = pool.alloc(8)
    pool.check_outstanding(slots)
    pool.adopt(slots[:4])
    pool.check(slots[:4])
    assert pool.outstanding_size() == 4
    pool.release(slots[:4])
    pool.free(slots[4:])
    assert pool.free_size() == 8 and pool.outstanding_size() == 0
    pool.check(np.empty(0, dtype=np.int64))


@pytest.mark.parametrize("bad, message", [
    ([9], "outside the pool"),
    ([-1], "outside the pool"),
    ([6], "not handed out by alloc \\(it is free\\)"),
    ([0, 0], "appears twice"),
    ([4], "held by the cache"),
])
def test_check_outstanding_names_the_bad_slot(bad, message):
    pool = SlotAllocator(8)
    slots = pool.alloc(6)
    pool.adopt(slots[4:5])
    with pytest.raises(UsageError, match=message):
        pool.free(np.array(bad, dtype=np.int64))
    assert pool.free_size() == 2 and pool.outstanding_size() == 5


def test_check_detects_a_corrupted_free_list():
    pool = SlotAllocator(8)
    # Slots given back form the explicit part of the free list (never-used ones are implicit).
    pool.free(pool.alloc(2))
    pool._stack._stack[0] = pool._stack._stack[1]
    with pytest.raises(InvariantError, match="free list"):
        pool.check(np.empty(0, dtype=np.int64))


def test_capacity_must_be_positive():
    with pytest.raises(UsageError, match="positive"):
        SlotAllocator(0)


class EagerStack:
    """The free list as it was: every slot stored up front, popped from the end."""

    def __init__(self, size):
        self.items = list(range(size))[::-1]

    def pop(self, n):
        taken = self.items[len(self.items) - n:][::-1]
        del self.items[len(self.items) - n:]
        return taken

    def push(self, ids):
        self.items.extend(list(ids)[::-1])


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.integers(1, 300), st.lists(st.tuples(st.booleans(), st.integers(0, 300), st.randoms()), max_size=40))
def test_lazy_free_list_hands_out_what_the_eager_stack_did(size, operations):
    from penelope.cache.slots import LazyFreeList

    lazy, eager, held = LazyFreeList(size), EagerStack(size), []
    for pop, n, rng in operations:
        if pop:
            n = min(n, len(lazy))
            taken = lazy.pop(n)
            assert taken.tolist() == eager.pop(n)
            held.extend(taken.tolist())
        elif held:
            rng.shuffle(held)
            back, held = held[:n], held[n:]
            lazy.push(np.array(back, dtype=np.int64))
            eager.push(back)
        assert len(lazy) == len(eager.items) and lazy[:].tolist() == eager.items


def test_a_pool_of_a_billion_slots_stores_only_what_it_used():
    pool = SlotAllocator(2**30)
    slots = pool.alloc(100)
    pool.free(slots[:50])
    assert pool._tags.array.nbytes < 2**20 and pool._stack.returned().tolist() == slots[:50][::-1].tolist()
    assert pool.free_size() == 2**30 - 50
    pool.check(np.empty(0, dtype=np.int64))
