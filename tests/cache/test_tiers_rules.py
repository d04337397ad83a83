"""Unit tests of the unified two-tier cache's rules, on small hand-built states (block size 4).

Every request goes through `FingerprintRig.serve`, so each test also runs its plans on real pools
and checks every resident block's KV and the invariants after every step.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
from cache_helpers import serve, shape
from tier_helpers import FingerprintRig, fingerprints

from penelope.cache.host_tier import TierPlan
from penelope.cache.manager import KVCache
from penelope.cache.tiers import TwoTierCache
from penelope.errors import CacheFullError, UsageError

BS = 4


def tokens(seed: int, n: int, prefix=()) -> list[int]:
    rng = random.Random(seed)
    return list(prefix) + [rng.randrange(1000) for _ in range(n)]


def rig(gpu: int, cpu: int, policy: str = "penelope", buffer: int = 8) -> FingerprintRig:
    cache = TwoTierCache(gpu, cpu, block_size=BS, policy=policy, swap_buffer=buffer)
    return FingerprintRig(cache, cache.host_rows)


def lock_and_load(r: FingerprintRig, toks):
    cache = r.cache
    handle = cache.lock(cache.match(np.asarray(toks, dtype=np.int64)))
    loaded = cache.load(handle)
    plans = cache.take_plans()
    for plan in plans:
        r.executor.run(plan)
    return handle, loaded, plans


@pytest.mark.parametrize("policy, a_states", [("penelope", "CGGG"), ("leaf-tail-block", "GGGC")])
def test_gpu_short_demotes_in_the_policy_order(policy, a_states):
    """Penelope demotes the front of the least recently used private history, the tail policy its
    end; the shared system prompt stays on the GPU; nothing is deleted."""
    r = rig(28, 16, policy)
    system = tokens(0, 4)
    a, b, d = tokens(1, 16, system), tokens(2, 4, system), tokens(3, 8, system)
    r.serve(a)
    r.serve(b)
    r.serve(d)
    assert shape(r.cache) == [(0, 4, "G"), (4, 8, "G"), (4, 12, "GG"), (4, 20, a_states)]
    assert r.cache.counters.demoted_tokens == 4 and r.cache.stats.evicted_tokens == 0


def test_deletion_only_when_both_tiers_are_full_and_in_the_policy_order():
    """The GPU needs 4 blocks, the host has room for 3: Penelope deletes one block, the CPU block
    at the front of the LRU history (the first in its order), then demotes 4 GPU blocks."""
    r = rig(28, 16)
    system = tokens(0, 4)
    for seed, n in ((1, 16), (2, 4), (3, 8)):
        r.serve(tokens(seed, n, system))
    before = shape(r.cache)
    r.serve(tokens(4, 16, system))
    counters = r.cache.counters
    assert (counters.deleted_cpu_tokens, counters.deleted_gpu_tokens) == (4, 0)
    assert before[-1] == (4, 20, "CGGG")
    assert shape(r.cache) == [(0, 4, "G"), (4, 8, "C"), (4, 8, "M"), (4, 12, "GG"), (4, 20, "GGGG"),
                              (8, 20, "CCC")]
    assert r.cache.cpu_free_size() == 0 and r.cache.free_size() == 0


def test_load_into_free_gpu_slots_moves_nothing_else():
    r = rig(20, 16)
    a = tokens(1, 12)
    r.serve(a)
    r.serve(tokens(2, 8), output_tokens=4)
    assert shape(r.cache)[1] == (0, 12, "CGG") and r.cache.free_size() == 4
    handle, loaded, plans = lock_and_load(r, a)
    assert [p.to_gpu_tokens for p in plans] == [4] and plans[0].to_host_tokens == 0
    assert loaded.loaded_tokens == 4 and loaded.swapped_tokens == 0
    assert [(s.start, s.end, s.state.name) for s in loaded.spans] == [(0, 4, "GPU")]
    assert [(s.start, s.end, s.state.name) for s in r.cache.match(np.asarray(a)).spans] == [(0, 12, "GPU")]
    r.cache.unlock(handle)
    r.cache.check_invariants()
    r.verify_all()


def test_load_with_host_room_uses_plain_copies_not_the_buffer():
    r = rig(16, 16)
    a = tokens(1, 12)
    r.serve(a)
    r.serve(tokens(2, 12))
    assert sorted(shape(r.cache)) == [(0, 12, "CCG"), (0, 12, "GGG")]
    buffer = r.cache.buffer_slots()
    handle, loaded, (plan,) = lock_and_load(r, a)
    assert (plan.to_host_tokens, plan.to_gpu_tokens, plan.swapped_tokens) == (8, 8, 0)
    assert loaded.swapped_tokens == 0 and np.array_equal(r.cache.buffer_slots(), buffer)
    # The loads land in the GPU slots the demotions emptied, so they wait for them.
    steps = plan.steps()
    assert [s.kind for s in steps] == ["d2h", "h2d"] and steps[1].after == 0
    assert sorted(shape(r.cache)) == [(0, 12, "CCG"), (0, 12, "GGG")]
    r.cache.unlock(handle)
    r.verify_all()


@pytest.mark.parametrize("buffer, chunks", [(8, 1), (4, 2), (5, 2)])
def test_both_tiers_full_load_goes_through_the_moving_swap_buffer(buffer, chunks):
    """GPU and host full: the demoted blocks land in the buffer's rows, the rows the loaded
    blocks were read from become the buffer (host slots are indirected)."""
    r = rig(16, 8, buffer=buffer)
    a, b = tokens(1, 12), tokens(2, 12)
    r.serve(a)
    r.serve(b)
    assert r.cache.free_size() == 0 and r.cache.cpu_free_size() == 0
    old_buffer = r.cache.buffer_slots()
    a_host = r.cache.match(np.asarray(a)).loads[0].slots
    handle, loaded, (plan,) = lock_and_load(r, a)
    assert loaded.swapped_tokens == 8 and plan.to_host_tokens == 8 and len(plan.to_host_gpu) == 0
    rows = np.concatenate([old_buffer, a_host])
    assert np.array_equal(plan.exchange_out_host, rows[:8])
    assert np.array_equal(r.cache.buffer_slots(), rows[8:])
    b_spans = r.cache.match(np.asarray(b)).spans
    assert [s.state.name for s in b_spans] == ["CPU", "GPU"]
    assert np.array_equal(b_spans[0].slots, rows[:8])
    steps = plan.steps()
    assert [s.kind for s in steps] == ["d2h", "h2d"] * chunks
    for i, step in enumerate(steps):
        # Each incoming chunk waits for the outgoing chunk whose GPU slots it overwrites.
        if step.kind == "h2d":
            assert step.after == i - 1 and np.array_equal(step.dst_slots, steps[i - 1].src_slots)
    assert r.cache.counters.swap_loads == 1
    r.cache.unlock(handle)
    r.cache.check_invariants()
    r.verify_all()


def test_evict_demotes_and_deletes_only_when_the_host_is_full():
    r = rig(16, 8)
    r.serve(tokens(1, 12))
    result = r.cache.evict(5)
    r.run_plans()
    assert result.freed_tokens == 8 and len(result.slots) == 0
    assert shape(r.cache) == [(0, 12, "CCG")]
    result = r.cache.evict(100)
    r.run_plans()
    assert result.freed_tokens == 4 and len(result.slots) == 0
    assert r.cache.counters.deleted_cpu_tokens == 4
    assert r.cache.evict(0).freed_tokens == 0
    r.cache.check_invariants()
    r.verify_all()


def test_cache_full_changes_nothing():
    """alloc and load raise CacheFullError without changing anything when running requests lock
    the GPU."""
    r = rig(16, 8)
    a, b = tokens(1, 12), tokens(2, 8)
    r.serve(a)
    r.serve(b)
    cache = r.cache

    def state():
        return (shape(cache), cache.free_size(), cache.cpu_free_size(), cache.tree.epoch,
                dict(vars(cache.counters)), cache.buffer_slots().tolist())

    running = cache.lock(cache.match(np.asarray(b)))
    waiting = cache.lock(cache.match(np.asarray(a)))
    before = state()
    assert before[0] == [(0, 8, "GG"), (0, 12, "CGG")]
    with pytest.raises(CacheFullError):
        cache.alloc(4)
    with pytest.raises(CacheFullError):
        cache.load(waiting)
    assert state() == before
    cache.unlock(running)
    loaded = cache.load(waiting)
    assert loaded.loaded_tokens == 4
    cache.unlock(waiting)
    r.run_plans()
    cache.check_invariants()
    r.verify_all()


def test_load_needs_an_active_handle_of_this_cache():
    r = rig(16, 8)
    a = tokens(1, 12)
    r.serve(a)
    cache = r.cache
    handle = cache.lock(cache.match(np.asarray(a)))
    cache.unlock(handle)
    with pytest.raises(UsageError, match="needs a locked path"):
        cache.load(handle)
    other = TwoTierCache(16, 8, block_size=BS)
    with pytest.raises(UsageError, match="handle returned by this cache"):
        other.load(handle)
    with pytest.raises(UsageError, match="cannot allocate"):
        cache.alloc(17)


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(gpu_capacity=256, cpu_capacity=256, swap_buffer=32), "swap buffer of 32 tokens is smaller"),
        (dict(gpu_capacity=256, cpu_capacity=0), "needs a CPU tier of at least one block"),
        (dict(gpu_capacity=256, cpu_capacity=63), "needs a CPU tier of at least one block"),
        (dict(gpu_capacity=0, cpu_capacity=256), "below one block"),
        (dict(gpu_capacity=256, cpu_capacity=-64), "cpu_capacity must be a non-negative integer"),
        (dict(gpu_capacity=256, cpu_capacity=256, policy="lru"), "unknown eviction policy"),
    ],
)
def test_bad_configuration_is_a_clear_error(args, message):
    with pytest.raises(UsageError, match=message):
        TwoTierCache(**args)


def test_plan_steps_reject_a_planner_disagreement():
    plan = TierPlan(exchange_out_gpu=np.arange(4), exchange_in_host=np.arange(4), exchange_buffer=np.arange(4, 8),
                    exchange_out_host=np.arange(4), buffer_after=np.arange(4), chunk=4)
    from penelope.errors import InvariantError

    with pytest.raises(InvariantError, match="exchange planner"):
        plan.steps()


def test_gpu_tier_holds_what_the_gpu_only_cache_holds():
    """With a CPU tier that never fills, the GPU tier of the unified cache holds exactly the blocks
    the GPU-only cache with the same policy holds, step after step: demotion follows the policy's
    order (block policies; the node policies delete whole nodes but demote only what is needed)."""
    moved = 0
    for policy in ("penelope", "leaf-tail-block"):
        for seed in range(12):
            rng = random.Random(seed)
            gpu = BS * rng.randrange(6, 20)
            gpu_only = KVCache(gpu, BS, policy)
            two = rig(gpu, 10_000, policy)
            system = tokens(seed, rng.randrange(0, 12))
            sessions = [tokens(seed * 10 + i, 3, system) for i in range(rng.randrange(1, 4))]
            for _ in range(30):
                i = rng.randrange(len(sessions))
                serve(gpu_only, sessions[i])
                two.serve(sessions[i])
                assert _gpu_blocks(gpu_only) == _gpu_blocks(two.cache), (policy, seed)
                sessions[i] = (sessions[i] + tokens(rng.randrange(10**6), rng.randrange(1, 9)))[: gpu - 4]
            moved += two.cache.counters.demoted_tokens + two.cache.counters.loaded_tokens
    assert moved > 1000


def _gpu_blocks(cache) -> set:
    """Every GPU block as the bytes of the whole token prefix it ends."""
    out = set()
    for node in cache.tree.nodes():
        prefix = b"".join(n.key for n in cache.tree.path_to_root(node)[:-1])
        for i in np.flatnonzero(node.state == 0):
            out.add(prefix + node.key[: (i + 1) * BS * 8])
    return out


def test_a_request_that_computes_cpu_blocks_again_replaces_their_host_copy():
    """A request that matched nothing (SGLang asks for log-probabilities from the first token)
    computes and inserts KV the CPU tier holds: its GPU copy is taken and the host rows are freed.
    (Keeping the host copy instead left the request's row on slots the tree had freed.)"""
    r = rig(28, 16)
    system = tokens(0, 4)
    a, b, d = tokens(1, 16, system), tokens(2, 4, system), tokens(3, 8, system)
    for request in (a, b, d):
        r.serve(request)
    cache = r.cache
    prompt = np.asarray(a[:12], dtype=np.int64)
    fresh = cache.alloc(len(prompt))
    r.run_plans()
    on_cpu = [s for s in cache.match(prompt).spans if s.state.name == "CPU"]
    assert on_cpu, "the test needs CPU blocks on the path"
    cpu_tokens = sum(len(s) for s in on_cpu)
    host_free = cache.cpu_free_size()
    r.write(fresh, fingerprints(prompt), np.arange(len(prompt)))
    result = cache.insert(prompt, fresh)
    assert result.refilled == cpu_tokens and result.freed == len(prompt) - cpu_tokens
    after = cache.match(prompt).spans
    assert [s.state.name for s in after] == ["GPU"] and np.array_equal(
        np.concatenate([after[0].slots[s.start:s.end] for s in on_cpu]),
        np.concatenate([fresh[s.start:s.end] for s in on_cpu]))
    assert cache.cpu_free_size() == host_free + cpu_tokens
    assert cache.counters.replaced_host_tokens == cpu_tokens
    cache.check_invariants()
    r.verify_all()
