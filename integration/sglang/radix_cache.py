"""PenelopeRadixCache: SGLang 0.5.23's prefix-cache interface over Penelope's KVCache.

Conversions only: SGLang keys, requests and slot tensors in; Penelope's match, insert, refill,
lock and evict; SGLang results out. What SGLang's scheduler sees:

- ``match_prefix`` reports ``device_prefix_len``, where the request computes from. With phantoms
  on, that is the end of the last resident span; the missing spans before it (holes) are refilled
  as ``penelope.cache.refill`` plans at admission (``plan_admission``): by phantom requests riding in
  the request's batch (``hooks.py``), or by the request itself, chunk by chunk, jumping over the
  resident spans between holes (``continue_chunk``). With phantoms off, it is the end of the first
  resident run: the request recomputes everything after it.
- ``req.last_node`` holds a ``MatchRef``: the Penelope match, the token source it was made for and
  what was reported. Locks are Penelope lock handles, found again by the id in SGLang's receipt.
- SGLang allocates slots. The tree takes a request's slots when it inserts or refills blocks and
  hands slots back to SGLang's allocator when it evicts blocks or drops duplicates
  (``SGLangSlots``, which refuses a slot passed twice or already held by the tree).
- A refilled hole belongs to the tree from the moment the phantom's slots are linked into the
  request's row (before the forward that writes them, as SGLang publishes a chunked request's KV
  before its chunk has run), so SGLang's conservation check (available + evictable + protected +
  request-owned == total) holds at every step.
- Keys in an ``extra_key`` / ``cache_salt`` namespace are cached in a namespace of their own.

Differences from ``RadixCache`` by design: a reported prefix may contain holes that only a
phantom or the request's own chunks make resident; ``insert`` frees the duplicates it finds after
the first hole itself (the caller frees the leading ones, as with ``RadixCache``).
Not supported (clear errors): EAGLE bigram keys, HiCache, sliding-window and mamba models.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import Counter

import numpy as np
import torch
from sglang.srt.managers.schedule_batch import FINISH_ABORT
from sglang.srt.mem_cache.allocator.page_interleave import page_interleave_shard_size
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

from penelope.cache.admission import load_path
from penelope.cache.hints import ARRIVED, FINISHED, Hint
from penelope.cache.manager import KVCache
from penelope.cache.manager import MatchResult as PenelopeMatch
from penelope.cache.refill import RefillPlan, next_chunk, plan_refill
from penelope.cache.tiers import TwoTierCache
from penelope.cache.tree import BlockState
from penelope.errors import CacheFullError, InvariantError, UsageError

from .backends import phantoms_allowed, prefill_backend
from .events import KVEvents
from .hints import book_counters, wait_kind
from .host_tier import HostKV, host_tokens, kv_bytes_per_token
from .keys import MatchRef, Namespaces, key_tokens, phantom_eligible, whole_number
from .options import PenelopeOptions
from .slots import SGLangSlots

logger = logging.getLogger(__name__)

# Attribute on a Req: its RefillPlan, from admission until its holes are computed.
REFILL = "penelope_refill"
# Set on a request once the cache was told it arrived (a queued request is matched many times).
ARRIVAL = "penelope_arrived"
# The attribute `hooks.make_phantom` sets on a phantom (hooks imports this module, not the reverse).
_PHANTOM_OF = "penelope_phantom_of"

class PenelopeRadixCache(BasePrefixCache):
    """Drop-in for SGLang's ``RadixCache(params)`` whose tree and eviction are Penelope's.

    `options`: block size, policy (default: from the environment only); `phantoms`: report holes
    for phantoms to refill (True only where the hooks of ``hooks.py`` are applied); `backend`:
    the prefill attention backend (default: the one this process's SGLang configuration names),
    which decides whether phantoms may ride in their request's batch (``backends.py``);
    `forward_stream`: the stream SGLang's forwards run on, which the CPU tier's copies are ordered
    against (``host_tier.HostKV``).
    """

    # No SGLang sliding window: the scheduler's budget code reads this attribute.
    sliding_window_size = None

    def __init__(self, params: CacheInitParams, options: PenelopeOptions | None = None,
                 phantoms: bool | None = None, hicache_size_gb: float = 0, hicache_ratio: float | None = None,
                 cost_model=None, backend: str | None = None, forward_stream=None):
        options = options if options is not None else PenelopeOptions()
        if params.is_eagle:
            raise UsageError("penelope: EAGLE speculative decoding (bigram keys) is not supported")
        self.disable = params.disable
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = params.page_size
        self.options = options
        self.cost_model = cost_model
        self.forward_stream = forward_stream
        self.phantoms = options.phantoms if phantoms is None else phantoms
        self.block_size = options.resolved_block_size(self.page_size)
        # Phantoms only where the backend stores a batch's K/V before reading its prefix; holes are
        # refilled hole-first elsewhere.
        self.phantom_refill = self.phantoms and phantoms_allowed(
            options.refill, backend or prefill_backend(), page_interleave_shard_size(self.token_to_kv_pool_allocator))
        self.slots = SGLangSlots(self.token_to_kv_pool_allocator)
        self.device = self.slots.device
        self._on_cpu = self.device.type == "cpu"
        kv_pool = self.token_to_kv_pool_allocator.get_kvcache()
        self.host_tokens = host_tokens(options.cpu_cache, hicache_size_gb, hicache_ratio, self.slots.capacity,
                                       kv_bytes_per_token(kv_pool))
        if self.host_tokens and self.host_tokens < self.block_size:
            raise UsageError(f"penelope: a CPU tier of {self.host_tokens} tokens is smaller than one block "
                             f"of {self.block_size} tokens")
        self.host_kv = None
        if params.enable_metrics:
            self.init_metrics_collector()
        self._lock_ids = itertools.count(1)
        self.namespaces = Namespaces()
        self.kv_events = KVEvents(params, self.block_size, self.namespaces)
        # Tokens computed by phantoms, and hole tokens computed by their own request's chunks.
        self.phantom_tokens = 0
        self.chunk_refill_tokens = 0
        # Tokens a request computed that the tree held already when it checkpointed them.
        self.duplicate_tokens = 0
        # Seconds on rank 0's monotonic clock, as broadcast to every TP rank (``clock.py``): the
        # time hints carry. No wall clock is read here, so every rank decides alike.
        self.now = 0.0
        # What earlier trees did before a reset replaced them (evictions, tier moves).
        self._earlier = Counter()
        self.cache = None
        self.reset()

    def reset(self):
        """Forget everything (SGLang clears its allocator alongside, e.g. on flush_cache). The
        counters of what the cache did (evictions, tier moves) go on from where they were, as
        SGLang's own counters do over a flush."""
        if self.cache is not None:
            self._earlier.update(self._cache_counters())
        self.slots.reset()
        if self.host_tokens:
            self.cache = TwoTierCache(self.slots.capacity, self.host_tokens, block_size=self.block_size,
                                      policy=self.options.policy, swap_buffer=max(self.options.swap_buffer,
                                                                                  self.block_size),
                                      allocator=self.slots, cost_model=self.cost_model, track_recompute=False)
            if self.host_kv is None:
                self.host_kv = HostKV(self.token_to_kv_pool_allocator.get_kvcache(), self.cache.host_rows,
                                      self.options.copy, fence=self.forward_stream)
        else:
            self.cache = KVCache(self.slots.capacity, block_size=self.block_size, policy=self.options.policy,
                                 allocator=self.slots, cost_model=self.cost_model, track_recompute=False)
        self.root_node = MatchRef(None)
        self._empty = MatchResult(device_prefix_len=0, last_device_node=self.root_node,
                                  last_host_node=self.root_node, best_match_node=self.root_node)
        self._locks: dict[int, object] = {}
        # The node each lock was taken on: its receipt releases it only there.
        self._lock_refs: dict[int, MatchRef] = {}
        self.kv_events.cleared()

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """Match ``params.key`` through missing blocks; see the module docstring for what is
        reported."""
        key = params.key
        req = params.req
        if req is not None and getattr(req, REFILL, None) is not None:
            setattr(req, REFILL, None)
        if self.disable or key.is_bigram:
            return self._empty
        # A request's namespace is numbered at its arrival, so that its finish can be reported.
        namespace = self.namespaces.number(key.extra_key, key.cache_salt, create=req is not None)
        if req is not None:
            self._report_arrival(req, namespace)
        n = len(key) // self.block_size * self.block_size
        if namespace is None or n == 0:
            return self._empty
        tokens = key_tokens(key.token_ids, n, namespace)
        match = self.cache.match(tokens)
        with_holes = self.phantoms and phantom_eligible(req)
        ref = MatchRef(match, key.token_ids, n, namespace, with_holes)
        if not with_holes and ref.prefix_len < match.compute_from:
            # The request computes everything after its first hole, the resident spans there
            # included: its lock must not keep them from being evicted (they would be charged as
            # new tokens while being held, and a full pool would never fit the request).
            ref = self._cut(ref, ref.prefix_len, with_holes=False)
        return MatchResult(device_prefix_len=ref.prefix_len, last_device_node=ref, last_host_node=ref,
                           best_match_node=ref)

    def _report_arrival(self, req, namespace: int) -> None:
        """Tell the policy a request arrived, once, with its whole prompt: the key SGLang matches
        may be shorter (cut at ``logprob_start_len``, or empty for a prompt it will not reuse)."""
        if getattr(req, ARRIVAL, False) or getattr(req, _PHANTOM_OF, None) is not None:
            return
        setattr(req, ARRIVAL, True)
        prompt = req.origin_input_ids
        n = len(prompt) // self.block_size * self.block_size
        self.cache.hint(key_tokens(prompt, n, namespace), Hint(self.now, ARRIVED))

    def tell_time(self, now: float) -> None:
        """Rank 0's clock reading (seconds), broadcast with an iteration's requests (``clock.py``);
        the time of the arrivals and finishes that follow. Never goes back."""
        self.now = max(self.now, float(now))

    def touch_prefix(self, key) -> None:
        """Bump the recency of ``key``'s cached path (a match that reports nothing)."""
        namespace = self.namespaces.number(key.extra_key, key.cache_salt, create=False)
        n = len(key) // self.block_size * self.block_size
        if not (self.disable or key.is_bigram or namespace is None or n == 0):
            self.cache.match(key_tokens(key.token_ids, n, namespace))

    def insert(self, params: InsertParams) -> InsertResult:
        """Cache the whole blocks of ``params.key`` with KV in ``params.value`` (slots, [len(key)]),
        as ``RadixCache.insert``: ``prefix_len`` counts the leading tokens that were cached
        already, whose passed slots stay the caller's to free; the partial last block is not
        cached and stays the caller's too. By design, duplicates after the first refilled hole are
        freed here. A slot passed twice, held by the tree or on SGLang's free list is refused
        (UsageError) before anything changes, and so is a value that is not a 1-D int32/int64
        tensor on the pool's device type. ``value=None`` is refused too: ``RadixCache`` then caches
        the token ids as slots, a fallback of its simulated, pool-less tree that on real pools would
        hand those ids to SGLang's allocator as free slots on eviction."""
        key = params.key
        if self.disable:
            return InsertResult(prefix_len=0)
        if key.is_bigram:
            raise UsageError("penelope: bigram (EAGLE) keys are not supported")
        if params.value is None:
            raise UsageError("penelope: insert needs the KV slots of its key (value=None would cache token ids "
                             "as slots)")
        slots = self._slot_array(params.value)
        n = len(key) // self.block_size * self.block_size
        namespace = self.namespaces.number(key.extra_key, key.cache_salt, create=True)
        if n == 0:
            return InsertResult(prefix_len=0)
        tokens = key_tokens(key.token_ids, n, namespace)
        if len(slots) < n:
            raise UsageError(f"penelope: insert of {n} tokens got {len(slots)} slots")
        slots = slots[:n]
        # KV events name the blocks that become resident: they need the match before the insert.
        before = self.cache.match(tokens, slots=False) if self.kv_events.enabled else None
        # The leading cached tokens keep the tree's slots: the passed ones there are not read.
        # Every slot the tree takes or frees is checked against SGLang's free list first.
        self.slots.check_free_list = True
        try:
            result = self.cache.insert(tokens, slots, keep_leading=True)
        finally:
            self.slots.check_free_list = False
        if before is not None:
            self.kv_events.stored(self.cache, tokens, before)
        return InsertResult(prefix_len=result.leading, total_len=n)

    def checkpoint(self, req, *, up_to: int, **kwargs):
        """Insert the whole blocks of the request's first ``up_to`` tokens, point its row at the
        tree's slots where the tree kept its own, lock the request's whole cached path (so the
        resident spans a hole-first request still jumps to stay resident) and advance
        ``cache_protected_len``. Reads only the new part of the row back from the device."""
        if self.disable:
            return
        namespace = self.namespaces.number(req.extra_key, req.cache_salt, create=True)
        kv = req.kv
        n = up_to // self.block_size * self.block_size
        protected = kv.cache_protected_len
        if n <= protected:
            return
        source = req.full_untruncated_fill_ids
        tokens = key_tokens(source, n, namespace)
        # Where the tree holds the tokens; no slots: the protected part keeps the tree's own
        # (`tree_prefix`), the rest is read from the request's row.
        before = self.cache.match(tokens, slots=False)
        for span in before.spans:
            if span.start >= protected:
                break
            if span.state != BlockState.GPU:
                raise InvariantError(f"penelope: {req.rid} owns no KV at [{span.start}, {span.end}) "
                                     f"below its protected length {protected}")
        covered = before.spans[-1].end if before.spans else 0
        if covered < protected:
            raise InvariantError(f"penelope: {req.rid} has {protected} tokens protected but the tree holds {covered}")
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
        slots = np.empty(n, dtype=np.int64)
        new = row[protected:n]
        slots[protected:] = new.numpy() if new.device.type == "cpu" else new.to("cpu", torch.int64).numpy()
        inserted = self._insert(tokens, slots, before, tree_prefix=protected)
        self.chunk_refill_tokens += inserted.refilled
        freed = inserted.freed
        self.duplicate_tokens += freed
        full = key_tokens(source, len(source) // self.block_size * self.block_size, namespace)
        ref = MatchRef(self.cache.match(full), source, len(full), namespace)
        if ref.prefix_len < n:
            raise InvariantError(f"penelope: after inserting {n} tokens only {ref.prefix_len} are resident")
        if freed:
            # The tree kept its own copy of some blocks: the row must read those.
            self.req_to_token_pool.write((kv.req_pool_idx, slice(protected, n)),
                                         torch.from_numpy(ref.slots(n)[protected:]).to(row.device, row.dtype))
        kv.cache_protected_len = n
        kv.cache_inserted_len = max(kv.cache_inserted_len, n)
        # Lock the new path before unlocking the old one, so nothing in between is pruned.
        old = req.lock
        req.lock = self.lock(ref)
        self.unlock(old)
        req.last_node = ref

    def on_release(self, req, *, checkpointed: bool) -> None:
        """A finished request's row is freed: tell the cache its session now waits, and for what
        (``hints.wait_kind``), on the sequence the tree holds for it (an aborted request: on its
        prompt, wait kind unknown). A request released unfinished (retracted to be rescheduled)
        is still in the system: nothing is said."""
        if self.disable or not req.finished() or getattr(req, _PHANTOM_OF, None) is not None:
            return
        namespace = self.namespaces.number(req.extra_key, req.cache_salt, create=False)
        if namespace is None or not getattr(req, ARRIVAL, False):
            return
        if isinstance(req.finished_reason, FINISH_ABORT):
            # Aborted (by its client, or refused): it ends as it arrived, with its whole prompt,
            # and nothing is known of what its session waits for.
            source, kind = req.origin_input_ids, None
            n = len(source) // self.block_size * self.block_size
        else:
            source = req.full_untruncated_fill_ids
            n = min(len(source), req.kv.cache_protected_len) // self.block_size * self.block_size
            try:
                kind = wait_kind(req, self.options.tool_call_token)
            except UsageError as error:
                # One client's malformed hint must not stop the scheduler: its wait kind is unknown.
                logger.warning("%s; its session's wait kind is unknown", error)
                kind = None
        self.cache.hint(key_tokens(source, n, namespace), Hint(self.now, FINISHED, kind))
        # A prefetching policy (penelope-agent over two tiers) may now bring a tool-waiting
        # session's CPU blocks back to the GPU; the copies run before the scheduler's next step.
        self.cache.advance(self.now)
        self._run_plans()

    def evict(self, params: EvictParams) -> EvictResult:
        """Free at least ``params.num_tokens`` tokens (whole blocks) or everything evictable;
        evicting 0 or fewer does nothing."""
        num_tokens = whole_number(params.num_tokens)
        if num_tokens is None:
            raise UsageError(f"penelope: evict takes a whole number of tokens, got {repr(params.num_tokens)[:60]}")
        if self.disable or num_tokens <= 0:
            return EvictResult()
        start = time.perf_counter()
        result = self.cache.evict(num_tokens)
        # Demotions copy the KV they move out before SGLang hands its slots to new requests.
        self._run_plans()
        self.kv_events.removed(result.hashes)
        self.update_eviction_metrics(result.freed_tokens, start)
        return EvictResult(num_tokens_evicted=result.freed_tokens)

    def inc_lock_ref(self, node: MatchRef) -> IncLockRefResult:
        """Lock the matched root path of `node`; the receipt's ``node_id`` names the lock."""
        if not isinstance(node, MatchRef):
            raise UsageError(f"penelope: inc_lock_ref takes the node a match returned, got {node!r}")
        if self.disable or node.match is None:
            return IncLockRefResult(delta=0)
        before = self.cache.evictable_size()
        handle = self.cache.lock(self._fresh(node))
        lock_id = next(self._lock_ids)
        self._locks[lock_id] = handle
        self._lock_refs[lock_id] = node
        return IncLockRefResult(delta=self.cache.evictable_size() - before, node_id=lock_id)

    def dec_lock_ref(self, node: MatchRef, params: DecLockRefParams | None = None) -> DecLockRefResult:
        """Release the lock named by the receipt (without one: the latest lock taken on `node`).
        A receipt whose lock was released already, or was taken on another node, is refused: it
        must not release another holder's lock."""
        if not isinstance(node, MatchRef):
            raise UsageError(f"penelope: dec_lock_ref takes the node a match returned, got {node!r}")
        if self.disable or node.match is None:
            return DecLockRefResult(delta=0)
        self._check_origin(node)
        if params is not None and params.node_id is not None:
            lock_id = params.node_id
            if lock_id not in self._locks:
                raise UsageError(f"penelope: the lock of receipt {lock_id} was released already")
            if self._lock_refs[lock_id] is not node:
                raise UsageError(f"penelope: receipt {lock_id} is a lock on another node, not on {node!r}")
        else:
            lock_id = next((i for i in reversed(self._locks) if self._locks[i].node is node.match.handle), None)
        if lock_id is None:
            raise UsageError(f"penelope: no lock held on {node!r}")
        before = self.cache.evictable_size()
        self.cache.unlock(self._locks.pop(lock_id))
        self._lock_refs.pop(lock_id)
        return DecLockRefResult(delta=self.cache.evictable_size() - before)

    def prefix_device_indices(self, req) -> torch.Tensor:
        """Slots of the request's matched prefix [0, req.prefix_len); PAD_SLOT at holes until the
        phantoms' slots are linked in."""
        return self._to_device(req.last_node.slots(req.prefix_len))

    def path_device_indices(self, node: MatchRef) -> torch.Tensor:
        return self._to_device(node.slots(node.prefix_len))

    def dfs_weight_order(self, node_handles) -> list[int]:
        """Keep the given order: match handles are not tree nodes."""
        return list(range(len(node_handles)))

    def plan_admission(self, req, chunk_budget: int | None, free_rows: int,
                       align: int | None = None) -> RefillPlan | None:
        """Decide how a request whose match reported holes is admitted (``penelope.cache.refill``):
        phantoms (where the attention backend allows them), or hole-first chunks from its first
        hole, or (without chunked prefill and rows) some holes dropped. Sets the request's prefix
        accordingly; a request that drops holes then holds a match of what it reads only. `align`:
        the scheduler's chunk alignment (SGLang's ``truncation_align_size``), if any. None without
        holes."""
        ref = req.last_node
        if not isinstance(ref, MatchRef) or not ref.holes or req.kv.req_pool_idx is not None \
                or req.prefix_len != ref.prefix_len:
            return None
        extend = len(req.full_untruncated_fill_ids) - ref.prefix_len
        plan = plan_refill(ref.holes, ref.prefix_len, extend, chunk_budget, max(free_rows, 1), self.page_size,
                           phantoms=self.phantom_refill, own_chunk=align)
        setattr(req, REFILL, plan)
        if plan.compute_from != ref.prefix_len:
            req.prefix_len = plan.compute_from
            req.kv.cache_protected_len = plan.compute_from
        if not plan.hole_first and plan.compute_from < ref.prefix_len:
            # It recomputes the resident spans after its first dropped hole: its lock covers only
            # what it reads, so they stay evictable (see match_prefix).
            cut = self._cut(ref, plan.compute_from, with_holes=True)
            if cut.prefix_len != plan.compute_from:
                raise InvariantError(f"penelope: {req.rid} reads {plan.compute_from} tokens but its cut match "
                                     f"reports {cut.prefix_len}")
            req.last_node = req.last_host_node = req.best_match_node = cut
        return plan

    def jumped_tokens(self, req) -> int:
        """Resident tokens a hole-first request about to be admitted jumps over: SGLang charges
        them as new tokens (its whole prompt from the first hole), but they need no slots."""
        plan = getattr(req, REFILL, None)
        if plan is None or not plan.hole_first or req.kv.req_pool_idx is not None:
            return 0
        return plan.jumped_tokens

    def load_for(self, req) -> bool:
        """With a CPU tier: bring the CPU spans of the request's match to the GPU before its
        admission (demoting other KV in the policy's order, through the swap buffer when both tiers
        are full), copies issued before anything can read the slots, then report its prefix anew.
        False, changing nothing, when the GPU cannot take them now (too much KV locked)."""
        ref = req.last_node
        if (self.host_kv is None or not isinstance(ref, MatchRef) or ref.match is None or not ref.match.loads
                or req.kv.req_pool_idx is not None):
            return True
        match = self._fresh(ref)
        handle = self.cache.lock(match)
        try:
            load_path(self.cache, handle, match.loads)
        except CacheFullError:
            self.cache.unlock(handle, admitted=False)
            return False
        self._run_plans()
        again = MatchRef(self.cache.match(key_tokens(ref.source, ref.n, ref.namespace)), ref.source, ref.n,
                         ref.namespace, with_holes=self.phantoms and phantom_eligible(req))
        self.cache.unlock(handle, admitted=False)
        req.last_node = req.last_host_node = req.best_match_node = again
        req.prefix_len = again.prefix_len
        req.kv.cache_protected_len = again.prefix_len
        return True

    def phantom_holes(self, req) -> list[tuple[int, int]]:
        """Holes of `req` that phantoms refill in its admission batch (empty once it holds a row)."""
        plan = getattr(req, REFILL, None)
        if plan is None or not plan.phantoms or req.kv.req_pool_idx is not None:
            return []
        return list(plan.phantoms)

    def hole_tokens(self, req) -> int:
        """Tokens the phantoms of `req` compute in its admission batch."""
        return sum(end - start for start, end in self.phantom_holes(req))

    def continue_chunk(self, req) -> int | None:
        """Before a hole-first request's next chunk: jump over the resident spans that start at
        its prefix (their tree slots go into its row) and return how many tokens the chunk may
        compute before the end of the hole it is in (None once its holes are done)."""
        plan = getattr(req, REFILL, None)
        if plan is None or not plan.hole_first:
            return None
        position, hole_end = next_chunk(plan, req.prefix_len)
        if position != req.prefix_len:
            self._jump(req, position)
        if hole_end is None:
            setattr(req, REFILL, None)
            return None
        return hole_end - position

    def link_phantoms(self, holed: list, out_cache_loc: torch.Tensor | None = None,
                      offsets: dict | None = None) -> None:
        """After allocation, for every (request, its phantoms) of a batch (`holed`): hand the phantoms' hole
        slots to the tree (they are written by the forward about to run) and point the request's
        row, and the rows of its later phantoms (whose prefixes contain the hole), at the tree's
        slots. A hole some other request refilled meanwhile keeps the tree's slots: the phantom
        then writes its K/V there too (the same tokens at the same positions) and its own slots are
        freed, so that no slot handed out again can be written by this forward. `out_cache_loc`:
        the batch's write slots, with each phantom's first index in it (`offsets`, by id). The
        batch's rows are read back in one device-to-host copy and written in one scatter, not once
        per phantom (each read from a GPU waits for it)."""
        table = self.req_to_token_pool.req_to_token
        phantoms = [phantom for _, ones in holed for phantom in ones]
        if not phantoms:
            return
        passed_all = torch.cat([table[p.kv.req_pool_idx, p.prefix_len:p.extend_end] for p in phantoms]).to(
            "cpu", torch.int64).numpy()
        rows, columns, values = [], [], []
        redirected, targets, freed = [], [], []
        offset = 0
        for req, ones in holed:
            handle = self._locks[req.lock.receipt.node_id]
            for i, phantom in enumerate(ones):
                start, end = phantom.prefix_len, phantom.extend_end
                passed = passed_all[offset:offset + end - start]
                offset += end - start
                kept = self.cache.refill(handle, start, passed)
                if self.kv_events.enabled:
                    namespace = self.namespaces.number(req.extra_key, req.cache_salt, create=True)
                    self.kv_events.stored_range(self.cache, key_tokens(req.full_untruncated_fill_ids, end, namespace),
                                                start, end)
                others = np.flatnonzero(passed != kept)
                if len(others):
                    if out_cache_loc is None:
                        raise InvariantError(f"penelope: {phantom.rid} must write the tree's slots, but its batch's "
                                             "write slots were not given")
                    redirected.append(offsets[id(phantom)] + others)
                    targets.append(kept[others])
                    freed.append(passed[others])
                for holder in [phantom, req, *ones[i + 1:]]:
                    rows.append(np.full(end - start, holder.kv.req_pool_idx, dtype=np.int64))
                    columns.append(np.arange(start, end, dtype=np.int64))
                    values.append(kept)
                # The hole is the tree's now: SGLang must not count it as the phantom's as well.
                phantom.kv.cache_protected_len = end
                self.phantom_tokens += end - start
            logger.debug("penelope: %s refills %s with phantoms", req.rid, [(p.prefix_len, p.extend_end) for p in ones])
        device = table.device
        where = tuple(torch.from_numpy(np.concatenate(parts)).to(device) for parts in (rows, columns))
        table[where] = torch.from_numpy(np.concatenate(values)).to(device, table.dtype)
        if redirected:
            out_cache_loc[torch.from_numpy(np.concatenate(redirected)).to(out_cache_loc.device)] = \
                torch.from_numpy(np.concatenate(targets)).to(out_cache_loc.device, out_cache_loc.dtype)
            self.slots.free(np.concatenate(freed))

    def evictable_size(self) -> int:
        return self.cache.evictable_size()

    def protected_size(self) -> int:
        return self.cache.protected_size()

    def total_size(self) -> int:
        return self.cache.evictable_size() + self.cache.protected_size()

    def all_values_flatten(self) -> torch.Tensor:
        """Every device slot the tree holds (int64), as ``RadixCache.all_values_flatten``."""
        return torch.from_numpy(self.cache.tree.slots_in(BlockState.GPU)).to(self.device)

    def supports_prefix_sharing(self) -> bool:
        return not self.disable

    def check_invariants(self) -> None:
        """Penelope's tree, lock and slot checks, SGLang's free list included; valid at any time
        (slots requests hold are counted as such)."""
        self.cache.check_invariants()

    def _cache_counters(self) -> Counter:
        """What the current tree did since the last reset: evictions and tier moves."""
        counts = Counter(evicted_tokens=self.cache.stats.evicted_tokens, evict_calls=self.cache.stats.evict_calls)
        if self.host_kv:
            counts.update({f"tier_{name}": value for name, value in self.cache.counters.as_dict().items()})
        return counts

    def stats(self) -> dict:
        """Counters for ``get_server_info``: what the cache did since the server started (flushes
        included), tokens the phantoms computed, and the cache's sizes now."""
        tiers = {"tier_copy": self.host_kv.executor.copy,
                 "tier_host_cached_tokens": self.cache.cpu_evictable_size() + self.cache.cpu_protected_size(),
                 } if self.host_kv else {}
        # Every counter, zeros included (Counter's + would drop them).
        now = self._cache_counters()
        return {**{name: self._earlier[name] + value for name, value in now.items()}, **tiers,
                "host_tokens": self.host_tokens,
                "phantom_tokens": self.phantom_tokens, "chunk_refill_tokens": self.chunk_refill_tokens,
                "duplicate_tokens": self.duplicate_tokens,
                "cached_tokens": self.total_size(), "block_size": self.block_size,
                "policy": self.cache.policy.name, **book_counters(self.cache.policy),
                "cost_model": self.cost_model.shape.name if self.cost_model is not None else "tokens"}

    def pretty_print(self):
        tree = self.cache.tree
        for node in tree.nodes():
            depth = len(tree.path_to_root(node)) - 1
            print("  " * depth, node, node.tokens[:8].tolist())
        print(f"#tokens: {self.total_size()} (evictable {self.evictable_size()}, protected "
              f"{self.cache.protected_size()}, block {self.block_size}, policy {self.cache.policy.name})")

    def _run_plans(self) -> None:
        """Run the copies of the tier moves the cache just decided (CPU tier only)."""
        if self.host_kv is not None:
            self.host_kv.run(self.cache.take_plans())

    def _insert(self, tokens: np.ndarray, slots: np.ndarray, before: PenelopeMatch, tree_prefix: int = 0):
        """KVCache.insert (`before`: its match of `tokens`, made just now; `tree_prefix`: see
        KVCache.insert), with KV events for the blocks that became resident."""
        result = self.cache.insert(tokens, slots, before, tree_prefix)
        self.kv_events.stored(self.cache, tokens, before)
        return result

    def _cut(self, ref: MatchRef, n: int, with_holes: bool) -> MatchRef:
        """`ref` matched again on its first `n` tokens only (whole blocks): a lock on the result
        protects the path up to `n` and nothing after it."""
        if n == 0:
            return self.root_node
        return MatchRef(self.cache.match(key_tokens(ref.source, n, ref.namespace)), ref.source, n, ref.namespace,
                        with_holes)

    def _jump(self, req, position: int) -> None:
        """Advance a hole-first request over resident spans [prefix_len, position): its row takes
        the tree's slots there, and SGLang's lengths move as if it had computed them."""
        kv = req.kv
        start = req.prefix_len
        ref = MatchRef(self.cache.match(key_tokens(req.full_untruncated_fill_ids, position,
                                                     self.namespaces.number(req.extra_key, req.cache_salt, True))),
                       with_holes=False)
        if ref.prefix_len < position:
            raise InvariantError(f"penelope: {req.rid} cannot jump to {position}: only {ref.prefix_len} resident")
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
        self.req_to_token_pool.write((kv.req_pool_idx, slice(start, position)),
                                     torch.from_numpy(ref.slots(position)[start:]).to(row.device, row.dtype))
        req.prefix_len = position
        kv.cache_protected_len = position
        kv.kv_committed_len = kv.kv_allocated_len = position

    def _to_device(self, slots: np.ndarray) -> torch.Tensor:
        """`slots` as a tensor on the pool's device (shares their memory on the CPU)."""
        tensor = torch.from_numpy(slots)
        return tensor if self._on_cpu else tensor.to(self.device)

    def _slot_array(self, value) -> np.ndarray:
        """`value` (SGLang's slots) as an int64 numpy array, read in place when it is an int64
        tensor on a CPU pool; refused as `_check_slot_tensor` says otherwise."""
        if type(value) is torch.Tensor and self._on_cpu and value.dtype == torch.int64:
            try:
                array = value.numpy()
            except (TypeError, RuntimeError):
                # Not on the CPU (refused below), or a layout numpy cannot read in place.
                array = None
            if array is not None and array.ndim == 1:
                return array
        self._check_slot_tensor(value)
        try:
            return value.to("cpu", torch.int64).numpy()
        except (TypeError, RuntimeError) as error:
            raise UsageError(f"penelope: insert cannot read its slots ({value.layout}): {error}".split("\n")[0]) \
                from None

    def _check_slot_tensor(self, value) -> None:
        """Raise UsageError unless `value` is what SGLang passes as slots: a 1-D int32/int64
        tensor on the pool's device type (a float tensor would be truncated to other slots)."""
        if not isinstance(value, torch.Tensor):
            got = f"a {type(value).__name__}"
        elif value.dtype not in (torch.int32, torch.int64) or value.dim() != 1 \
                or value.device.type != self.device.type:
            got = f"{value.dtype} {tuple(value.shape)} on {value.device}"
        else:
            return
        raise UsageError(f"penelope: insert takes slots as a 1-D int32 or int64 tensor on {self.device.type}, "
                         f"got {got}")

    def _check_origin(self, ref: MatchRef) -> None:
        """Raise UsageError unless `ref` (not the root's) was made by this cache's match."""
        if ref.match.owner is not self.cache:
            raise UsageError(f"penelope: {ref!r} comes from another cache (or from before a reset): pass a node "
                             "this cache's match_prefix returned")

    def _fresh(self, ref: MatchRef) -> PenelopeMatch:
        """`ref`'s match, redone if an eviction made it stale; the redone match must report the
        same prefix with the same slots, or the request's prefix would point at freed KV."""
        self._check_origin(ref)
        match = ref.match
        if self.cache.is_fresh(match):
            return match
        again = MatchRef(self.cache.match(key_tokens(ref.source, ref.n, ref.namespace)), ref.source, ref.n,
                         ref.namespace, with_holes=bool(ref.holes))
        if (again.prefix_len, again.holes) != (ref.prefix_len, ref.holes) or not np.array_equal(
                again.slots(ref.prefix_len), ref.slots(ref.prefix_len)):
            raise InvariantError("penelope: the cache evicted part of a matched prefix before it was locked")
        ref.match = again.match
        return again.match
