"""Slot allocator: which rows of a token-indexed KV pool are free.

A slot is one token's row in the KV pool (SGLang's `out_cache_loc`). The cache stores whole
blocks, so slots enter and leave the tree a block at a time; callers may hold any number of
slots while a request runs. Every slot is in exactly one of three places: the free list, a
caller's hands (`alloc` gave it out, `free` or the cache's `insert` takes it back), or the tree.

Any object with the same methods can stand in (the SGLang adapter wraps SGLang's allocator):
`capacity`, `free_size()`, `alloc(n)`, `free(slots)`, `check_outstanding(slots)`,
`adopt(slots)` and `release(slots)`; the checks may be no-ops there.
"""
from __future__ import annotations

import numpy as np

from penelope.errors import InvariantError, UsageError

_FREE, _OUT, _CACHED = 0, 1, 2


class SlotAllocator:
    """Free list over slots `0 .. capacity-1`, with an owner tag per slot for validation."""

    def __init__(self, capacity: int, block_size: int = 64):
        if capacity < 1:
            raise UsageError(f"slot pool capacity must be positive, got {capacity}")
        self.capacity = int(capacity)
        self.block_size = int(block_size)
        # A stack popped from the end: lay it out so that pops hand out slots block by block,
        # ascending, which keeps a fresh pool's blocks contiguous.
        self._stack = np.arange(self.capacity, dtype=np.int64)[::-1].copy()
        self._top = self.capacity
        self._owner = np.zeros(self.capacity, dtype=np.int8)
        self._stamp = np.zeros(self.capacity, dtype=np.int64)
        self._outstanding = 0

    def free_size(self) -> int:
        """Slots on the free list."""
        return self._top

    def outstanding_size(self) -> int:
        """Slots handed to callers and not yet returned (to `free` or to the cache)."""
        return self._outstanding

    def alloc(self, n: int) -> np.ndarray | None:
        """`n` free slots (int64 [n]), or None when fewer are free. Never evicts."""
        if n > self._top:
            return None
        slots = self._stack[self._top - n:self._top][::-1].copy()
        self._top -= n
        self._owner[slots] = _OUT
        self._outstanding += n
        return slots

    def check_outstanding(self, slots: np.ndarray) -> None:
        """Raise UsageError unless `slots` are distinct slots currently held by a caller."""
        if not len(slots):
            return
        low, high = int(slots.min()), int(slots.max())
        if low < 0 or high >= self.capacity:
            raise UsageError(f"slot {low if low < 0 else high} is outside the pool [0, {self.capacity})")
        if not np.all(self._owner[slots] == _OUT):
            bad = slots[self._owner[slots] != _OUT][0]
            where = "free" if self._owner[bad] == _FREE else "held by the cache"
            raise UsageError(f"slot {int(bad)} was not handed out by alloc (it is {where})")
        # Duplicates: write each slot's index, read it back; a repeated slot reads a later index.
        order = np.arange(len(slots), dtype=np.int64)
        self._stamp[slots] = order
        if not np.array_equal(self._stamp[slots], order):
            dup = slots[self._stamp[slots] != order][0]
            raise UsageError(f"slot {int(dup)} appears twice")

    def free(self, slots: np.ndarray) -> None:
        """Return slots a caller holds to the free list."""
        self.check_outstanding(slots)
        self._push(slots)
        self._outstanding -= len(slots)

    def adopt(self, slots: np.ndarray) -> None:
        """The cache takes slots a caller held (already checked with `check_outstanding`)."""
        self._owner[slots] = _CACHED
        self._outstanding -= len(slots)

    def release(self, slots: np.ndarray) -> None:
        """The cache gives back slots of evicted blocks."""
        self._push(slots)

    def check(self, cached: np.ndarray) -> None:
        """Verify the free list and owner tags against the slots the tree holds (`cached`)."""
        free = self._stack[:self._top]
        if len(np.unique(free)) != len(free) or np.any(self._owner[free] != _FREE):
            raise InvariantError("free list holds a slot twice or a slot that is not free")
        if np.count_nonzero(self._owner == _FREE) != self._top:
            raise InvariantError("a slot tagged free is missing from the free list")
        if len(np.unique(cached)) != len(cached) or np.any(self._owner[cached] != _CACHED):
            raise InvariantError("the tree holds a slot twice or a slot not tagged as cached")
        if np.count_nonzero(self._owner == _CACHED) != len(cached):
            raise InvariantError("a slot tagged cached is not in the tree")
        if np.count_nonzero(self._owner == _OUT) != self._outstanding:
            raise InvariantError("outstanding slot count disagrees with the owner tags")

    def _push(self, slots: np.ndarray) -> None:
        n = len(slots)
        self._stack[self._top:self._top + n] = slots[::-1]
        self._top += n
        self._owner[slots] = _FREE
