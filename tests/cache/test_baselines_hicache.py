"""The HiCache-like baseline (`penelope.cache.baselines.hicache`): SGLang 0.5.23's hierarchical cache rules, on
real KV pools with per-token fingerprints (block size 4).

Rules under test: write-through backups parents first, device eviction of the LRU device leaf as
a whole node (demoted with a host copy, deleted without one), host eviction of the LRU host-only
leaf (deleted), loads that keep the host copy, host hits counted as hits.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
from cache_helpers import shape
from hypothesis import HealthCheck, given, settings
from tier_helpers import FingerprintRig, run_workload, workloads

from penelope.cache.baselines.hicache import HiCacheLikeCache
from penelope.errors import UsageError


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def rig(gpu: int, cpu: int) -> FingerprintRig:
    cache = HiCacheLikeCache(gpu, cpu, block_size=4)
    return FingerprintRig(cache, cache.host_rows)


def test_write_through_backs_up_every_inserted_node():
    r = rig(16, 16)
    r.serve(tokens(1, 8))
    assert r.cache.backup_size() == 8 and r.cache.cpu_free_size() == 8
    assert r.cache.counters.backed_up_tokens == 8
    r.serve(tokens(1, 8) + tokens(2, 4))
    assert r.cache.backup_size() == 12 and shape(r.cache) == [(0, 8, "GG"), (8, 12, "G")]


def test_an_insert_that_keeps_the_leading_run_backs_up_as_any_insert():
    """`keep_leading` reaches KVCache.insert through the write-through override."""
    cache = HiCacheLikeCache(16, 16, block_size=4)
    first = np.asarray(tokens(1, 8), dtype=np.int64)
    cache.insert(first, cache.alloc(8))
    longer = np.concatenate([first, np.asarray(tokens(2, 4), dtype=np.int64)])
    slots = np.concatenate([np.full(8, -7, dtype=np.int64), cache.alloc(4)])
    result = cache.insert(longer, slots, keep_leading=True)
    assert result.leading == 8 and result.new == 4
    assert cache.backup_size() == 12 and shape(cache) == [(0, 8, "GG"), (8, 12, "G")]
    cache.check_invariants()


def test_device_eviction_demotes_the_lru_leaf_and_a_load_keeps_the_host_copy():
    r = rig(16, 32)
    a, b, c = tokens(1, 8), tokens(2, 8), tokens(3, 8)
    for request in (a, b, c):
        r.serve(request)
    # The device needed room for c: the least recently used device leaf, a, went to the host.
    match = r.cache.match(np.asarray(a))
    assert [(s.start, s.end, s.state.name) for s in match.spans] == [(0, 8, "CPU")]
    assert match.hit_tokens == 8
    assert r.cache.counters.demoted_tokens == 8 and r.cache.counters.deleted_gpu_tokens == 0
    _, loaded = r.serve(a)
    assert loaded.loaded_tokens == 8 and loaded.swapped_tokens == 0
    # a is back on the GPU with its host copy; b (now the LRU device leaf) was demoted.
    assert r.cache.match(np.asarray(a)).spans[0].state.name == "GPU" and r.cache.backup_size() == 16
    assert r.cache.match(np.asarray(b)).spans[0].state.name == "CPU"


def test_host_eviction_deletes_the_lru_host_leaf_and_unbacked_nodes_are_deleted():
    r = rig(16, 8)
    a, b, c, d = (tokens(i, 8) for i in range(1, 5))
    r.serve(a)
    r.serve(b)
    # The host is full of a's copy: b could not be backed up.
    assert r.cache.backup_size() == 8 and r.cache.cpu_free_size() == 0
    r.serve(c)
    # a (LRU, backed) was demoted, then deleted from the host to back up c.
    assert r.cache.match(np.asarray(a)).matched == 0
    assert r.cache.counters.deleted_cpu_tokens == 8
    r.serve(d)
    # b, the LRU device leaf, had no host copy: deleted.
    assert r.cache.match(np.asarray(b)).matched == 0
    assert r.cache.counters.deleted_gpu_tokens == 8


def test_a_history_keeps_its_front_on_the_gpu_and_loses_its_back():
    """The two LRUs: the device demotes the tail node of the old history, the host deletes it."""
    r = rig(16, 16)
    first = tokens(1, 8)
    history = first + tokens(2, 4)
    r.serve(first)
    r.serve(history)
    r.serve(tokens(3, 8))
    spans = r.cache.match(np.asarray(history)).spans
    assert [(s.start, s.end, s.state.name) for s in spans] == [(0, 8, "GPU")]


@pytest.mark.parametrize(
    "gpu, cpu, message", [(256, 0, "needs a CPU tier"), (256, 32, "needs a CPU tier"), (32, 256, "below one block")]
)
def test_bad_configuration_is_a_clear_error(gpu, cpu, message):
    with pytest.raises(UsageError, match=message):
        HiCacheLikeCache(gpu, cpu)


def test_policy_name_is_the_sglang_baseline():
    assert HiCacheLikeCache(256, 256).policy.name == "leaf-tail-node"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_every_block_and_host_copy_intact(workload):
    h = run_workload(*workload, make_cache=lambda gpu, cpu, bs: HiCacheLikeCache(gpu, cpu, block_size=bs))
    assert h.cache.counters.loaded_tokens >= 0


def test_insert_of_a_strided_token_array_backs_up_its_path():
    cache = HiCacheLikeCache(64, 64, block_size=4)
    tokens = np.arange(64, dtype=np.int64)[::2]
    handle = cache.lock(cache.match(tokens))
    cache.insert(tokens, cache.alloc(32))
    cache.unlock(handle)
    assert len(cache.tree.backup) == 1
    cache.check_invariants()
