"""The sglang-* ports (`penelope.cache.sglang_policies`) evict what SGLang 0.5.23's own
`UnifiedRadixCache` evicts, in the same order, on the same operations.

Random operation sequences (seeded) run through both caches side by side: sessions of growing
prompts over a few shared system prefixes, turns that rewrite the end of the previous prompt
(splits), forks of another session's prompt, requests in flight together (locked paths), chunked
prompts checkpointed chunk by chunk (SGLang's `checkpoint_into_tree`; Penelope's
`KVCache.checkpoint`), replies cached with their prompt and the prompt inserted again at finish
(SGLang's split of the reply off; `KVCache.release`) and held by the next turn, extra matches
without a lock (the scheduler's prefix sort), explicit evictions, and, for the session cache,
sessions registered at finish and closed after their last request. SGLang's cache runs on
its CPU pools (page sizes 1 and 16, its Python tree core and, for the four strategies, its Rust
core, SGLang's default). After every step the matched lengths and the evictable and protected
sizes agree, and every eviction frees the same tokens (each named by its whole prefix) in the
same order. SGLang's recency is a logical counter, so both run deterministically.
"""
from __future__ import annotations

import random
from array import array
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from penelope.cache.hints import FINISHED, Hint
from penelope.cache.manager import KVCache
from penelope.cache.sglang_policies import SGLangPolicy

# Penelope's policy name -> SGLang's --radix-eviction-policy, its config, and whether the session
# radix cache is on. T-LRU's settings are scaled to the test's short sequences per page size.
POLICIES = {
    "sglang-lru": ("lru", None, False),
    "sglang-lfu": ("lfu", None, False),
    "sglang-slru": ("slru", None, False),
    "sglang-slru:protected_threshold=3": ("slru", {"protected_threshold": 3}, False),
    "sglang-tlru": ("tlru", None, False),
    "sglang-session": ("lru", None, True),
    "sglang-session:close=0": ("lru", None, True),
}
TLRU = {1: {"threshold": 24, "next_prompt_estimate": 6}, 16: {"threshold": 96, "next_prompt_estimate": 32}}
# Sequence lengths and pool size in pages: small enough that the pool is under pressure.
CAPACITY_PAGES = {1: 160, 16: 48}


class RecordingAllocator:
    """Mixed into SGLang's allocator: the token indices freed while `recording`, in order
    (through `free` or `free_segment`, which the paged allocator implements on its own)."""

    recording = False
    _segment = False

    def free(self, free_index):
        if self.recording and not self._segment:
            self.freed.extend(free_index.tolist())
        return super().free(free_index)

    def free_segment(self, free_index, *, start_pos):
        if self.recording:
            self.freed.extend(free_index.tolist())
        self._segment = True
        try:
            return super().free_segment(free_index, start_pos=start_pos)
        finally:
            self._segment = False


class _TokenAllocator(RecordingAllocator, TokenToKVPoolAllocator):
    pass


class _PagedAllocator(RecordingAllocator, PagedTokenToKVPoolAllocator):
    pass


def sglang_cache(page: int, capacity: int, policy: str, config, session: bool, backend: str):
    kv = MHATokenToKVPool(size=capacity, page_size=page, dtype=torch.bfloat16, head_num=1, head_dim=1,
                          layer_num=1, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    if page == 1:
        allocator = _TokenAllocator(capacity, torch.bfloat16, "cpu", kv, False)
    else:
        allocator = _PagedAllocator(capacity, page, torch.bfloat16, "cpu", kv, False)
    allocator.freed = []
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator,
                             page_size=page, eviction_policy=policy, eviction_policy_config=config,
                             enable_session_radix_cache=session)
    params.tree_components = (ComponentType.FULL,)
    params.tree_core_backend = backend
    cache = UnifiedRadixCache(params)
    expected = {"rust": "RustUnifiedTreeCore", "python": "UnifiedTreeCore"}[backend]
    assert type(cache.tree_core).__name__ == expected, f"SGLang chose the tree core {type(cache.tree_core).__name__}"
    return cache, allocator


class Twins:
    """Penelope's KVCache under an sglang-* port and SGLang's UnifiedRadixCache, driven alike.
    Each side names the token in each of its slots by the whole prefix ending there."""

    def __init__(self, name: str, page: int, backend: str):
        policy, config, session = POLICIES[name]
        if policy == "tlru":
            config = TLRU[page]
            name = f"{name}:threshold={config['threshold']}:next_prompt_estimate={config['next_prompt_estimate']}"
        self.page, self.session = page, session
        self.closes = not name.endswith("close=0")
        capacity = CAPACITY_PAGES[page] * page
        self.pen = KVCache(capacity, block_size=page, policy=name)
        assert isinstance(self.pen.policy, SGLangPolicy)
        self.sgl, self.allocator = sglang_cache(page, capacity, policy, config, session, backend)
        self.generations: dict[str, int] = {}
        self.pen_names: dict[int, tuple] = {}
        self.sgl_names: dict[int, tuple] = {}
        self.evictions = 0
        # Checkpoints that inserted something, finishes that split a reply off the prompt.
        self.checkpoints = self.split_replies = 0

    def check_sizes(self):
        assert self.pen.evictable_size() == self.sgl.evictable_size()
        assert self.pen.protected_size() == self.sgl.protected_size()

    def match(self, tokens: tuple) -> tuple:
        m = self.pen.match(np.array(tokens, dtype=np.int64))
        r = self.sgl.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
        assert m.hit_tokens == r.device_prefix_len
        return m, r

    def evict(self, n: int) -> None:
        self.allocator.freed, self.allocator.recording = [], True
        try:
            self.sgl.evict(EvictParams(num_tokens=n))
        finally:
            self.allocator.recording = False
        got = self.pen.evict(n)
        penelope = [self.pen_names[slot] for slot in got.slots.tolist()]
        sglang = [self.sgl_names[index] for index in self.allocator.freed]
        assert penelope == sglang, f"eviction {self.evictions} of {n} tokens differs"
        self.evictions += bool(penelope)
        self.check_sizes()

    def start(self, tokens: tuple, reply: tuple = ()):
        """Match, lock, make room and allocate as a scheduler admits a request, with slots for
        its `reply` too; None when it does not fit now."""
        m, r = self.match(tokens)
        hit, page = m.hit_tokens, self.page
        sequence = tokens + reply
        need = -(-(len(sequence) - hit) // page) * page
        pen_lock, sgl_lock = self.pen.lock(m), self.sgl.lock(r.last_device_node)
        short = need - self.pen.free_size()
        if short > self.pen.evictable_size():
            self.pen.unlock(pen_lock, admitted=False)
            self.sgl.unlock(sgl_lock)
            return None
        if short > 0:
            self.evict(short)
        pen_new = self.pen.alloc(need)
        sgl_new = self.allocator.alloc(need)
        assert sgl_new is not None
        for i in range(len(sequence) - hit):
            self.pen_names[int(pen_new[i])] = sequence[:hit + i + 1]
            self.sgl_names[int(sgl_new[i])] = sequence[:hit + i + 1]
        prefix = m.spans[0].slots[:hit] if hit else np.empty(0, dtype=np.int64)
        sgl_prefix = self.sgl.path_device_indices(r.last_device_node)[:hit]
        self.check_sizes()
        # The request's rows (every slot it holds, its prefix's first) and, as SGLang's request
        # record keeps them, its protected and inserted lengths.
        return SimpleNamespace(tokens=tokens, reply=reply, pen_lock=pen_lock, sgl_lock=sgl_lock,
                               pen_row=np.concatenate([prefix, pen_new]), sgl_row=torch.cat([sgl_prefix, sgl_new]),
                               protected=hit, inserted=0)

    def checkpoint(self, request, up_to: int) -> None:
        """A chunk of the request's prompt ran: both caches insert its first `up_to` tokens' whole
        pages and move its lock there (SGLang: `UnifiedRadixCache.checkpoint_into_tree`)."""
        aligned = up_to // self.page * self.page
        if aligned <= request.protected:
            return
        key = request.tokens[:aligned]
        request.pen_lock, held = self.pen.checkpoint(request.pen_lock, np.array(key, dtype=np.int64),
                                                     request.pen_row[:aligned])
        request.pen_row[:aligned] = held
        result = self.sgl.insert(InsertParams(key=RadixKey(array("q", key)), value=request.sgl_row[:aligned].clone(),
                                              prev_prefix_len=request.protected, inserted_len=request.inserted))
        node = result.last_device_node
        request.sgl_row[request.protected:aligned] = self.sgl.path_device_indices(node)[request.protected:]
        self.sgl.unlock(request.sgl_lock)
        request.sgl_lock = self.sgl.lock(node)
        request.protected = request.inserted = aligned
        self.checkpoints += 1
        self.pen.check_invariants()
        self.check_sizes()

    def finish(self, request, session: str, last: bool) -> None:
        """The request finished: its prompt and all of its reply but the last token are cached,
        the prompt inserted again where a reply follows it, the rest of its slots freed."""
        tokens, page = request.tokens, self.page
        sequence = tokens + request.reply[:-1]
        self.pen.release(request.pen_lock, np.array(sequence, dtype=np.int64), request.pen_row, len(tokens))
        aligned = len(sequence) // page * page
        values = request.sgl_row[:aligned].clone()
        result = self.sgl.insert(InsertParams(key=RadixKey(array("q", sequence[:aligned])), value=values,
                                              prev_prefix_len=request.protected, inserted_len=request.inserted))
        prompt = len(tokens) // page * page
        if 0 < prompt < aligned:
            self.sgl.insert(InsertParams(key=RadixKey(array("q", tokens[:prompt])), value=values[:prompt],
                                         prev_prefix_len=prompt, inserted_len=prompt, priority=1))
            self.split_replies += 1
        self.allocator.free(request.sgl_row[aligned:])
        self.sgl.unlock(request.sgl_lock)
        if self.session:
            closes = last and self.closes
            self.pen.hint(np.array(sequence, dtype=np.int64), Hint(0.0, FINISHED, session=session, closes=last))
            req = SimpleNamespace(session=None, session_id=session, session_generation=self.generations[session])
            self.sgl.session_refs.register_session_ref(req, leaf=result.last_device_node)
            if closes:
                self.sgl.release_radix_session(session)
        self.pen.check_invariants()
        self.check_sizes()


def replay_random(twins: Twins, seed: int, steps: int, chunked: bool = False) -> None:
    """`steps` random operations through both caches (see the module docstring); `chunked`:
    requests with replies, and prompts checkpointed chunk by chunk while they run."""
    rng = random.Random(seed)
    page = twins.page
    unit = max(page // 2, 1)
    next_token = [1000]

    def fresh(n: int) -> tuple:
        start = next_token[0]
        next_token[0] += n
        return tuple(range(start, start + n))

    system = [fresh(rng.randint(2, 5) * unit * 2) for _ in range(3)]
    limit = CAPACITY_PAGES[page] * page // 4
    prompts: dict[str, tuple] = {}
    in_flight: dict[str, tuple] = {}
    numbered = [0]

    def new_session() -> None:
        name = f"s{numbered[0]}"
        numbered[0] += 1
        if prompts and rng.random() < 0.2:
            # A sub-agent: starts from part of another session's prompt.
            other = prompts[rng.choice(sorted(prompts))]
            base = other[:rng.randint(1, len(other))]
        else:
            base = rng.choice(system)
        prompts[name] = base + fresh(rng.randint(1, 6) * unit)
        twins.generations[name] = twins.sgl.ensure_session_generation(name)

    for _ in range(4):
        new_session()
    for _ in range(steps):
        roll = rng.random()
        idle = sorted(set(prompts) - set(in_flight))
        if roll < 0.4 and idle:
            name = rng.choice(idle)
            reply = fresh(rng.randint(1, 3) * unit) if chunked and rng.random() < 0.7 else ()
            request = twins.start(prompts[name], reply)
            if request is not None:
                in_flight[name] = request
        elif chunked and roll < 0.55 and in_flight:
            # A chunk of a running prompt ran: up to a point past what it has inserted.
            request = in_flight[rng.choice(sorted(in_flight))]
            if request.protected < len(request.tokens) - 1:
                twins.checkpoint(request, rng.randint(request.protected + 1, len(request.tokens) - 1))
        elif roll < 0.75 and in_flight:
            name = rng.choice(sorted(in_flight))
            request = in_flight.pop(name)
            tokens = request.tokens + request.reply
            last = len(tokens) > limit or rng.random() < 0.1
            twins.finish(request, name, last)
            if last:
                del prompts[name]
                new_session()
            elif rng.random() < 0.15:
                # A rewritten turn: the next prompt drops the end of this one.
                prompts[name] = tokens[:rng.randint(1, len(tokens))] + fresh(rng.randint(1, 4) * unit)
            else:
                prompts[name] = tokens + fresh(rng.randint(1, 5) * unit)
        elif roll < 0.9 and prompts:
            twins.match(prompts[rng.choice(sorted(prompts))])
        elif twins.pen.evictable_size():
            twins.evict(rng.randint(1, max(1, twins.pen.evictable_size() // 2)) // page * page + page)
        if len(prompts) < 6 and rng.random() < 0.05:
            new_session()


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("name", list(POLICIES))
def test_ports_evict_what_sglang_evicts_on_its_python_core(name, page):
    for seed in range(3):
        twins = Twins(name, page, "python")
        replay_random(twins, seed, 400)
        assert twins.evictions >= 20, "the pool was not under pressure"


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("name", [name for name, (_, _, session) in POLICIES.items() if not session])
def test_ports_evict_what_sglang_evicts_on_its_rust_core(name, page):
    twins = Twins(name, page, "rust")
    replay_random(twins, 7, 400)
    assert twins.evictions >= 20, "the pool was not under pressure"


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("name", list(POLICIES))
def test_ports_evict_what_sglang_evicts_with_chunked_prompts_and_replies(name, page):
    for seed in range(3):
        twins = Twins(name, page, "python")
        replay_random(twins, seed, 400, chunked=True)
        assert twins.evictions >= 20, "the pool was not under pressure"
        assert twins.checkpoints >= 20 and twins.split_replies >= 20, "too few chunks or replies"


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("name", [name for name, (_, _, session) in POLICIES.items() if not session])
def test_ports_evict_what_sglang_evicts_with_chunked_prompts_on_its_rust_core(name, page):
    twins = Twins(name, page, "rust")
    replay_random(twins, 7, 400, chunked=True)
    assert twins.evictions >= 20, "the pool was not under pressure"
