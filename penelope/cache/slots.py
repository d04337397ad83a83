"""Slot pools: which rows of a token-indexed KV pool are free.

A slot is one token's row in a KV pool (SGLang's `out_cache_loc`). The cache stores whole
blocks, so slots enter and leave the tree a block at a time. Two pools, one interface
(`SlotPool`):

- `SlotAllocator`, the device pool. Callers may hold any number of slots while a request runs,
  so every slot is in exactly one of three places: the free list, a caller's hands (`alloc`
  gave it out, `free` or the cache's `insert` takes it back), or the tree. `DeviceSlots` is the
  interface `KVCache` needs; the SGLang adapter implements it over SGLang's allocator.
- `HostSlots`, the host pool of a two-tier cache: rows for cached blocks plus a swap buffer.

Both keep a free list and a tag per row (`TaggedFreeList`), grown lazily with the rows used, so
a pool of 2**30 slots costs nothing until it is used.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from penelope.errors import InvariantError, UsageError
from penelope.memory import check_memory

_FREE, _OUT, _CACHED = 0, 1, 2
_BUFFER = 3
# First size of the lazily grown arrays (ids); they double from there.
_FIRST_GROWTH = 4096
EMPTY_SLOTS = np.empty(0, dtype=np.int64)


def concat_slots(parts: list[np.ndarray]) -> np.ndarray:
    """The slot arrays `parts` end to end (int64); empty when there are none."""
    return np.concatenate(parts, dtype=np.int64) if parts else EMPTY_SLOTS


@runtime_checkable
class SlotPool(Protocol):
    """What a cache needs of any pool of `capacity` token rows."""

    capacity: int

    def free_size(self) -> int:
        """Rows on the free list."""

    def alloc(self, n: int) -> np.ndarray | None:
        """`n` free rows (int64 [n]), now used, or None when fewer are free. Never evicts."""

    def release(self, slots: np.ndarray) -> None:
        """The cache gives back rows of blocks it dropped."""

    def check(self, cached: np.ndarray) -> None:
        """Raise InvariantError unless the pool's records agree with the rows the tree holds."""


@runtime_checkable
class DeviceSlots(SlotPool, Protocol):
    """The device pool's interface: `SlotPool` plus the rows callers hold between `alloc` and
    `insert` (the checks may be no-ops for a pool whose owner tracks them)."""

    def outstanding_size(self) -> int:
        """Rows handed to callers and not yet returned."""

    def check_outstanding(self, slots: np.ndarray) -> None:
        """Raise UsageError unless `slots` are distinct rows a caller holds."""

    def free(self, slots: np.ndarray) -> None:
        """A caller returns rows it will not insert."""

    def adopt(self, slots: np.ndarray) -> None:
        """The cache takes rows a caller held (already checked with `check_outstanding`)."""


class LazyFreeList:
    """The free ids among `0 .. size-1`, handed out as from a stack: ids given back come out first
    (last in, first out), then ids never handed out, in ascending order, so a fresh pool hands out
    contiguous runs. Memory grows with the ids ever handed out, not with `size`: a pool of 2**30
    slots costs nothing until it is used."""

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


class TaggedFreeList:
    """A free list over rows `0 .. rows-1` and a tag per row: what `SlotAllocator` and `HostSlots`
    share. Rows below `size` are free when the pool starts and handed out as from a stack (see
    `LazyFreeList`); subclasses may keep more rows above `size` (the swap buffer), tagged apart.
    `_tags` holds the tags of rows below `size`."""

    _row_word = "slot"

    def __init__(self, size: int):
        self._stack = LazyFreeList(size)
        self._tags = LazyTags(size, _FREE)

    def free_size(self) -> int:
        """Rows on the free list."""
        return len(self._stack)

    def _take(self, n: int, tag: int) -> np.ndarray | None:
        """`n` rows off the free list, now tagged `tag`; None when fewer are free."""
        if n > len(self._stack):
            return None
        rows = self._stack.pop(n)
        self._tag(rows, tag)
        return rows

    def _put_back(self, rows: np.ndarray) -> None:
        self._stack.push(rows)
        self._tag(rows, _FREE)

    def _tag(self, rows: np.ndarray, tag: int) -> None:
        self._tags.set(rows, tag)

    def _tags_of(self, rows: np.ndarray) -> np.ndarray:
        return self._tags.get(rows)

    def _count(self, tag: int) -> int:
        return self._tags.count(tag)

    def _check_free_list(self, pool: str) -> None:
        """The free list holds each row once, only free rows, every free row, and no row that was
        never handed out (those sit implicitly below the stack). `pool` prefixes the messages."""
        free = self._stack.returned()
        if len(np.unique(free)) != len(free) or np.any(self._tags_of(free) != _FREE):
            word = self._row_word
            raise InvariantError(f"{pool}free list holds a {word} twice or a {word} that is not free")
        fresh = self._stack.fresh
        never_used = (free >= fresh) & (free < self._stack.size)
        if np.any(never_used) or np.any(self._tags.array[fresh:] != _FREE):
            raise InvariantError(f"{pool}a {self._row_word} never handed out is on the free list or tagged as used")
        if self._count(_FREE) != len(self._stack):
            raise InvariantError(f"{pool}a {self._row_word} tagged free is missing from the free list")


class SlotAllocator(TaggedFreeList):
    """The device pool: a free list over slots `0 .. capacity-1`, with an owner tag per slot for
    validation. Implements `DeviceSlots`."""

    def __init__(self, capacity: int, block_size: int = 64):
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
            raise UsageError(f"slot pool capacity must be a positive integer, got {capacity!r}")
        # Popped from the top: a fresh pool hands out slots block by block, ascending, which
        # keeps its blocks contiguous.
        super().__init__(int(capacity))
        self.capacity = int(capacity)
        self.block_size = int(block_size)
        # Scratch for the duplicate check of `check_outstanding` (only slots handed out).
        self._stamp = np.zeros(0, dtype=np.int64)
        self._outstanding = 0

    def outstanding_size(self) -> int:
        """Slots handed to callers and not yet returned (to `free` or to the cache)."""
        return self._outstanding

    def alloc(self, n: int) -> np.ndarray | None:
        """`n` free slots (int64 [n]), or None when fewer are free. Never evicts."""
        slots = self._take(n, _OUT)
        if slots is not None:
            self._outstanding += n
        return slots

    def check_outstanding(self, slots: np.ndarray) -> None:
        """Raise UsageError unless `slots` are distinct slots currently held by a caller."""
        if not len(slots):
            return
        low, high = int(slots.min()), int(slots.max())
        if low < 0 or high >= self.capacity:
            raise UsageError(f"slot {low if low < 0 else high} is outside the pool [0, {self.capacity})")
        owners = self._tags.get(slots)
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
        self._put_back(slots)
        self._outstanding -= len(slots)

    def adopt(self, slots: np.ndarray) -> None:
        """The cache takes slots a caller held (already checked with `check_outstanding`)."""
        self._tag(slots, _CACHED)
        self._outstanding -= len(slots)

    def release(self, slots: np.ndarray) -> None:
        """The cache gives back slots of evicted blocks."""
        self._put_back(slots)

    def check(self, cached: np.ndarray) -> None:
        """Verify the free list and owner tags against the slots the tree holds (`cached`)."""
        self._check_free_list("")
        if len(np.unique(cached)) != len(cached) or np.any(self._tags.get(cached) != _CACHED):
            raise InvariantError("the tree holds a slot twice or a slot not tagged as cached")
        if self._count(_CACHED) != len(cached):
            raise InvariantError("a slot tagged cached is not in the tree")
        if self._count(_OUT) != self._outstanding:
            raise InvariantError("outstanding slot count disagrees with the owner tags")


class HostSlots(TaggedFreeList):
    """Rows of the host KV pool: `capacity` rows for cached blocks plus `buffer` rows of swap buffer.

    Every row is free, cached (it holds the KV of a block on the CPU tier, or a backup) or part of
    the swap buffer (no live data). The buffer is a FIFO of rows (`buffer_slots`) that moves with
    every exchange. Pool rows are `0 .. capacity + buffer - 1`; the buffer starts at the end. The
    tags of the `capacity` rows grow with the rows used; the buffer's, 9 bytes a row, are dense
    and checked against memory. Implements `SlotPool`."""

    _row_word = "row"

    def __init__(self, capacity: int, buffer: int = 0):
        self.capacity, self.buffer = int(capacity), int(buffer)
        self.rows = self.capacity + self.buffer
        check_memory(9 * self.buffer, f"a swap buffer of {self.buffer} host rows")
        super().__init__(self.capacity)
        # Tags of the rows above `capacity` (the initial buffer's, dense).
        self._high = np.full(self.buffer, _BUFFER, dtype=np.int8)
        self.buffer_slots = np.arange(self.capacity, self.rows, dtype=np.int64)

    def alloc(self, n: int) -> np.ndarray | None:
        """`n` free rows, now cached (int64 [n]), or None when fewer are free."""
        return self._take(n, _CACHED)

    def release(self, rows: np.ndarray) -> None:
        """Cached rows whose KV is no longer needed go back to the free list."""
        self._put_back(rows)

    def rotate(self, new_buffer: np.ndarray) -> None:
        """After an exchange: the old buffer rows now hold outgoing blocks, `new_buffer` (rows the
        incoming blocks were read from, and unused old buffer rows) is the buffer."""
        self._tag(self.buffer_slots, _CACHED)
        self._tag(new_buffer, _BUFFER)
        self.buffer_slots = new_buffer.copy()

    def _tag(self, rows: np.ndarray, tag: int) -> None:
        high = rows >= self.capacity
        self._tags.set(rows[~high], tag)
        self._high[rows[high] - self.capacity] = tag

    def _tags_of(self, rows: np.ndarray) -> np.ndarray:
        high = rows >= self.capacity
        tags = np.empty(len(rows), dtype=np.int8)
        tags[~high] = self._tags.get(rows[~high])
        tags[high] = self._high[rows[high] - self.capacity]
        return tags

    def _count(self, tag: int) -> int:
        return self._tags.count(tag) + int(np.count_nonzero(self._high == tag))

    def check(self, cached: np.ndarray) -> None:
        """Verify the free list, the buffer and the owner tags against the rows the tree holds."""
        # Rows above `capacity` were buffer rows before an exchange; they can be free like any other.
        self._check_free_list("host pool: ")
        buf = self.buffer_slots
        if len(buf) != self.buffer or len(np.unique(buf)) != len(buf) or np.any(self._tags_of(buf) != _BUFFER):
            raise InvariantError("host pool: the swap buffer lost rows or holds a row twice")
        if self._count(_BUFFER) != self.buffer:
            raise InvariantError("host pool: a row tagged buffer is not in the swap buffer")
        if len(np.unique(cached)) != len(cached) or np.any(self._tags_of(cached) != _CACHED):
            raise InvariantError("host pool: the tree holds a row twice, a free row or a buffer row")
        if self._count(_CACHED) != len(cached):
            raise InvariantError("host pool: a row tagged cached is not in the tree")
