"""Scheduler-side cache overhead per request: Penelope against SGLang 0.5.23's caches, one
operation sequence replayed through all of them.

Caches (all on CPU, SGLang's on its real pools and allocators, all with least-recently-used
eviction so that they hold the same blocks):
- ``kvcache``: Penelope's ``KVCache`` alone (its own slot allocator, numpy token arrays);
- ``adapter``: ``PenelopeRadixCache``, the plugin's SGLang cache, over SGLang's allocator;
- ``radixcache``: SGLang's Python ``RadixCache``;
- ``unified_python``: SGLang's default ``UnifiedRadixCache`` on its pure-Python tree core;
- ``unified_rust``: ``UnifiedRadixCache`` on its compiled Rust tree core (SGLang's default core,
  ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=rust``), shipped in the sglang wheel.

Workload (seeded), in pages so that every page size does the same tree work: a 32-page system
prompt all sessions share; each session starts from a private history of 64-384 pages, then takes
10-40 turns, each a request of its whole history plus 1-8 pages of new tokens, answered by a reply
of 1-6 pages (token counts drawn to the token, so pages are partly filled at page 64). The cache
holds ``blocks`` pages (blocks = pages: Penelope's block is one SGLang page). Untimed fill: one
request per session, sessions after sessions, until 1.2x the capacity was inserted (the cache is
full and has evicted). Timed: four sessions take turns round-robin (the last four of the fill
first); a session that ends is replaced by a new one, whose first request inserts its history.

Every request runs a scheduler's protocol: Penelope's ``KVCache``: match -> lock -> alloc (evicts)
-> the slot row -> insert -> unlock; the SGLang caches: match_prefix -> path_device_indices ->
lock -> evict the shortfall -> alloc -> torch.cat of the row -> insert -> free the duplicates
(``UnifiedRadixCache`` frees them itself, told the matched length by ``prev_prefix_len``) and the
partial page -> unlock.

The timed requests are cut into segments; the caches replay each segment in turn, each
continuing from its own state, in orders that give every cache every other one as its predecessor
equally often (``interleave.balanced_orders``: a cache runs in the memory state its predecessor
left, and one rotated order would charge that to one cache every time), each segment after a pass
over 64 MiB that evicts the CPU caches (``interleave.Scrub``), so that the first cache of a
segment does not follow the previous segment's last. Time is the CPU time of the benchmark's
thread with torch on one thread (neither SGLang's Rust core nor torch then works on other threads:
measured, the process's CPU time equals the thread's), so other jobs on a shared machine do not
count. Figures in ``extra_info``: ``<cache>_s_per_request`` (median over segments); the Rust
core's time / the cache's time in the same segment, median over segments (>= 1.0: at least as fast
as the Rust core), as ``ratio_kvcache_vs_rust`` and ``ratio_adapter_vs_rust`` (tracked by
``compare.py``) and ``radixcache_vs_rust``, ``unified_python_vs_rust`` (SGLang's own, shown only),
each with ``<cache>_vs_rust_ci95`` (the distribution-free 95% interval of that median,
``interleave.median_interval``) and ``<cache>_vs_rust_range`` (lowest, highest over segments); exact
counts of the work (requests of the fill, tokens hit, tokens cached after the run; the same for
every cache, asserted).

Run: ``python -m pytest microbench/bench_cache_overhead.py --benchmark-json out.json``.
"""
from __future__ import annotations

import statistics
import time
from array import array

import numpy as np
import pytest
import torch
from bench_cache_manager import penelope_request
from interleave import Scrub, balanced_orders, median_interval

from penelope.cache.manager import KVCache

PAGES = (1, 64)
TREE_BLOCKS = (10_000, 100_000)
CACHES = ("kvcache", "adapter", "radixcache", "unified_python", "unified_rust")
SYSTEM_PAGES = 32
START_PAGES = (64, 384)
TURNS = (10, 40)
NEW_PAGES = (1, 8)
REPLY_PAGES = (1, 6)
ACTIVE = 4
FILL = 1.2
# Two rounds of the ten balanced orders of five caches.
SEGMENTS = 20
SEGMENT_REQUESTS = 60
VOCAB = 151_936


class Workload:
    """Sessions' token ids (int64) and the requests: `fill` and `segments` of (session,
    request_len, reply_len)."""

    def __init__(self, page: int, blocks: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        system = rng.integers(0, VOCAB, SYSTEM_PAGES * page, dtype=np.int64)
        self.tokens: list[np.ndarray] = []
        self.fill: list[tuple[int, int, int]] = []
        inserted = 0
        while inserted < FILL * blocks * page:
            start = self._new_session(rng, system, page, turns=0)
            self.fill.append((len(self.tokens) - 1, start, 0))
            inserted += start - len(system)
        # Timed: the last four sessions of the fill go on with turns; new sessions replace ended ones.
        plans: dict[int, list[tuple[int, int]]] = {}
        for s in range(len(self.tokens) - ACTIVE, len(self.tokens)):
            plans[s] = self._turns(rng, s, page, first=len(self.tokens[s]))
        active = list(plans)
        requests: list[tuple[int, int, int]] = []
        while len(requests) < SEGMENTS * SEGMENT_REQUESTS:
            for i, s in enumerate(active):
                if not plans[s]:
                    start = self._new_session(rng, system, page, turns=0)
                    s = active[i] = len(self.tokens) - 1
                    plans[s] = [(start, 0)] + self._turns(rng, s, page, first=start)
                requests.append((s, *plans[s].pop(0)))
        self.segments = [requests[i * SEGMENT_REQUESTS:(i + 1) * SEGMENT_REQUESTS] for i in range(SEGMENTS)]
        self.keys = []
        for tokens in self.tokens:
            ids = array("q")
            ids.frombytes(tokens.tobytes())
            self.keys.append(ids)

    def _new_session(self, rng, system: np.ndarray, page: int, turns: int) -> int:
        start = int(rng.integers(START_PAGES[0] * page, START_PAGES[1] * page + 1))
        self.tokens.append(np.concatenate([system, rng.integers(0, VOCAB, start, dtype=np.int64)]))
        return len(system) + start

    def _turns(self, rng, s: int, page: int, first: int) -> list[tuple[int, int]]:
        """(request_len, reply_len) of a session's turns after its first `first` tokens; the
        session's token ids are extended to cover them."""
        turns, context = [], first
        for _ in range(int(rng.integers(TURNS[0], TURNS[1] + 1))):
            if turns:
                context += int(rng.integers(NEW_PAGES[0] * page, NEW_PAGES[1] * page + 1))
            reply = int(rng.integers(REPLY_PAGES[0] * page, REPLY_PAGES[1] * page + 1))
            turns.append((context, reply))
            context += reply
        extra = context + NEW_PAGES[1] * page - len(self.tokens[s])
        if extra > 0:
            self.tokens[s] = np.concatenate([self.tokens[s], rng.integers(0, VOCAB, extra, dtype=np.int64)])
        return turns


class KVCacheSide:
    """Penelope's KVCache alone, LRU (its `sglang` policy), one block per page."""

    name = "kvcache"

    def __init__(self, workload: Workload, page: int, capacity: int):
        self.workload = workload
        self.cache = KVCache(capacity, block_size=page, policy="sglang", track_recompute=False)
        self.hit_tokens = 0

    def request(self, s: int, request_len: int, reply_len: int) -> None:
        # bench_cache_manager's protocol; this one counts the tokens hit (the first resident run).
        match = penelope_request(self.cache, self.workload.tokens[s], request_len, reply_len)
        self.hit_tokens += match.spans[0].end if match.spans and len(match.spans[0].slots) else 0

    def cached_tokens(self) -> int:
        return self.cache.evictable_size() + self.cache.protected_size()


class SGLangSide:
    """A cache behind SGLang's prefix-cache interface, on SGLang's CPU pools and its real token
    (page 1) or paged allocator."""

    def __init__(self, name: str, workload: Workload, page: int, capacity: int):
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixKey

        self.name, self.workload, self.page = name, workload, page
        self.EvictParams, self.InsertParams, self.MatchPrefixParams = EvictParams, InsertParams, MatchPrefixParams
        self.RadixKey = RadixKey
        req_pool = ReqToTokenPool(size=8, max_context_len=1024, device="cpu", enable_memory_saver=False)
        # The KV pool's tensors are not touched by the caches; keep them tiny.
        kv_pool = MHATokenToKVPool(size=capacity, page_size=page, dtype=torch.bfloat16, head_num=1, head_dim=1,
                                   layer_num=1, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
        if page == 1:
            self.allocator = TokenToKVPoolAllocator(capacity, torch.bfloat16, "cpu", kv_pool, False)
        else:
            self.allocator = PagedTokenToKVPoolAllocator(capacity, page, torch.bfloat16, "cpu", kv_pool, False)
        params = CacheInitParams(disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=self.allocator,
                                 page_size=page)
        if name == "adapter":
            from penelope.integration.sglang import PenelopeOptions, PenelopeRadixCache

            self.cache = PenelopeRadixCache(params, PenelopeOptions(policy="sglang"), phantoms=False)
        elif name == "radixcache":
            from sglang.srt.mem_cache.radix_cache import RadixCache

            self.cache = RadixCache(params)
        else:
            from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
            from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

            params.tree_components = (ComponentType.FULL,)
            params.tree_core_backend = name.removeprefix("unified_")
            self.cache = UnifiedRadixCache(params)
            core = type(self.cache.tree_core).__name__
            # SGLang falls back to the Python core silently where the Rust one cannot run.
            expected = {"rust": "RustUnifiedTreeCore", "python": "UnifiedTreeCore"}[params.tree_core_backend]
            assert core == expected, f"{name}: SGLang chose the tree core {core}"
        self.caller_frees_duplicates = not name.startswith("unified_")
        self.hit_tokens = 0

    def request(self, s: int, request_len: int, reply_len: int) -> None:
        cache, allocator, page = self.cache, self.allocator, self.page
        key_ids = self.workload.keys[s]
        match = cache.match_prefix(self.MatchPrefixParams(key=self.RadixKey(key_ids, limit=request_len)))
        node, prefix_len = match.last_device_node, match.device_prefix_len
        self.hit_tokens += prefix_len
        prefix = cache.path_device_indices(node)[:prefix_len]
        lock = cache.lock(node)
        total = request_len + reply_len
        need = -(-(total - prefix_len) // page) * page
        short = need - allocator.available_size()
        if short > 0:
            cache.evict(self.EvictParams(num_tokens=short))
        new = allocator.alloc(need)
        aligned = total // page * page
        row = torch.cat([prefix, new[:aligned - prefix_len]])
        # prev_prefix_len: the matched prefix is the tree's own (UnifiedRadixCache frees the
        # duplicates after it itself; the others leave them to the caller).
        result = cache.insert(self.InsertParams(key=self.RadixKey(key_ids, limit=aligned), value=row,
                                                prev_prefix_len=prefix_len))
        if self.caller_frees_duplicates and result.prefix_len > prefix_len:
            allocator.free(row[prefix_len:result.prefix_len])
        # The partial last page stays the caller's.
        if need > aligned - prefix_len:
            allocator.free(new[aligned - prefix_len:])
        cache.unlock(lock)

    def cached_tokens(self) -> int:
        return self.cache.evictable_size() + self.cache.protected_size()


def make_side(name: str, workload: Workload, page: int, blocks: int):
    capacity = blocks * page
    if name == "kvcache":
        return KVCacheSide(workload, page, capacity)
    return SGLangSide(name, workload, page, capacity)


def replay(side, requests) -> float:
    """CPU seconds of this thread to run `requests` through `side` (torch on one thread: the
    whole of the work; the time other jobs of a shared machine take is not counted)."""
    start = time.thread_time()
    for s, request_len, reply_len in requests:
        side.request(s, request_len, reply_len)
    return time.thread_time() - start


def measure(page: int, blocks: int, caches=CACHES) -> dict:
    """Fill every cache, then time the segments interleaved; returns the figures of the module
    docstring (per-segment seconds under ``seconds``)."""
    workload = Workload(page, blocks)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        orders = balanced_orders(caches)
        if len(workload.segments) % len(orders):
            raise ValueError(f"{len(workload.segments)} segments do not cycle through the {len(orders)} "
                             f"balanced orders of {len(caches)} caches")
        sides = {}
        for name in caches:
            side = sides[name] = make_side(name, workload, page, blocks)
            replay(side, workload.fill)
            side.hit_tokens = 0
        seconds = {name: [] for name in caches}
        scrub = Scrub()
        for i, segment in enumerate(workload.segments):
            scrub()
            for name in orders[i % len(orders)]:
                seconds[name].append(replay(sides[name], segment))
    finally:
        torch.set_num_threads(threads)
    return {"workload": workload, "sides": sides, "seconds": seconds}


@pytest.mark.parametrize("blocks", TREE_BLOCKS)
@pytest.mark.parametrize("page", PAGES)
def test_overhead_against_unified_radix_cache(benchmark, page, blocks):
    out = benchmark.pedantic(measure, args=(page, blocks), rounds=1, iterations=1)
    workload, sides, seconds = out["workload"], out["sides"], out["seconds"]
    requests = SEGMENT_REQUESTS
    hits = {name: side.hit_tokens for name, side in sides.items()}
    cached = {name: side.cached_tokens() for name, side in sides.items()}
    # Same operations, same LRU order: every cache hits and holds the same tokens.
    assert len(set(hits.values())) == 1, hits
    assert len(set(cached.values())) == 1, cached
    info = {
        "page_size": page,
        "tree_blocks": blocks,
        "capacity_tokens": blocks * page,
        "segments": SEGMENTS,
        "requests_per_segment": requests,
        "fill_requests_exact": len(workload.fill),
        "hit_tokens_exact": hits["unified_rust"],
        "cached_tokens_exact": cached["unified_rust"],
    }
    rust = seconds["unified_rust"]
    for name in CACHES:
        info[f"{name}_s_per_request"] = statistics.median(seconds[name]) / requests
        if name != "unified_rust":
            ratios = [r / t for r, t in zip(rust, seconds[name], strict=True)]
            # compare.py tracks Penelope's ratios; SGLang's own caches are shown, not tracked.
            ours = name in ("kvcache", "adapter")
            median, low, high = median_interval(ratios)
            info[f"ratio_{name}_vs_rust" if ours else f"{name}_vs_rust"] = median
            info[f"{name}_vs_rust_ci95"] = [low, high]
            info[f"{name}_vs_rust_range"] = [min(ratios), max(ratios)]
    benchmark.extra_info.update(info)
