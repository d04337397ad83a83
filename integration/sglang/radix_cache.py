"""PenelopeRadixCache: SGLang 0.5.23's prefix-cache interface over Penelope's KVCache.

Conversions only: SGLang keys, requests and slot tensors in; Penelope's match, insert, lock and
evict; SGLang results out. What SGLang's scheduler sees:

- ``match_prefix`` reports ``device_prefix_len``, the position from which the request computes.
  With phantoms on, that is the end of the last resident span; the missing spans before it
  (holes) are recomputed by phantom requests that ``hooks.py`` adds to the same batch, and the
  hole positions of the request's ``req_to_token`` row receive the phantoms' slots. With phantoms
  off, it is the end of the first resident run: the request recomputes everything after it.
- ``req.last_node`` holds a ``MatchRef``: the Penelope match, the tokens it was made for and what
  was reported. Locks taken through it are Penelope lock handles, found again by an id carried in
  SGLang's lock receipt.
- SGLang allocates request slots itself. The cache hands slots back to SGLang's allocator when it
  evicts blocks and when an insert finds blocks already cached (``SGLangSlots``).
- Hole refills belong to the request until its next checkpoint, although they lie below its
  ``cache_protected_len``: ``protected_size`` counts them, so SGLang's conservation check
  (available + evictable + protected + request-owned == total) stays exact, and ``on_release``
  frees them when the request ends without a checkpoint.

Not supported (clear errors or documented fallbacks): EAGLE bigram keys, ``extra_key`` /
``cache_salt`` namespaces (never cached), HiCache, sliding-window and mamba models, sessions.
"""
from __future__ import annotations

import itertools
import logging
import time
from array import array

import numpy as np
import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams

from penelope.cache import KVCache
from penelope.cache import MatchResult as PenelopeMatch
from penelope.errors import InvariantError, UsageError
from penelope.tree import BlockState

from .plugin import PenelopeOptions

logger = logging.getLogger(__name__)

# Slot 0 (page 0) is SGLang's padding slot: hole positions of a row hold it until the phantom's
# slots are copied in, so a missed copy reads padding instead of another request's KV.
PAD_SLOT = 0


class SGLangSlots:
    """Penelope's slot-allocator interface over SGLang's token-to-KV-pool allocator.

    SGLang's scheduler allocates request slots itself; through this adapter the cache manager
    returns slots (evicted blocks, duplicates found by an insert) to SGLang's free list. Slots are
    SGLang's: ``page_size .. (pages + 1) * page_size - 1`` (page 0 is padding)."""

    def __init__(self, allocator):
        self.sglang = allocator
        self.page_size = allocator.page_size
        self.capacity = allocator.size // allocator.page_size * allocator.page_size
        self.device = torch.device(allocator.device)
        self._end = self.capacity + self.page_size

    def free_size(self) -> int:
        return self.sglang.available_size()

    def alloc(self, n: int) -> np.ndarray | None:
        """`n` slots (int64 [n]) from SGLang's free list, or None; `n` must fill whole pages."""
        if n % self.page_size:
            raise UsageError(f"allocate whole pages of {self.page_size} tokens, not {n}")
        slots = self.sglang.alloc(n)
        return None if slots is None else slots.to("cpu", torch.int64).numpy()

    def check_outstanding(self, slots: np.ndarray) -> None:
        """SGLang tracks who holds a slot; only the range can be checked here."""
        if len(slots) and (int(slots.min()) < self.page_size or int(slots.max()) >= self._end):
            raise UsageError(f"slots must lie in [{self.page_size}, {self._end}), got "
                             f"[{int(slots.min())}, {int(slots.max())}]")

    def adopt(self, slots: np.ndarray) -> None:
        """The tree takes slots a request held: nothing changes on SGLang's side."""

    def free(self, slots: np.ndarray) -> None:
        self._give_back(slots)

    def release(self, slots: np.ndarray) -> None:
        self._give_back(slots)

    def check(self, cached: np.ndarray) -> None:
        """Raise InvariantError if a page the tree holds is on SGLang's free list."""
        free_pages = self.sglang.get_all_free_pages()
        if free_pages is None or not len(cached):
            return
        pages = np.unique(cached // self.page_size)
        both = np.intersect1d(pages, free_pages.to("cpu", torch.int64).numpy())
        if len(both):
            raise InvariantError(f"page {int(both[0])} is both in the tree and on SGLang's free list")

    def _give_back(self, slots: np.ndarray) -> None:
        if len(slots):
            self.sglang.free(torch.from_numpy(np.ascontiguousarray(slots)).to(self.device))


class MatchRef:
    """The node handle SGLang keeps in ``req.last_node``: one Penelope match (None for the root),
    the block-aligned tokens it was made for, the reported prefix and the holes before it."""

    __slots__ = ("match", "tokens", "prefix_len", "holes")

    def __init__(self, match: PenelopeMatch | None, tokens: np.ndarray, with_holes: bool):
        self.match = match
        self.tokens = tokens
        spans = match.spans if match is not None else []
        if with_holes:
            self.prefix_len = match.compute_from if match is not None else 0
            self.holes = list(match.holes) if match is not None else []
        else:
            first = spans[0] if spans else None
            self.prefix_len = first.end if first is not None and first.state == BlockState.GPU else 0
            self.holes = []

    def slots(self, n: int) -> np.ndarray:
        """Slots of positions [0, n) (int64 [n], n <= prefix_len); PAD_SLOT at hole positions."""
        out = np.full(n, PAD_SLOT, dtype=np.int64)
        for span in self.match.spans if self.match is not None else []:
            if span.start >= n:
                break
            if span.state == BlockState.GPU:
                end = min(span.end, n)
                out[span.start:end] = span.slots[:end - span.start]
        return out

    def __repr__(self) -> str:
        return f"MatchRef(prefix_len={self.prefix_len}, holes={self.holes})"


class PenelopeRadixCache(BasePrefixCache):
    """Drop-in for SGLang's ``RadixCache(params)`` whose tree and eviction are Penelope's.

    `options`: block size, policy (default: from the environment only); `phantoms`: report holes
    for phantom requests to refill (True only where the hooks of ``hooks.py`` are applied).
    """

    # No SGLang sliding window: the scheduler's budget code reads this attribute.
    sliding_window_size = None

    def __init__(self, params: CacheInitParams, options: PenelopeOptions | None = None,
                 phantoms: bool | None = None):
        options = options if options is not None else PenelopeOptions()
        if params.is_eagle:
            raise UsageError("penelope: EAGLE speculative decoding (bigram keys) is not supported")
        self.disable = params.disable
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = params.page_size
        self.options = options
        self.phantoms = options.phantoms if phantoms is None else phantoms
        self.block_size = options.resolved_block_size(self.page_size)
        self.slots = SGLangSlots(self.token_to_kv_pool_allocator)
        self.device = self.slots.device
        if params.enable_metrics:
            self.init_metrics_collector()
        self._lock_ids = itertools.count(1)
        self.reset()

    def reset(self):
        """Forget everything (SGLang clears its allocator alongside, e.g. on flush_cache)."""
        self.cache = KVCache(self.slots.capacity, block_size=self.block_size, policy=self.options.policy,
                             allocator=self.slots, track_recompute=False)
        self.root_node = MatchRef(None, np.empty(0, dtype=np.int64), with_holes=False)
        self._locks: dict[int, object] = {}
        # rid -> (request, hole ranges whose refilled slots the request still owns)
        self._pending: dict[str, tuple[object, list[tuple[int, int]]]] = {}

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """Match ``params.key`` through missing blocks; see the module docstring for what is
        reported. Keys in an ``extra_key`` / ``cache_salt`` namespace are never cached."""
        key = params.key
        if self.disable or key.is_bigram or key.extra_key is not None or key.cache_salt is not None:
            return self._result(self.root_node)
        tokens = self._tokens(key.raw_token_ids(), len(key))
        if not len(tokens):
            return self._result(self.root_node)
        match = self.cache.match(tokens)
        return self._result(MatchRef(match, tokens, self.phantoms and _phantom_eligible(params.req)))

    def touch_prefix(self, key) -> None:
        """Bump the recency of ``key``'s cached path (a match that reports nothing)."""
        if not (self.disable or key.is_bigram or key.extra_key is not None or key.cache_salt is not None):
            tokens = self._tokens(key.raw_token_ids(), len(key))
            if len(tokens):
                self.cache.match(tokens)

    def insert(self, params: InsertParams) -> InsertResult:
        """Cache ``params.key`` with KV in ``params.value`` (slots, [len(key)]).

        Penelope's contract, not RadixCache's: the cache takes EVERY slot passed, frees the ones
        that duplicate blocks already cached and the partial last block's; the caller frees
        nothing. ``prefix_len`` counts the tokens that were already cached. (SGLang 0.5.23's
        scheduler never calls insert; ``checkpoint`` does.)"""
        key = params.key
        if self.disable or key.is_bigram or key.extra_key is not None or key.cache_salt is not None:
            raise UsageError("penelope: insert of a namespaced or bigram key is not supported")
        tokens = self._tokens(key.raw_token_ids(), len(key), whole_blocks=False)
        slots = params.value.to("cpu", torch.int64).numpy()[:len(tokens)]
        result = self.cache.insert(tokens, slots)
        return InsertResult(prefix_len=result.already_cached, total_len=result.cached)

    def checkpoint(self, req, *, up_to: int, **kwargs):
        """Insert the whole blocks of the request's first ``up_to`` tokens, point its row at the
        tree's slots, move its lock to the new path and advance ``cache_protected_len``. Refilled
        holes become the tree's here. Frees nothing the row still uses; ``release_kv_cache``
        frees the request's slots from ``cache_protected_len`` on."""
        if self.disable or req.extra_key is not None or req.cache_salt is not None:
            return
        kv = req.kv
        n = up_to // self.block_size * self.block_size
        pending = self._pending.pop(req.rid, (req, []))[1]
        if n <= kv.cache_protected_len and not pending:
            return
        tokens = self._tokens(req.full_untruncated_fill_ids, n)
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
        self.cache.insert(tokens, row[:n].to("cpu", torch.int64).numpy())
        ref = MatchRef(self.cache.match(tokens), tokens, with_holes=False)
        if ref.prefix_len != n:
            raise InvariantError(f"penelope: after inserting {n} tokens only {ref.prefix_len} are resident")
        # Positions below cache_protected_len already hold the tree's slots, except refilled holes
        # that an earlier request refilled first (then this request's copies were just freed).
        first = min([kv.cache_protected_len] + [start for start, _ in pending])
        self.req_to_token_pool.write((kv.req_pool_idx, slice(first, n)),
                                     torch.from_numpy(ref.slots(n)[first:]).to(row.device, row.dtype))
        kv.cache_protected_len = n
        kv.cache_inserted_len = max(kv.cache_inserted_len, n)
        # Lock the new path before unlocking the old one, so nothing in between is pruned.
        old = req.lock
        req.lock = self.lock(ref)
        self.unlock(old)
        req.last_node = ref

    def on_release(self, req, *, checkpointed: bool) -> None:
        """Free refilled hole slots that never reached the tree (request ended without checkpoint)."""
        _, pending = self._pending.pop(req.rid, (req, []))
        if pending and req.kv.req_pool_idx is not None:
            row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
            self.token_to_kv_pool_allocator.free(torch.cat([row[a:b] for a, b in pending]).to(torch.int64))

    def evict(self, params: EvictParams) -> EvictResult:
        """Free at least ``params.num_tokens`` tokens (whole blocks) or everything evictable."""
        if self.disable or params.num_tokens <= 0:
            return EvictResult()
        start = time.perf_counter()
        freed = self.cache.evict(params.num_tokens).freed_tokens
        self.update_eviction_metrics(freed, start)
        return EvictResult(num_tokens_evicted=freed)

    def inc_lock_ref(self, node: MatchRef) -> IncLockRefResult:
        """Lock the matched root path of `node`; the receipt's ``node_id`` names the lock."""
        if self.disable or node.match is None:
            return IncLockRefResult(delta=0)
        before = self.cache.evictable_size()
        handle = self.cache.lock(self._fresh(node))
        lock_id = next(self._lock_ids)
        self._locks[lock_id] = handle
        return IncLockRefResult(delta=self.cache.evictable_size() - before, node_id=lock_id)

    def dec_lock_ref(self, node: MatchRef, params: DecLockRefParams | None = None) -> DecLockRefResult:
        """Release the lock named by the receipt (without one: the latest lock taken on `node`)."""
        if self.disable or node.match is None:
            return DecLockRefResult(delta=0)
        lock_id = params.node_id if params is not None else None
        if lock_id not in self._locks:
            lock_id = next((i for i in reversed(self._locks) if self._locks[i].node is node.match.handle), None)
        if lock_id is None:
            raise UsageError(f"penelope: no lock held on {node!r}")
        before = self.cache.evictable_size()
        self.cache.unlock(self._locks.pop(lock_id))
        return DecLockRefResult(delta=self.cache.evictable_size() - before)

    def prefix_device_indices(self, req) -> torch.Tensor:
        """Slots of the request's matched prefix [0, req.prefix_len); PAD_SLOT at holes until the
        phantoms' slots are copied in."""
        return torch.from_numpy(req.last_node.slots(req.prefix_len)).to(self.device)

    def path_device_indices(self, node: MatchRef) -> torch.Tensor:
        return torch.from_numpy(node.slots(node.prefix_len)).to(self.device)

    def dfs_weight_order(self, node_handles) -> list[int]:
        """Keep the given order: match handles are not tree nodes."""
        return list(range(len(node_handles)))

    def phantom_holes(self, req) -> list[tuple[int, int]]:
        """Holes that phantoms must refill before `req` runs from its reported prefix: non-empty
        only on the round whose match reported them (the request holds no row yet)."""
        ref = req.last_node
        if not isinstance(ref, MatchRef) or req.kv.req_pool_idx is not None or req.prefix_len != ref.prefix_len:
            return []
        return list(ref.holes)

    def hole_tokens(self, req, prefix_len: int) -> int:
        """Tokens the phantoms of `req` will compute when it is admitted at `prefix_len`."""
        ref = req.last_node
        if not isinstance(ref, MatchRef) or req.kv.req_pool_idx is not None or prefix_len != ref.prefix_len:
            return 0
        return sum(end - start for start, end in ref.holes)

    def hold_refills(self, req, holes: list[tuple[int, int]]) -> None:
        """The request's row now holds phantom slots at `holes`: the request owns them until its
        next checkpoint hands them to the tree."""
        if holes:
            self._pending[req.rid] = (req, list(holes))
            logger.info("penelope: request %s refills %d hole tokens %s with phantoms", req.rid,
                        sum(end - start for start, end in holes), holes)

    def drop_holes(self, req) -> None:
        """Give up phantoms for `req` (e.g. no request rows left for them): it computes from the
        end of its first resident run instead. Its row is not written yet."""
        ref = req.last_node
        first = MatchRef(ref.match, ref.tokens, with_holes=False).prefix_len
        req.prefix_len = first
        req.kv.cache_protected_len = first

    def evictable_size(self) -> int:
        return self.cache.evictable_size()

    def protected_size(self) -> int:
        """Tokens on locked paths, plus refilled holes still owned by running requests (they lie
        below those requests' ``cache_protected_len``, where SGLang counts nothing as theirs)."""
        held = sum(end - start for _, holes in self._pending.values() for start, end in holes)
        return self.cache.protected_size() + held

    def total_size(self) -> int:
        return self.cache.evictable_size() + self.cache.protected_size()

    def supports_prefix_sharing(self) -> bool:
        return not self.disable

    def check_invariants(self) -> None:
        """Penelope's tree, lock and slot checks (SGLang's free list included). Valid when no
        request holds slots outside the tree."""
        self.cache.check_invariants()

    def pretty_print(self):
        tree = self.cache.tree
        for node in tree.nodes():
            depth = len(tree.path_to_root(node)) - 1
            print("  " * depth, node, node.tokens[:8].tolist())
        print(f"#tokens: {self.total_size()} (evictable {self.evictable_size()}, protected "
              f"{self.cache.protected_size()}, block {self.block_size}, policy {self.cache.policy.name})")

    def _result(self, ref: MatchRef) -> MatchResult:
        return MatchResult(device_prefix_len=ref.prefix_len, last_device_node=ref, last_host_node=ref,
                           best_match_node=ref)

    def _tokens(self, token_ids, n: int, whole_blocks: bool = True) -> np.ndarray:
        """The first `n` tokens (rounded down to whole blocks) as a new int64 array. Copies:
        a numpy view would pin SGLang's growing `array` and make its next extend fail."""
        if whole_blocks:
            n = n // self.block_size * self.block_size
        if isinstance(token_ids, array) and token_ids.typecode == "q":
            return np.frombuffer(token_ids, dtype=np.int64, count=n).copy()
        return np.asarray(token_ids[:n], dtype=np.int64)

    def _fresh(self, ref: MatchRef) -> PenelopeMatch:
        """`ref`'s match, redone if an eviction made it stale; the redone match must report the
        same prefix with the same slots, or the request's prefix would point at freed KV."""
        match = ref.match
        if self.cache.is_fresh(match):
            return match
        again = MatchRef(self.cache.match(ref.tokens), ref.tokens, with_holes=bool(ref.holes))
        if (again.prefix_len, again.holes) != (ref.prefix_len, ref.holes) or not np.array_equal(
                again.slots(ref.prefix_len), ref.slots(ref.prefix_len)):
            raise InvariantError("penelope: the cache evicted part of a matched prefix before it was locked")
        ref.match = again.match
        return again.match


def _phantom_eligible(req) -> bool:
    """Requests whose holes a phantom can refill: plain token prompts (no embeddings, multimodal
    inputs or diffusion-LM blocks, whose KV at a position does not follow from the token ids)."""
    return (req is not None and req.multimodal_inputs is None and req.input_embeds is None
            and req.positional_embed_overrides is None and req.dllm_config is None)
