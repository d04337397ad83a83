"""penelope.cache.admission: one request's admission, the path the engine, the simulator and the
SGLang adapter share."""
from __future__ import annotations

import inspect

import numpy as np
import pytest
from cache_helpers import serve

from penelope.cache import admission
from penelope.cache.admission import admit, load_path
from penelope.cache.manager import KVCache
from penelope.cache.slots import DeviceSlots, HostSlots, SlotAllocator, SlotPool
from penelope.cache.tiers import TwoTierCache
from penelope.cache.tree import BlockState
from penelope.errors import CacheFullError, UsageError

BS = 4


def snapshot(cache: KVCache):
    return (cache.free_size(), cache.evictable_size(), cache.protected_size(), cache.outstanding_size(),
            dict(vars(cache.stats)), sorted((n.start, n.end, n.state.tolist()) for n in cache.tree.nodes()))


def history(cache, base, n):
    tokens = np.arange(base, base + n, dtype=np.int64)
    serve(cache, tokens)
    return tokens


def test_admit_fills_every_position_and_reserves_the_reply():
    cache = KVCache(64, block_size=BS, policy="penelope")
    tokens = history(cache, 0, 16)
    grown = np.concatenate([tokens, np.arange(100, 106)])
    got = admit(cache, grown, reserve=3)
    assert got.compute_from == 16 and got.computed == [(16, 22)]
    assert len(got.owned) == 6 + 3 and np.array_equal(got.reserved, got.owned[6:])
    assert np.all(got.slots >= 0) and np.array_equal(got.slots[16:], got.owned[:6])
    # Resident positions keep the tree's slots.
    assert np.array_equal(got.slots[:16], got.match.spans[0].slots)
    cache.insert(grown, got.slots)
    cache.free(got.reserved)
    cache.unlock(got.handle)
    cache.check_invariants()


def test_admit_matches_a_prefix_when_asked_and_always_computes_the_last_token():
    cache = KVCache(64, block_size=BS, policy="penelope")
    tokens = history(cache, 0, 16)
    whole = admit(cache, tokens)
    # All 16 tokens are cached: the last one is still computed, into a slot of its own.
    assert whole.compute_from == 15 and whole.computed == [(15, 16)]
    cache.free(whole.owned)
    cache.unlock(whole.handle)
    # Matching without the last token (SGLang's rule) recomputes the whole last block.
    short = admit(cache, tokens, match_tokens=15)
    assert short.match.n_tokens == 15 and short.compute_from == 12 and short.computed == [(12, 16)]
    cache.free(short.owned)
    cache.unlock(short.handle)
    cache.check_invariants()


def test_admit_refuses_without_changing_anything_when_the_request_cannot_fit():
    cache = KVCache(32, block_size=BS, policy="penelope")
    kept = history(cache, 0, 16)
    held = admit(cache, kept)  # locks 16 tokens and holds a slot
    before = snapshot(cache)
    assert cache.free_size() + cache.evictable_size() == 15
    with pytest.raises(CacheFullError, match="needs 16 GPU slots now"):
        admit(cache, np.arange(500, 516))
    assert snapshot(cache) == before
    # Exactly what is free fits.
    fits = admit(cache, np.arange(500, 515))
    assert len(fits.owned) == 15 and cache.free_size() == 0
    cache.free(fits.owned)
    cache.unlock(fits.handle)
    cache.free(held.owned)
    cache.unlock(held.handle)
    cache.check_invariants()


def test_admit_leaves_too_long_requests_to_lock_and_empty_ones_to_a_usage_error():
    cache = KVCache(32, block_size=BS)
    with pytest.raises(UsageError, match="never fit"):
        admit(cache, np.arange(33))
    with pytest.raises(UsageError, match="at least one token"):
        admit(cache, [])
    assert cache.protected_size() == 0 and cache.stats.requests == 0


def test_admit_loads_cpu_spans_back_before_allocating():
    cache = TwoTierCache(32, 32, block_size=BS, policy="penelope", swap_buffer=BS)
    first = history(cache, 0, 24)
    history(cache, 1000, 24)  # demotes most of `first` to the CPU tier
    match = cache.match(first)
    assert match.loads, "the test needs CPU spans to load"
    cache.take_plans()
    got = admit(cache, np.concatenate([first, [7, 7]]))
    assert got.loaded.loaded_tokens == sum(len(s) for s in match.loads)
    assert np.all(got.slots >= 0)
    states = {int(s) for n in cache.tree.path_to_root(got.handle.node) for s in n.state}
    assert BlockState.CPU not in states
    cache.insert(np.concatenate([first, [7, 7]]), got.slots)
    cache.unlock(got.handle)
    cache.check_invariants()


def test_load_path_checks_what_the_cache_loaded(monkeypatch):
    cache = TwoTierCache(32, 32, block_size=BS, policy="penelope", swap_buffer=BS)
    first = history(cache, 0, 24)
    history(cache, 1000, 24)
    match = cache.match(first)
    handle = cache.lock(match)
    real = cache.load
    monkeypatch.setattr(cache, "load", lambda h: real(h).__class__([], 0, 0))
    with pytest.raises(Exception, match="the cache loaded spans"):
        load_path(cache, handle, match.loads)
    cache.unlock(handle, admitted=False)
    # A GPU-only cache has no CPU tier to load from.
    gpu_only = KVCache(32, block_size=BS)
    m = gpu_only.match(np.arange(8))
    with pytest.raises(UsageError, match="no CPU tier"):
        load_path(gpu_only, gpu_only.lock(m), match.loads)


def test_every_caller_admits_through_admit():
    """The engine's plan_request, the simulator's scheduler and the SGLang adapter take this path."""
    from penelope.cache import phantom
    from penelope.integration.sglang import radix_cache
    from penelope.sim import scheduler

    assert "admit(" in inspect.getsource(phantom.plan_request)
    assert "admit(" in inspect.getsource(scheduler.Scheduler._admit)
    assert "load_path(" in inspect.getsource(radix_cache.PenelopeRadixCache.load_for)
    assert admission.admit.__module__ == "penelope.cache.admission"


@pytest.mark.parametrize("pool", [SlotAllocator, HostSlots])
def test_both_slot_pools_implement_the_pool_interface(pool):
    members = [name for name in vars(SlotPool) if not name.startswith("_")]
    assert {"free_size", "alloc", "release", "check"} <= set(members) and "capacity" in SlotPool.__annotations__
    instance = pool(64)
    assert instance.capacity == 64
    for name in members:
        assert callable(getattr(instance, name))
    rows = instance.alloc(8)
    assert len(rows) == 8 and instance.free_size() == 56 and instance.alloc(57) is None


def test_sglang_slots_implement_the_device_interface():
    from penelope.integration.sglang.slots import SGLangSlots

    for name in [n for n in vars(DeviceSlots) if not n.startswith("_")] + ["free_size", "alloc", "release", "check"]:
        assert callable(getattr(SGLangSlots, name)), name


@pytest.mark.parametrize("kwargs, message", [
    ({"reserve": -1}, "reserve must be a non-negative integer"),
    ({"reserve": 1.5}, "reserve must be a non-negative integer"),
    ({"match_tokens": 9}, "match_tokens 9 is beyond the request's 8 tokens"),
    ({"match_tokens": -1}, "match_tokens must be a non-negative integer"),
])
def test_admit_refuses_bad_arguments_before_anything_changes(kwargs, message):
    cache = KVCache(32, block_size=BS)
    history(cache, 0, 8)
    before = snapshot(cache)
    with pytest.raises(UsageError, match=message):
        admit(cache, np.arange(8), **kwargs)
    with pytest.raises(UsageError, match="tokens must be a 1-D sequence of integers"):
        admit(cache, [[1, 2]])
    assert snapshot(cache) == before


def test_a_cache_refuses_an_allocator_without_the_device_interface():
    class HalfPool:
        capacity = 32

        def free_size(self):
            return 32

        def alloc(self, n):
            return None

    with pytest.raises(UsageError, match="lacks the penelope.cache.slots.DeviceSlots interface"):
        KVCache(32, block_size=BS, allocator=HalfPool())
    assert isinstance(SlotAllocator(32), DeviceSlots) and not isinstance(HostSlots(32), DeviceSlots)


@pytest.mark.parametrize("tokens, kwargs", [(5000, {"match_tokens": 100}), (32, {"reserve": 1}),
                                            (8, {"reserve": 2**40})])
def test_admit_says_never_when_the_request_can_never_fit(tokens, kwargs):
    """A request larger than the GPU pool (its tokens and reserve) is a UsageError, not a
    CacheFullError a caller would retry forever, whatever part of it is matched."""
    cache = KVCache(32, block_size=BS)
    with pytest.raises(UsageError, match="can never fit in a cache of 32 tokens"):
        admit(cache, np.arange(tokens), **kwargs)
    assert cache.protected_size() == 0 and cache.stats.requests == 0


def test_a_policy_object_serves_one_cache():
    from penelope.cache.policies import get_policy

    policy = get_policy("penelope-agent")
    first = KVCache(64, block_size=BS, policy=policy)
    with pytest.raises(UsageError, match="already serves another cache"):
        KVCache(1024, block_size=BS, policy=policy)
    assert policy.capacity == 64 and policy.owner is first
    # A cache that failed its own checks does not claim the policy.
    spare = get_policy("penelope")
    with pytest.raises(UsageError):
        KVCache(64, block_size=BS, policy=spare, cost_model=object())
    assert KVCache(64, block_size=BS, policy=spare).policy is spare
    # A tiered cache sizes its policy by both tiers.
    assert TwoTierCache(64, 64, block_size=BS, swap_buffer=BS).policy.capacity == 128


def test_the_packages_export_their_main_names():
    import penelope.cache as cache_package
    import penelope.costmodel as costmodel_package
    from penelope.cache import HiCacheLikeCache, TieredCache, get_policy, policy_names
    from penelope.cache import KVCache as Exported
    from penelope.cache.baselines.hicache import HiCacheLikeCache as FromModule
    from penelope.costmodel import CostModel, RecomputeCost, get_model
    from penelope.costmodel.recompute import CostModel as CostFromModule

    assert Exported is KVCache and HiCacheLikeCache is FromModule and CostModel is CostFromModule
    assert issubclass(TwoTierCache, TieredCache) and isinstance(CostModel(get_model("qwen3-8b")), RecomputeCost)
    assert callable(get_policy) and "penelope" in policy_names(aliases=True)
    for package in (cache_package, costmodel_package):
        with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
            package.Nope  # noqa: B018
