"""KV cache events (``--kv-events-config``) for Penelope's tree: BlockStored, BlockRemoved and
AllBlocksCleared, one block hash per SGLang page, exactly as SGLang's own radix cache publishes
them for the same tokens and namespace, so a KV-aware router sees the same block identities from
Penelope's workers as from stock ones.

SGLang's event recorder (``KVCacheEventRecorder``) computes everything a router reads from a radix
node: the page hashes, chained from the parent's last page (namespaced keys from their
``cache_salt`` seed, without the ``extra_key``), then namespaced by the LoRA adapter or, in Dynamo's
format, by ``extra_key`` and ``cache_salt``; the parent links; the ``cache_salt`` and ``lora_name``
fields. Penelope stores and evicts whole blocks anywhere in a history (holes), so there is no
SGLang node to hand it: each block is handed to SGLang's recorder as a one-block node whose parent
carries the previous page's hash. That hash is kept per Penelope block (keyed by the tree's prefix
hash of that block) from the moment the block is stored until it is removed. Nothing here runs
unless events are enabled.
"""
from __future__ import annotations

from array import array
from types import SimpleNamespace

import numpy as np
from sglang.srt.disaggregation.kv_events import StorageMedium
from sglang.srt.mem_cache.events import KVCacheEventRecorder
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import compute_node_event_hash_values

from penelope.cache.tree import BlockState

from .keys import NS_SHIFT, Namespaces

# The tree root as SGLang's recorder sees it: no key, no hashes, no parent.
_ROOT = SimpleNamespace(key=RadixKey(array("q")), parent=None, hash_value=None, event_hash_value=None)


class KVEvents(KVCacheEventRecorder):
    """SGLang's event queue (``take`` is what the scheduler's publisher calls), fed by block.
    `namespaces`: the cache's namespace numbers, to name a namespaced block's key."""

    def __init__(self, params, block_size: int, namespaces: Namespaces):
        super().__init__(enabled=params.enable_kv_cache_events and not params.disable,
                         page_size=params.page_size, dynamo_format=params.dynamo_kv_event_format,
                         lora_names=params.kv_event_lora_names)
        self.block_size = block_size
        self.namespaces = namespaces
        # Tree prefix hash of a stored block -> (its namespace number, the SHA-256 hex strings of its
        # pages as SGLang chains them).
        self._pages: dict[int, tuple[int, list[str]]] = {}

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
        if not self.enabled:
            return
        for block in hashes.tolist():
            known = self._pages.pop(block, None)
            if known is not None:
                namespace, pages = known
                node = self._node(namespace, [0] * len(pages) * self.page_size, _ROOT)
                node.hash_value = node.event_hash_value = pages
                self.record_remove(node, medium=StorageMedium.GPU)

    def _store(self, cache, tokens: np.ndarray, ranges: list[tuple[int, int]]) -> None:
        bs = self.block_size
        path = cache.tree.path_to_root(cache.match(tokens).handle)
        ids = np.concatenate([node.hashes for node in path]).tolist()
        wanted = sorted({block for start, end in ranges for block in range(start // bs, end // bs)})
        if not wanted:
            return
        namespace = int(tokens[0]) >> NS_SHIFT
        # Pages chain from the first page on: start at the earliest block whose pages are unknown.
        first = wanted[0]
        while first > 0 and ids[first - 1] not in self._pages:
            first -= 1
        parent = _ROOT
        if first > 0:
            parent = self._node(namespace, [0] * self.page_size, _ROOT)
            parent.hash_value = parent.event_hash_value = self._pages[ids[first - 1]][1][-1:]
        publish = set(wanted)
        for block in range(first, wanted[-1] + 1):
            node = self._node(namespace, _raw(tokens[block * bs:(block + 1) * bs]), parent)
            known = self._pages.get(ids[block])
            pages = known[1] if known is not None else compute_node_event_hash_values(node, self.page_size)
            node.hash_value = node.event_hash_value = pages
            if block in publish:
                self._pages[ids[block]] = (namespace, pages)
                self.record_store(node, medium=StorageMedium.GPU)
            # The next block chains from this one's last page, as SGLang's child node would.
            parent = self._node(namespace, [0] * self.page_size, _ROOT)
            parent.hash_value = parent.event_hash_value = pages[-1:]

    def _node(self, namespace: int, token_ids: list[int], parent) -> SimpleNamespace:
        """A radix node as SGLang's recorder reads one: key (token ids and namespace), parent,
        page hashes (None until computed)."""
        extra_key, cache_salt = self.namespaces.name_of(namespace)
        key = RadixKey(array("q", token_ids), extra_key, cache_salt=cache_salt)
        return SimpleNamespace(key=key, parent=parent, hash_value=None, event_hash_value=None)


def _raw(tokens: np.ndarray) -> list[int]:
    """Token ids as the request sent them (namespaced ids carry their namespace in the high bits)."""
    return (tokens & ((1 << NS_SHIFT) - 1)).tolist()
