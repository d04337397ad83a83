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
# First size of the lazily grown arrays (ids); they double from there.
_FIRST_GROWTH = 4096


class LazyFreeList:
    """The free ids among `0 .. size-1`, handed out as from a stack: ids given back come out first
    (last in, first out), then ids never handed out, in ascending order, so a fresh pool hands out
    contiguous runs. Memory grows with the ids ever handed out, not with `size`: a pool of 2**30
    slots costs nothing until it is used (allocating it up front took 17 bytes per slot)."""

    def __init__(self, size: int):
        self.size = int(size)
        # Ids >= `fresh` were never handed out; they sit below the explicit stack.
        self.fresh = 0
        self._stack = np.empty(0, dtype=np.int64)
        self._top = 0

    def __len__(self) -> int:
        return self._top + self.size - self.fresh

    def returned(self) -> np.ndarray:
        """The ids given back and not handed out again (a view, top of the stack last)."""
        return self._stack[:self._top]

    def __getitem__(self, index):
        """Entries of the whole stack, bottom first, as if every free id were stored (a copy, of
        `len(self)` ids: for tests and debugging)."""
        never_used = np.arange(self.size - 1, self.fresh - 1, -1, dtype=np.int64)
        return np.concatenate([never_used, self.returned()])[index]

    def pop(self, n: int) -> np.ndarray:
        """`n` ids (int64 [n]), the top of the stack first; the caller checked `n <= len(self)`."""
        k = min(n, self._top)
        taken = self._stack[self._top - k:self._top][::-1].copy()
        self._top -= k
        if n == k:
            return taken
        fresh = np.arange(self.fresh, self.fresh + n - k, dtype=np.int64)
        self.fresh += n - k
        return np.concatenate([taken, fresh]) if k else fresh

    def push(self, ids: np.ndarray) -> None:
        """Give back `ids`; the last one is handed out first."""
        n = len(ids)
        if self._top + n > len(self._stack):
            grown = np.empty(_grown_size(len(self._stack), self._top + n, self.size), dtype=np.int64)
            grown[:self._top] = self._stack[:self._top]
            self._stack = grown
        self._stack[self._top:self._top + n] = ids[::-1]
        self._top += n


class LazyTags:
    """An int8 tag per id of `0 .. size-1`, stored only up to the largest id ever tagged: the others
    read `default`."""

    def __init__(self, size: int, default: int = 0):
        self.size, self.default = int(size), default
        self.array = np.zeros(0, dtype=np.int8)

    def reserve(self, n: int) -> None:
        """Store tags of ids below `n` (new ones read `default`)."""
        if n > len(self.array):
            grown = np.full(_grown_size(len(self.array), n, self.size), self.default, dtype=np.int8)
            grown[:len(self.array)] = self.array
            self.array = grown

    def get(self, ids: np.ndarray) -> np.ndarray:
        """Tags of `ids` (int8 [n]); ids must be in [0, size)."""
        if not len(ids) or int(ids.max()) < len(self.array):
            return self.array[ids]
        tags = np.full(len(ids), self.default, dtype=np.int8)
        stored = ids < len(self.array)
        tags[stored] = self.array[ids[stored]]
        return tags

    def set(self, ids: np.ndarray, tag: int) -> None:
        if len(ids):
            self.reserve(int(ids.max()) + 1)
            self.array[ids] = tag

    def __getitem__(self, ids):
        return self.get(np.asarray(ids, dtype=np.int64).reshape(-1)).reshape(np.shape(ids))

    def __setitem__(self, ids, tag) -> None:
        self.set(np.asarray(ids, dtype=np.int64).reshape(-1), tag)

    def count(self, tag: int) -> int:
        """Ids tagged `tag`."""
        stored = int(np.count_nonzero(self.array == tag))
        return stored + (self.size - len(self.array) if tag == self.default else 0)


def _grown_size(current: int, needed: int, limit: int) -> int:
    """Doubling growth to at least `needed`, at most `limit`."""
    return min(limit, max(needed, 2 * current, _FIRST_GROWTH))


class SlotAllocator:
    """Free list over slots `0 .. capacity-1`, with an owner tag per slot for validation. Memory
    grows with the slots used (see `LazyFreeList`), so a huge pool starts at once."""

    def __init__(self, capacity: int, block_size: int = 64):
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
            raise UsageError(f"slot pool capacity must be a positive integer, got {capacity!r}")
        self.capacity = int(capacity)
        self.block_size = int(block_size)
        # Popped from the top: a fresh pool hands out slots block by block, ascending, which
        # keeps its blocks contiguous.
        self._stack = LazyFreeList(self.capacity)
        self._owner = LazyTags(self.capacity, _FREE)
        # Scratch for the duplicate check of `check_outstanding` (only slots handed out).
        self._stamp = np.zeros(0, dtype=np.int64)
        self._outstanding = 0

    def free_size(self) -> int:
        """Slots on the free list."""
        return len(self._stack)

    def outstanding_size(self) -> int:
        """Slots handed to callers and not yet returned (to `free` or to the cache)."""
        return self._outstanding

    def alloc(self, n: int) -> np.ndarray | None:
        """`n` free slots (int64 [n]), or None when fewer are free. Never evicts."""
        if n > len(self._stack):
            return None
        slots = self._stack.pop(n)
        self._owner.set(slots, _OUT)
        self._outstanding += n
        return slots

    def check_outstanding(self, slots: np.ndarray) -> None:
        """Raise UsageError unless `slots` are distinct slots currently held by a caller."""
        if not len(slots):
            return
        low, high = int(slots.min()), int(slots.max())
        if low < 0 or high >= self.capacity:
            raise UsageError(f"slot {low if low < 0 else high} is outside the pool [0, {self.capacity})")
        owners = self._owner.get(slots)
        if not np.all(owners == _OUT):
            bad = owners != _OUT
            where = "free" if owners[bad][0] == _FREE else "held by the cache"
            raise UsageError(f"slot {int(slots[bad][0])} was not handed out by alloc (it is {where})")
        # Duplicates: write each slot's index, read it back; a repeated slot reads a later index.
        if len(self._stamp) <= high:
            self._stamp = np.zeros(_grown_size(len(self._stamp), high + 1, self.capacity), dtype=np.int64)
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
        self._owner.set(slots, _CACHED)
        self._outstanding -= len(slots)

    def release(self, slots: np.ndarray) -> None:
        """The cache gives back slots of evicted blocks."""
        self._push(slots)

    def check(self, cached: np.ndarray) -> None:
        """Verify the free list and owner tags against the slots the tree holds (`cached`)."""
        free = self._stack.returned()
        if len(np.unique(free)) != len(free) or np.any(self._owner.get(free) != _FREE):
            raise InvariantError("free list holds a slot twice or a slot that is not free")
        if np.any(free >= self._stack.fresh) or np.any(self._owner.array[self._stack.fresh:] != _FREE):
            raise InvariantError("a slot never handed out is on the free list or tagged as used")
        if self._owner.count(_FREE) != len(self._stack):
            raise InvariantError("a slot tagged free is missing from the free list")
        if len(np.unique(cached)) != len(cached) or np.any(self._owner.get(cached) != _CACHED):
            raise InvariantError("the tree holds a slot twice or a slot not tagged as cached")
        if self._owner.count(_CACHED) != len(cached):
            raise InvariantError("a slot tagged cached is not in the tree")
        if self._owner.count(_OUT) != self._outstanding:
            raise InvariantError("outstanding slot count disagrees with the owner tags")

    def _push(self, slots: np.ndarray) -> None:
        self._stack.push(slots)
        self._owner.set(slots, _FREE)
