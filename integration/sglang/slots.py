"""Penelope's slot-allocator interface over SGLang's token-to-KV-pool allocator.

SGLang's scheduler allocates request slots itself; Penelope's cache only takes slots into its tree
(inserts, refills) and gives slots back (evicted blocks, duplicates an insert found). A slot is
therefore in one of three states: on SGLang's free list, held by a request (allocated, not in the
tree), or held by the tree. This class tags the slots the tree holds, so a slot passed twice or
one the tree already holds is refused before anything changes, and the tree never hands a slot
back twice. Slots are SGLang's: ``page_size .. (pages + 1) * page_size - 1`` (page 0 pads).
"""
from __future__ import annotations

import numpy as np
import torch
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

from penelope.errors import InvariantError, UsageError


class SGLangSlots:
    """`capacity` token slots of SGLang's allocator, seen through Penelope's allocator protocol."""

    def __init__(self, allocator):
        self.sglang = allocator
        self.page_size = allocator.page_size
        self.capacity = allocator.size // allocator.page_size * allocator.page_size
        self.device = torch.device(allocator.device)
        self._end = self.capacity + self.page_size
        self._in_tree = np.zeros(self._end, dtype=bool)
        self._held = 0
        # Scratch for the duplicate check: slot -> index of its last occurrence.
        self._stamp = np.zeros(self._end, dtype=np.int64)
        # The stock allocators free pages named by id as they are; others (page-interleaved
        # shards) only through `free`.
        self._by_page_id = type(allocator) in (TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator)
        # Scratch for `check_allocated`: one flag per page id, all False between calls.
        self._free_page = np.zeros(self._end // self.page_size + 1, dtype=bool)

    def free_size(self) -> int:
        return self.sglang.available_size()

    def alloc(self, n: int) -> np.ndarray | None:
        """`n` slots (int64 [n]) from SGLang's free list, or None; `n` must fill whole pages."""
        if n % self.page_size:
            raise UsageError(f"allocate whole pages of {self.page_size} tokens, not {n}")
        slots = self.sglang.alloc(n)
        return None if slots is None else slots.to("cpu", torch.int64).numpy()

    def tree_size(self) -> int:
        """Slots the tree holds."""
        return self._held

    def outstanding_size(self) -> int:
        """Slots requests hold: SGLang tracks them by request, so this is what is neither free
        nor the tree's (``check`` verifies the tree's part against the tree itself)."""
        return self.capacity - self.sglang.available_size() - self._held

    def check_outstanding(self, slots: np.ndarray) -> None:
        """Raise UsageError unless `slots` are distinct pool slots the tree does not hold."""
        if not len(slots):
            return
        low, high = int(slots.min()), int(slots.max())
        if low < self.page_size or high >= self._end:
            raise UsageError(f"penelope: slot {low if low < self.page_size else high} is outside SGLang's "
                             f"pool [{self.page_size}, {self._end})")
        held = self._in_tree[slots]
        if held.any():
            raise UsageError(f"penelope: slot {int(slots[held][0])} is already held by the cache")
        order = np.arange(len(slots), dtype=np.int64)
        self._stamp[slots] = order
        if not np.array_equal(self._stamp[slots], order):
            raise UsageError(f"penelope: slot {int(slots[self._stamp[slots] != order][0])} is passed twice")
        page = self.page_size
        if page > 1:
            # The tree frees a block's slots page by page: each page's slots must be one whole page.
            pages = slots.reshape(-1, page) if len(slots) % page == 0 else None
            if pages is None or (pages[:, 0] % page).any() or (np.diff(pages, axis=1) != 1).any():
                raise UsageError(f"penelope: slots must fill whole pages of {page} (one page's slots in order)")

    def check_allocated(self, slots: np.ndarray) -> None:
        """Raise UsageError if a page of `slots` is on SGLang's free list (never allocated, or
        freed already). Reads the whole free list: for explicit ``insert`` calls, not per step."""
        free_pages = self.sglang.get_all_free_pages()
        if free_pages is None or not len(slots):
            return
        pages = slots // self.page_size
        flags = self._free_page
        if int(pages.min()) < 0 or int(pages.max()) >= len(flags):
            # Outside the pool: `check_outstanding` refuses these slots.
            return
        free = free_pages.to("cpu", torch.int64).numpy()
        # Page-indexed flags, set and cleared again: linear in the free list, no sort.
        flags[free] = True
        listed = flags[pages]
        flags[free] = False
        if listed.any():
            raise UsageError(f"penelope: slot page {int(pages[listed].min())} was never allocated (it is on "
                             "SGLang's free list)")

    def adopt(self, slots: np.ndarray) -> None:
        """The tree takes slots a request held (checked by `check_outstanding`)."""
        self._in_tree[slots] = True
        self._held += len(slots)

    def free(self, slots: np.ndarray) -> None:
        """Slots a request passed that the tree did not take (duplicates): back to SGLang."""
        self._give_back(slots)

    def release(self, slots: np.ndarray) -> None:
        """The tree drops slots of evicted blocks: back to SGLang, in one call. The tree took them
        as whole pages, one page's slots in order (`check_outstanding`), and its blocks hold whole
        pages, so every page appears once and its first slot names it: SGLang's `free_page_ids`,
        without the sort that `free` runs to find the pages."""
        if not len(slots):
            return
        if not self._in_tree[slots].all():
            raise InvariantError("penelope: the tree released a slot it did not hold")
        self._in_tree[slots] = False
        self._held -= len(slots)
        if not self._by_page_id:
            self._give_back(slots)
            return
        page = self.page_size
        pages = slots[::page] // page if page > 1 else slots
        self.sglang.free_page_ids(torch.from_numpy(np.ascontiguousarray(pages)).to(self.device))

    def reset(self) -> None:
        """Forget every tree slot (SGLang clears its allocator alongside)."""
        self._in_tree[:] = False
        self._held = 0

    def tree_slots(self) -> np.ndarray:
        """Every slot the tree holds (int64)."""
        return np.flatnonzero(self._in_tree).astype(np.int64)

    def check(self, cached: np.ndarray) -> None:
        """Raise InvariantError unless the tags match the tree's slots (`cached`) exactly and no
        page the tree holds is on SGLang's free list."""
        if len(cached) != self._held or not self._in_tree[cached].all():
            raise InvariantError(f"penelope: {self._held} slots tagged as the tree's, the tree holds {len(cached)}")
        free_pages = self.sglang.get_all_free_pages()
        if free_pages is None or not len(cached):
            return
        both = np.intersect1d(np.unique(cached // self.page_size), free_pages.to("cpu", torch.int64).numpy())
        if len(both):
            raise InvariantError(f"penelope: page {int(both[0])} is both in the tree and on SGLang's free list")

    def _give_back(self, slots: np.ndarray) -> None:
        if len(slots):
            self.sglang.free(torch.from_numpy(np.ascontiguousarray(slots)).to(self.device))
