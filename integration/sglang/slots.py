"""Penelope's slot-allocator interface over SGLang's token-to-KV-pool allocator.

SGLang's scheduler allocates request slots itself; Penelope's cache only takes slots into its tree
(inserts, refills) and gives slots back (evicted blocks, duplicates an insert found). A slot is
therefore in one of three states: on SGLang's free list, held by a request (allocated, not in the
tree), or held by the tree. This class tags the pages the tree holds (the tree takes and gives
back whole pages), so a slot passed twice or one the tree already holds is refused before anything
changes, and the tree never hands a slot back twice. Slots are SGLang's:
``page_size .. (pages + 1) * page_size - 1`` (page 0 pads).
"""
from __future__ import annotations

import numpy as np
import torch
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

from penelope.cache import path_loops
from penelope.errors import InvariantError, UsageError


class SGLangSlots:
    """`capacity` token slots of SGLang's allocator, seen through Penelope's allocator protocol.

    The tree takes slots only as whole pages, one page's slots in order (`check_outstanding`), and
    gives back whole blocks of whole pages, so the tags and checks work on page ids (a page's
    first slot // page_size) once a slot array is seen to be whole pages: a page is held when its
    slots are."""

    def __init__(self, allocator):
        self.sglang = allocator
        self.page_size = allocator.page_size
        self.capacity = allocator.size // allocator.page_size * allocator.page_size
        self.device = torch.device(allocator.device)
        self._on_cpu = self.device.type == "cpu"
        self._end = self.capacity + self.page_size
        self._pages_end = self._end // self.page_size
        # Pages the tree holds, by page id.
        self._in_tree = np.zeros(self._pages_end, dtype=bool)
        self._held = 0
        self._offsets = np.arange(self.page_size, dtype=np.int64)
        # The allocator's class: the stock ones are read directly (`_free_list`) and free pages named by
        # id as they are; others (page-interleaved shards) only through their methods.
        self._kind = type(allocator)
        self._by_page_id = self._kind in (TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator)
        # Scratch of the page checks: one mark per page id, all 0 between calls.
        self._scratch = np.zeros(self._pages_end, dtype=np.uint8)
        self._loops = path_loops.best()
        # Set by the caller around an explicit insert: `check_outstanding` then also refuses slots
        # on SGLang's free list (never allocated, or freed already). It reads the whole free
        # list: for explicit ``insert`` calls, not per step.
        self.check_free_list = False

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
        """Raise UsageError unless `slots` are distinct pool slots the tree does not hold, in whole
        pages (one page's slots in order), and, while `check_free_list` is set, none is on SGLang's
        free list."""
        if not len(slots):
            return
        pages = self._whole_pages(slots)
        if pages is None:
            # Not whole pages: the checks slot by slot name the first bad slot, as for whole pages.
            self._check_slots(slots)
            raise UsageError(f"penelope: slots must fill whole pages of {self.page_size} (one page's slots in order)")
        pages = np.ascontiguousarray(pages, dtype=np.int64)
        listed = self._free_list() if self.check_free_list else None
        # Every check in one pass over the pages (compiled where the install built the loops);
        # the message is worked out only when one fails.
        problem = self._loops.page_problem(pages, self._pages_end, self._in_tree, listed, self._scratch)
        if problem:
            self._refuse(pages, problem, listed)

    def _free_list(self) -> np.ndarray | None:
        """SGLang's free page ids (int64; callers only read it), with the pages freed in an open
        free group (`free_group_begin`: free, though listed only when the group ends), read in
        place on a CPU pool; None where the allocator keeps no page free list."""
        allocator, kind = self.sglang, self._kind
        # The stock allocators' lists, read as they are: the free pages, those freed but not yet
        # merged into them (page 1: `release_pages`; paged: the `staged_pages` tensors), and
        # those of an open free group (`get_all_free_pages` leaves these out, and builds a new
        # tensor whenever there is more than one list).
        if kind is TokenToKVPoolAllocator:
            free, freed, group = allocator.free_pages, allocator.release_pages, allocator.free_group
            # Page 1: slot ids are page ids.
            more = ([freed] if freed.shape[0] else []) + (group or [])
        elif kind is PagedTokenToKVPoolAllocator:
            free, more, group = allocator.free_pages, allocator.staged_pages, allocator.free_group
            if group is not None:
                more = more + [slots // self.page_size for slots in group] + allocator.free_page_ids_group
        else:
            free, more = allocator.get_all_free_pages(), []
            if free is None:
                return None
        if self._on_cpu:
            listed = free.numpy()
            if more:
                listed = np.concatenate([listed, *[pages.numpy() for pages in more]], dtype=np.int64)
        else:
            listed = torch.cat([free, *more]).to("cpu").numpy() if more else free.to("cpu").numpy()
        if listed.dtype != np.int64 or not listed.flags.c_contiguous:
            listed = np.ascontiguousarray(listed, np.int64)
        return listed

    def _refuse(self, pages: np.ndarray, problem: int, listed: np.ndarray | None) -> None:
        """Raise the UsageError of the first check `pages` failed (`path_loops.page_problem`)."""
        page = self.page_size
        if problem == path_loops.OUTSIDE:
            low, high = int(pages.min()), int(pages.max())
            raise UsageError(f"penelope: slot {low * page if low < 1 else high * page + page - 1} is outside "
                             f"SGLang's pool [{page}, {self._end})")
        if problem == path_loops.HELD:
            raise UsageError(f"penelope: slot {int(pages[self._in_tree[pages]][0]) * page} is already held by "
                             "the cache")
        if problem == path_loops.TWICE:
            # The first page in `pages` that appears again later.
            values, counts = np.unique(pages, return_counts=True)
            repeated = np.isin(pages, values[counts > 1])
            raise UsageError(f"penelope: slot {int(pages[repeated][0]) * page} is passed twice")
        if problem == path_loops.LISTED:
            lowest = int(pages[np.isin(pages, listed)].min())
            raise UsageError(f"penelope: slot page {lowest} is free in SGLang's allocator (never allocated, or "
                            "freed already)")
        raise InvariantError(f"penelope: page check failed with an unknown problem {problem}")

    def adopt(self, slots: np.ndarray) -> None:
        """The tree takes slots a request held (checked by `check_outstanding`: whole pages)."""
        self._in_tree[self._page_ids(slots)] = True
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
        pages = self._page_ids(slots)
        if np.count_nonzero(self._in_tree[pages]) != len(pages):
            raise InvariantError("penelope: the tree released a slot it did not hold")
        self._in_tree[pages] = False
        self._held -= len(slots)
        if not self._by_page_id:
            self._give_back(slots)
            return
        self.sglang.free_page_ids(torch.from_numpy(np.ascontiguousarray(pages)).to(self.device))

    def reset(self) -> None:
        """Forget every tree slot (SGLang clears its allocator alongside)."""
        self._in_tree[:] = False
        self._held = 0

    def tree_slots(self) -> np.ndarray:
        """Every slot the tree holds (int64), ascending."""
        pages = np.flatnonzero(self._in_tree).astype(np.int64)
        return (pages[:, None] * self.page_size + self._offsets).ravel()

    def check(self, cached: np.ndarray) -> None:
        """Raise InvariantError unless the tags match the tree's slots (`cached`) exactly and no
        page the tree holds is free in SGLang's allocator (`_free_list`)."""
        if len(cached) != self._held or not self._in_tree[cached // self.page_size].all():
            raise InvariantError(f"penelope: {self._held} slots tagged as the tree's, the tree holds {len(cached)}")
        free_pages = self._free_list()
        if free_pages is None or not len(cached):
            return
        both = np.intersect1d(np.unique(cached // self.page_size), free_pages)
        if len(both):
            raise InvariantError(f"penelope: page {int(both[0])} is both in the tree and on SGLang's free list")

    def _whole_pages(self, slots: np.ndarray) -> np.ndarray | None:
        """The page ids of `slots` if they are whole pages, each page's slots in order; else None."""
        page = self.page_size
        if page == 1:
            return slots
        # One compiled pass where the install built the loops (one numpy call per step otherwise).
        pages = np.empty(len(slots) // page, dtype=np.int64)
        return pages if self._loops.whole_pages(np.ascontiguousarray(slots, dtype=np.int64), page, pages) else None

    def _page_ids(self, slots: np.ndarray) -> np.ndarray:
        """Page ids of slots known to be whole pages in order."""
        return slots if self.page_size == 1 else slots[::self.page_size] // self.page_size

    def _check_slots(self, slots: np.ndarray) -> None:
        """Raise UsageError naming the first slot outside the pool, held by the tree, or passed
        twice (slots that are not whole pages)."""
        low, high = int(slots.min()), int(slots.max())
        if low < self.page_size or high >= self._end:
            raise UsageError(f"penelope: slot {low if low < self.page_size else high} is outside SGLang's "
                             f"pool [{self.page_size}, {self._end})")
        held = self._in_tree[slots // self.page_size]
        if held.any():
            raise UsageError(f"penelope: slot {int(slots[held][0])} is already held by the cache")
        _, first, counts = np.unique(slots, return_index=True, return_counts=True)
        if (counts > 1).any():
            raise UsageError(f"penelope: slot {int(slots[first[counts > 1].min()])} is passed twice")

    def _give_back(self, slots: np.ndarray) -> None:
        if len(slots):
            self.sglang.free(torch.from_numpy(np.ascontiguousarray(slots)).to(self.device))
