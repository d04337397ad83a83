"""KV cache events (``--kv-events-config``) for Penelope's tree: BlockStored, BlockRemoved and
AllBlocksCleared, one block hash per SGLang page, chained as SGLang's own radix cache chains them
(SHA-256 of the page's tokens and the previous page's hash), so a KV-aware router sees the same
block identities from Penelope's workers as from stock ones.

Penelope stores and evicts whole blocks anywhere in a history (holes), so a page's hash cannot be
read off a parent node: it is kept per Penelope block (keyed by the tree's prefix hash of that
block) from the moment the block is stored until it is removed. Namespaced blocks (``extra_key``,
``cache_salt``) start their chain from SGLang's storage namespace seed. Nothing here runs unless
events are enabled.
"""
from __future__ import annotations

import numpy as np
from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored, StorageMedium
from sglang.srt.mem_cache.events import KVCacheEventRecorder
from sglang.srt.mem_cache.utils import get_hash_str, hash_str_to_int64

from penelope.cache.tree import BlockState

from .keys import NS_SHIFT


class KVEvents(KVCacheEventRecorder):
    """SGLang's event queue (``take`` is what the scheduler's publisher calls), fed by block."""

    def __init__(self, params, block_size: int):
        super().__init__(enabled=params.enable_kv_cache_events and not params.disable,
                         page_size=params.page_size, dynamo_format=params.dynamo_kv_event_format,
                         lora_names=params.kv_event_lora_names)
        self.block_size = block_size
        # Tree prefix hash of a stored block -> the SHA-256 hex strings of its pages.
        self._pages: dict[int, list[str]] = {}

    def cleared(self) -> None:
        self._pages.clear()
        self.record_all_cleared()

    def stored(self, cache, tokens: np.ndarray, before) -> None:
        """Blocks of `tokens` resident in `cache` now that were not in `before` (a match made
        before the insert): one BlockStored per page, parent-linked."""
        if not self.enabled:
            return
        new = [(s.start, s.end) for s in before.spans if s.state != BlockState.GPU]
        if before.matched < len(tokens):
            new.append((before.matched, len(tokens)))
        self._store(cache, tokens, new)

    def stored_range(self, cache, tokens: np.ndarray, start: int, end: int) -> None:
        """Positions [start, end) of `tokens` were refilled in `cache`."""
        if self.enabled:
            self._store(cache, tokens[:end], [(start, end)])

    def removed(self, hashes: np.ndarray) -> None:
        """Blocks whose tree prefix hashes are `hashes` were deleted."""
        if not self.enabled or not len(hashes):
            return
        removed = []
        for block in hashes.tolist():
            removed.extend(hash_str_to_int64(page) for page in self._pages.pop(block, ()))
        if removed:
            self.enqueue(BlockRemoved(block_hashes=removed, medium=StorageMedium.GPU))

    def _store(self, cache, tokens: np.ndarray, ranges: list[tuple[int, int]]) -> None:
        bs = self.block_size
        path = cache.tree.path_to_root(cache.match(tokens).handle)
        ids = np.concatenate([node.hashes for node in path]).tolist()
        wanted = sorted({block for start, end in ranges for block in range(start // bs, end // bs)})
        if not wanted:
            return
        # Pages chain from the first page on: start at the earliest block whose pages are unknown.
        first = wanted[0]
        while first > 0 and ids[first - 1] not in self._pages:
            first -= 1
        previous = self._pages[ids[first - 1]][-1] if first > 0 else _namespace_seed(tokens)
        pages_of = {}
        for block in range(first, wanted[-1] + 1):
            pages = self._pages.get(ids[block])
            if pages is None:
                pages = get_hash_str(_raw(tokens[block * bs:(block + 1) * bs]), previous, page_size=self.page_size)
            pages_of[block] = pages
            previous = pages[-1]
        for block in wanted:
            self._pages[ids[block]] = pages_of[block]
            parent = hash_str_to_int64(pages_of[block - 1][-1]) if block > first else (
                hash_str_to_int64(self._pages[ids[block - 1]][-1]) if block > 0 else None)
            for i, page in enumerate(pages_of[block]):
                start = block * bs + i * self.page_size
                self.enqueue(BlockStored(
                    block_hashes=[hash_str_to_int64(page)], parent_block_hash=parent,
                    token_ids=_raw(tokens[start:start + self.page_size]), block_size=self.page_size,
                    lora_id=None, medium=StorageMedium.GPU, cache_salt=None))
                parent = hash_str_to_int64(page)


def _raw(tokens: np.ndarray) -> list[int]:
    """Token ids as the request sent them (namespaced ids carry their namespace in the high bits)."""
    return (tokens & ((1 << NS_SHIFT) - 1)).tolist()


def _namespace_seed(tokens: np.ndarray) -> str | None:
    """A chain seed per Penelope namespace (its number lives in the high bits of every token)."""
    namespace = int(tokens[0]) >> NS_SHIFT if len(tokens) else 0
    return None if namespace == 0 else f"{namespace:064x}"
