"""Phantom batch plans (`penelope.cache.phantom`): from a cache match to one prefill, and proof that the
real request reads the hole K/V its phantom writes in the same layer.

Cache scenes use 4-token blocks: a shared prefix S (8 tokens) and two private histories A and B
(24 tokens each); after both are cached, evicting 8 tokens under Penelope removes the front of
A's private history (A is the least recently used), leaving the hole [8, 16) before resident KV.
"""
import os

# The "triton" backend runs the kernel under the interpreter on CPU; it must be chosen before
# the kernel package is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import copy  # noqa: E402
import dataclasses  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from penelope.cache.manager import KVCache  # noqa: E402
from penelope.cache.phantom import (  # noqa: E402
    PlanSegment,
    build_batch,
    finish_request,
    plan_request,
    release_request,
)
from penelope.cache.swap_executor import SwapExecutor  # noqa: E402
from penelope.cache.tiers import TwoTierCache  # noqa: E402
from penelope.cache.tree import BlockState  # noqa: E402
from penelope.engine.attention import AttentionBackend, get_attention_backend  # noqa: E402
from penelope.engine.decoder import EngineBatch, Qwen3Decoder  # noqa: E402
from penelope.engine.decoder_config import BUILTIN_ENGINE_CONFIGS  # noqa: E402
from penelope.engine.kvpool import KVPool  # noqa: E402
from penelope.engine.weights import random_weights  # noqa: E402
from penelope.errors import CacheFullError, UsageError  # noqa: E402

SHARED = list(range(1000, 1008))
A = SHARED + list(range(2000, 2024))
B = SHARED + list(range(3000, 3024))
NEW = [4000, 4001, 4002, 4003, 4004, 4005]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def cache_with_hole(capacity=64):
    """Cache holding S+A (A's private front [8, 16) evicted) and S+B."""
    cache = KVCache(capacity, block_size=4, policy="penelope")
    for tokens in (A, B):
        finish_request(cache, plan_request(cache, tokens))
    freed = cache.evict(8)
    assert freed.ranges == [(8, 16)]
    cache.check_invariants()
    return cache


def sizes(cache):
    return cache.free_size(), cache.evictable_size(), cache.protected_size()


def test_plan_on_an_empty_cache_computes_everything():
    cache = KVCache(64, block_size=4)
    plan = plan_request(cache, A + NEW)
    assert plan.holes == [] and plan.compute_from == 0 and plan.phantom_tokens == 0
    assert plan.segments == [PlanSegment(0, 38, phantom=False)]
    assert np.array_equal(plan.slots, plan.owned) and len(np.unique(plan.slots)) == 38
    result = finish_request(cache, plan)
    assert (result.new, result.freed) == (36, 2)
    cache.check_invariants()
    assert sizes(cache) == (28, 36, 0)


def test_plan_reuses_resident_kv_and_computes_the_rest():
    cache = KVCache(64, block_size=4)
    finish_request(cache, plan_request(cache, A))
    cached = cache.match(A).spans[0].slots
    plan = plan_request(cache, A + NEW)
    assert plan.holes == [] and plan.compute_from == 32 and plan.hit_tokens == 32
    assert np.array_equal(plan.slots[:32], cached)
    assert np.array_equal(plan.slots[32:], plan.owned) and len(plan.owned) == 6
    assert plan.segments == [PlanSegment(32, 38, phantom=False)]
    assert cache.protected_size() == 32
    finish_request(cache, plan)
    cache.check_invariants()
    assert cache.protected_size() == 0


def test_plan_has_one_phantom_per_hole_at_original_positions():
    cache = cache_with_hole()
    match = cache.match(A + NEW)
    assert match.holes == [(8, 16)] and match.compute_from == 32
    plan = plan_request(cache, A + NEW)
    assert plan.holes == [(8, 16)] and plan.phantom_tokens == 8 and plan.compute_from == 32
    assert plan.segments == [PlanSegment(8, 16, phantom=True), PlanSegment(32, 38, phantom=False)]
    # Resident positions keep the cache's slots; the hole and the new tokens get the plan's own.
    resident = {(span.start, span.end): span.slots for span in match.spans if span.state == BlockState.GPU}
    for (start, end), slots in resident.items():
        assert np.array_equal(plan.slots[start:end], slots)
    assert np.array_equal(plan.slots[8:16], plan.owned[:8])
    assert np.array_equal(plan.slots[32:], plan.owned[8:])
    assert len(np.unique(plan.slots)) == 38 and plan.slots.min() >= 0

    result = finish_request(cache, plan)
    assert (result.refilled, result.new) == (8, 4)
    cache.check_invariants()
    after = cache.match(A + NEW)
    assert after.holes == [] and after.compute_from == 36
    assert np.array_equal(after.spans[0].slots, plan.slots[:36])


def test_allocation_evicts_other_histories_but_never_the_locked_path():
    cache = cache_with_hole(capacity=64)
    # 56 tokens cached, 8 free: the plan needs 8 (hole) + 30 new, so B's KV must go, A's must stay.
    longer = A + list(range(5000, 5030))
    a_slots = [span.slots for span in cache.match(A).spans if span.state == BlockState.GPU]
    plan = plan_request(cache, longer)
    cache.check_invariants()
    for slots in a_slots:
        assert not np.intersect1d(slots, plan.owned).size
    assert cache.match(A).holes == [(8, 16)]  # A's resident KV survived the eviction
    assert cache.match(B).hit_tokens < 32
    finish_request(cache, plan)
    cache.check_invariants()


def test_cache_full_unlocks_and_changes_nothing():
    cache = cache_with_hole(capacity=64)
    running = plan_request(cache, B + [1, 2])  # locks S + B while it runs
    before = sizes(cache)
    assert before == (14, 16, 32)
    # A + 30 new tokens needs 38 slots; only 14 are free and A's own 16 are locked by the plan.
    with pytest.raises(CacheFullError):
        plan_request(cache, A + list(range(5000, 5030)))
    cache.check_invariants()
    assert sizes(cache) == before
    finish_request(cache, running)
    cache.check_invariants()
    assert cache.protected_size() == 0


def test_a_fully_cached_prompt_still_computes_its_last_token():
    cache = KVCache(64, block_size=4)
    finish_request(cache, plan_request(cache, A))
    cached = cache.match(A).spans[0].slots
    plan = plan_request(cache, A)
    assert plan.compute_from == 31 and plan.segments == [PlanSegment(31, 32, phantom=False)]
    assert np.array_equal(plan.slots[:31], cached[:31]) and plan.slots[31] != cached[31]
    result = finish_request(cache, plan)
    assert result.freed == 1 and result.already_cached == 32
    cache.check_invariants()
    assert sizes(cache) == (32, 32, 0)


def test_append_allocates_the_next_positions_for_decoding():
    cache = cache_with_hole()
    plan = plan_request(cache, A + NEW)
    slots = plan.append(cache, [7])
    assert len(slots) == 1 and plan.slots[-1] == slots[0] and plan.owned[-1] == slots[0]
    assert plan.segments == [PlanSegment(38, 39, phantom=False)]
    layout = build_batch([plan])
    assert layout.tokens.tolist() == [7] and layout.segments.tolist() == [[0, 0, 38, 1]]
    assert layout.req_to_token[0].tolist() == plan.slots.tolist()
    with pytest.raises(UsageError):
        plan.append(cache, [])
    finish_request(cache, plan)
    cache.check_invariants()
    assert cache.match(A + NEW + [7]).hit_tokens == 36


def test_release_returns_slots_and_lock():
    cache = cache_with_hole()
    before = sizes(cache)
    plan = plan_request(cache, A + NEW)
    plan.append(cache, [1, 2])
    release_request(cache, plan)
    cache.check_invariants()
    assert sizes(cache) == before
    assert cache.match(A).holes == [(8, 16)]


def test_a_refused_insert_frees_the_plan_and_unlocks():
    cache = cache_with_hole()
    before = sizes(cache)
    plan = plan_request(cache, A + NEW)
    plan.slots[0] = -1  # e.g. a CPU span whose GPU slots were never filled in
    with pytest.raises(UsageError):
        finish_request(cache, plan)
    cache.check_invariants()
    assert sizes(cache) == before


def test_build_batch_lays_out_phantoms_then_real_rows_of_several_requests():
    cache = cache_with_hole(capacity=128)
    first = plan_request(cache, A + NEW)
    second = plan_request(cache, B + [9, 8, 7])
    layout = build_batch([first, second])
    assert layout.segments.tolist() == [[0, 0, 8, 8], [0, 8, 32, 6], [1, 14, 32, 3]]
    assert layout.tokens.tolist() == A[8:16] + NEW + [9, 8, 7]
    assert layout.phantom.tolist() == [True] * 8 + [False] * 9
    assert layout.positions.tolist() == list(range(8, 16)) + list(range(32, 38)) + [32, 33, 34]
    assert layout.output_rows.tolist() == [13, 16]
    assert layout.req_to_token.dtype == np.int32 and layout.req_to_token.shape == (2, 38)
    assert layout.req_to_token[1, 35:].tolist() == [-1, -1, -1]
    assert layout.phantom_tokens == 8
    batch = EngineBatch.build(torch.from_numpy(layout.tokens), torch.from_numpy(layout.req_to_token),
                              torch.from_numpy(layout.segments))
    assert batch.slots.tolist() == first.slots[8:16].tolist() + first.slots[32:].tolist() + second.slots[32:].tolist()
    for plan in (first, second):
        finish_request(cache, plan)
    cache.check_invariants()


def test_build_batch_rejects_unfilled_slots_and_empty_input():
    cache = cache_with_hole()
    plan = plan_request(cache, A + NEW)
    with pytest.raises(UsageError, match="at least one"):
        build_batch([])
    with pytest.raises(UsageError, match="real segment"):
        build_batch([dataclasses.replace(plan, segments=[PlanSegment(8, 16, phantom=True)])])
    unfilled = plan.slots.copy()
    unfilled[20] = -1
    with pytest.raises(UsageError, match="position 20 has no KV slot"):
        build_batch([dataclasses.replace(plan, slots=unfilled)])
    release_request(cache, plan)


# --- The real request reads the hole K/V its phantom writes, in the same layer ---------------------

TINY = BUILTIN_ENGINE_CONFIGS["tiny"]
BLOCK = 16


def engine_scene(attention):
    """A tiny model whose cache holds a shared prefix and two histories; the first lost the front
    [32, 64) of its private part. Returns the model, cache, pool and the next prompt of history 1."""
    rng = np.random.default_rng(7)
    shared = rng.integers(0, TINY.vocab_size, 32).tolist()
    first = shared + rng.integers(0, TINY.vocab_size, 96).tolist()
    second = shared + rng.integers(0, TINY.vocab_size, 96).tolist()
    model = Qwen3Decoder(TINY, random_weights(TINY, seed=3), attention=attention, deterministic=True)
    cache = KVCache(512, block_size=BLOCK, policy="penelope")
    pool = KVPool(TINY, 512)
    for tokens in (first, second):
        plan = plan_request(cache, tokens)
        model(to_batch(build_batch([plan])), pool)
        finish_request(cache, plan)
    assert cache.evict(32).ranges == [(32, 64)]
    prompt = first + rng.integers(0, TINY.vocab_size, 10).tolist()
    return model, cache, pool, prompt


def to_batch(layout):
    return EngineBatch.build(torch.from_numpy(layout.tokens), torch.from_numpy(layout.req_to_token),
                             torch.from_numpy(layout.segments))


def full_prefill(model, tokens):
    """Logits `[n, V]` of `tokens` prefilled from position 0 into a fresh pool."""
    pool = KVPool(model.config, len(tokens))
    return model(EngineBatch.single_segment(tokens, torch.arange(len(tokens))), pool)


@pytest.mark.parametrize("attention", ["naive", "triton"])
def test_real_request_reads_the_hole_kv_written_in_the_same_layer(attention):
    model, cache, pool, prompt = engine_scene(attention)
    expected = full_prefill(model, prompt)
    plan = plan_request(cache, prompt)
    assert plan.holes == [(32, 64)] and plan.compute_from == 128
    layout = build_batch([plan])
    hole_slots = torch.from_numpy(plan.slots[32:64])
    real_rows = torch.from_numpy(np.flatnonzero(~layout.phantom))
    real = slice(128, len(prompt))

    # Garbage in the hole's slots before the batch is harmless: the phantom overwrites it in every
    # layer before the real request attends. Phantom and real rows reproduce a full prefill.
    pool.fill_(1e4, hole_slots)
    logits = model(to_batch(layout), pool)
    assert torch.equal(logits[real_rows], expected[real])
    assert torch.equal(logits[torch.from_numpy(np.flatnonzero(layout.phantom))], expected[32:64])

    # Without the phantom the real request reads whatever the hole's slots hold.
    pool.fill_(0.0, hole_slots)
    skipped = dataclasses.replace(plan, segments=[s for s in plan.segments if not s.phantom])
    without = model(to_batch(build_batch([skipped])), pool)
    assert (without - expected[real]).abs().max() > 1e-3

    # Corrupting the hole's V between the store and the attention of the LAST layer changes the
    # real request's output: it read what the phantom stored in that same layer.
    named = get_attention_backend(attention)
    layers = []

    def corrupting_store(k_buffer, v_buffer, slots, k, v):
        named.store_kv(k_buffer, v_buffer, slots, k, v)
        layers.append(1)
        if len(layers) == TINY.num_layers:
            v_buffer[hole_slots] += 1.0

    backend = AttentionBackend("corrupt", corrupting_store, named.attend)
    corrupting = Qwen3Decoder(TINY, model.weights, attention=backend, deterministic=True)
    corrupted = corrupting(to_batch(layout), pool)
    assert len(layers) == TINY.num_layers
    assert torch.isfinite(corrupted).all()
    assert (corrupted[real_rows] - expected[real]).abs().max() > 1e-4
    finish_request(cache, plan)
    cache.check_invariants()


# --- Two tiers: CPU spans are loaded, and the real request reads the loaded K/V ----------------------


def two_tier_scene(copy_fn):
    """A tiny model over a two-tier cache (192-token GPU tier, 32-token CPU tier, one-block swap
    buffer) whose tier plans run on real pools. History 1 ends up as GPU [0, 32), a hole [32, 48),
    CPU [48, 80), GPU [80, 128), with both tiers full but one free GPU block. Returns the model,
    cache, GPU pool, executor and the next prompt of history 1."""
    rng = np.random.default_rng(7)
    shared = rng.integers(0, TINY.vocab_size, 32).tolist()
    first = shared + rng.integers(0, TINY.vocab_size, 96).tolist()
    second = shared + rng.integers(0, TINY.vocab_size, 96).tolist()
    model = Qwen3Decoder(TINY, random_weights(TINY, seed=3), attention="naive", deterministic=True)
    cache = TwoTierCache(192, 32, block_size=BLOCK, policy="penelope", swap_buffer=BLOCK)
    pool = KVPool(TINY, 192)
    executor = SwapExecutor(pool.buffers(), pool.host_mirror(cache.host_rows).buffers(), copy_fn)
    for tokens in (first, second):
        plan = plan_request(cache, tokens)
        executor.run_all(cache.take_plans())
        model(to_batch(build_batch([plan])), pool)
        finish_request(cache, plan)
    # Second's insert demoted first's [32, 48) and [48, 64); with the host full, making one GPU
    # block free deletes first's [32, 48) and demotes [64, 80) into its host rows.
    assert cache.evict(BLOCK).ranges == [(32, 48)]
    executor.run_all(cache.take_plans())
    prompt = first + rng.integers(0, TINY.vocab_size, 10).tolist()
    return model, cache, pool, executor, prompt


@pytest.mark.parametrize("copy_fn", ["naive", "triton"])
def test_loaded_spans_are_in_place_before_the_real_request_reads_them(copy_fn):
    model, cache, pool, executor, prompt = two_tier_scene(copy_fn)
    expected = full_prefill(model, prompt)
    states = [(s.start, s.end, s.state) for s in cache.match(prompt).spans]
    assert states == [(0, 32, BlockState.GPU), (32, 48, BlockState.MISSING), (48, 80, BlockState.CPU),
                      (80, 128, BlockState.GPU)]
    assert (cache.free_size(), cache.cpu_free_size()) == (16, 0)

    plan = plan_request(cache, prompt)
    assert plan.holes == [(32, 48)] and plan.compute_from == 128
    assert [(s.start, s.end, s.state) for s in plan.loaded] == [(48, 80, BlockState.GPU)]
    # One block into the free GPU block, one exchanged through the swap buffer.
    assert (plan.loaded_tokens, plan.swapped_tokens) == (32, 16)
    assert np.array_equal(plan.slots[48:80], plan.loaded[0].slots)
    assert len(np.unique(plan.slots)) == len(prompt) and plan.slots.min() >= 0
    plans = cache.take_plans()
    # The load (16 tokens out through the exchange), then the allocation's demotions.
    assert [(p.to_gpu_tokens, p.swapped_tokens) for p in plans] == [(32, 16), (0, 0)]
    assert plans[0].to_host_tokens == 16 and plans[1].to_host_tokens > 0
    layout = build_batch([plan])
    real_rows = torch.from_numpy(np.flatnonzero(~layout.phantom))
    phantom_rows = torch.from_numpy(np.flatnonzero(layout.phantom))

    # Without the copies the loaded positions' GPU rows hold another block's K/V.
    stale = copy.deepcopy(pool)
    without = model(to_batch(layout), stale)
    assert (without[real_rows] - expected[128:]).abs().max() > 1e-3

    executor.run_all(plans)
    loaded = torch.from_numpy(plan.slots[48:80])
    kept = [buf[loaded].clone() for buf in pool.buffers()]
    logits = model(to_batch(layout), pool)
    assert torch.equal(logits[real_rows], expected[128:])
    assert torch.equal(logits[phantom_rows], expected[32:48])

    # The real request reads the loaded rows: changing them changes its output.
    for buf, rows in zip(pool.buffers(), kept, strict=True):
        buf[loaded] = rows + 1.0
    assert (model(to_batch(layout), pool)[real_rows] - expected[128:]).abs().max() > 1e-4
    finish_request(cache, plan)
    assert cache.take_plans() == []
    cache.check_invariants()
