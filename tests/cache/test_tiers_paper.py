"""The paper's two-tier situation and the failure mode the unified cache avoids, on real KV pools.

- Batch size 1, GPU and CPU tiers of equal size, a multi-turn agent workload: once both tiers are
  full, loading a history's CPU part means pushing other KV out of the GPU with no free host slot,
  so most loads go through the swap buffer.
- Two tiers evicting independently (the HiCache-like baseline): the GPU demotes the tail of a
  history, the host then deletes it, and a history ends with its front on the GPU and its back
  deleted, keeping the cheap part and losing the expensive one. The unified cache's one order
  (Penelope: front of the private history first, for demotion and deletion) never does that.
"""
from __future__ import annotations

import random

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tier_helpers import FingerprintRig

from penelope.cache.baselines.hicache import HiCacheLikeCache
from penelope.cache.tiers import TwoTierCache
from penelope.cache.tree import BlockState


def agent_workload(seed: int, n_sessions: int, turns: int, block: int, longest: int):
    """Requests of `n_sessions` sessions sharing a system prompt, one at a time in random order:
    each turn appends 1-4 blocks plus a partial block, a session longer than `longest` compacts.
    Yields (session, history tokens, shared prefix length)."""
    rng = random.Random(seed)
    system = [rng.randrange(10**6) for _ in range(4 * block)]
    sessions = [system + [rng.randrange(10**6) for _ in range(block + 3)] for _ in range(n_sessions)]
    for _ in range(turns):
        i = rng.randrange(n_sessions)
        yield i, sessions[i], len(system)
        sessions[i] = sessions[i] + [rng.randrange(10**6) for _ in range(rng.randrange(block, 5 * block))]
        if len(sessions[i]) > longest:
            sessions[i] = system + [rng.randrange(10**6) for _ in range(2 * block)]


def test_batch_size_one_equal_tiers_most_loads_go_through_the_swap_buffer():
    block = 16
    cache = TwoTierCache(512, 512, block_size=block, policy="penelope", swap_buffer=64)
    rig = FingerprintRig(cache, cache.host_rows)
    for _, history, _ in agent_workload(3, n_sessions=6, turns=120, block=block, longest=400):
        assert rig.serve(history, output_tokens=8) is not None
    counters = cache.counters
    print(f"\nbatch size 1, GPU = CPU = 512 tokens, swap buffer 64: {counters.loads} loads, "
          f"{counters.swap_loads} through the swap buffer ({counters.swapped_tokens} of "
          f"{counters.loaded_tokens} loaded tokens), {rig.plans_run} plans run")
    assert counters.loads >= 25
    assert counters.swap_loads > 0.6 * counters.loads
    assert rig.executor.counters.swapped_tokens == counters.swapped_tokens


def front_kept_back_deleted(cache, history, shared: int) -> bool:
    """True when a GPU block of the history's private part (after `shared` tokens) comes before a
    block whose KV is gone (MISSING, or no longer in the tree)."""
    bs = cache.block_size
    tokens = np.asarray(history, dtype=np.int64)
    n_blocks = len(tokens) // bs
    path, last = cache.tree.walk(tokens, n_blocks)
    parts = [node.state for node in path[:-1]] + ([path[-1].state[:last]] if path else [])
    states = np.concatenate(parts) if parts else np.empty(0, dtype=np.int8)
    states = np.concatenate([states, np.full(n_blocks - len(states), int(BlockState.MISSING), dtype=np.int8)])
    private = states[-(-shared // bs):]
    on_gpu = np.flatnonzero(private == int(BlockState.GPU))
    gone = np.flatnonzero(private == int(BlockState.MISSING))
    return bool(len(on_gpu) and len(gone) and on_gpu[0] < gone[-1])


def count_failures(cache, seed: int, turns: int = 60) -> int:
    """Steps after which some served history has its front on the GPU and its back deleted."""
    rig = FingerprintRig(cache, cache.host_rows)
    served: dict[int, list[int]] = {}
    failures = 0
    for session, history, shared in agent_workload(seed, n_sessions=4, turns=turns, block=4, longest=60):
        if rig.serve(history, output_tokens=2) is not None:
            served[session] = list(history)
        failures += any(front_kept_back_deleted(cache, h, shared) for h in served.values())
    return failures


def test_independent_tiers_keep_the_front_and_delete_the_back_unified_never():
    hicache = [count_failures(HiCacheLikeCache(64, 64, block_size=4), seed) for seed in range(4)]
    unified = [count_failures(TwoTierCache(64, 64, block_size=4, swap_buffer=8), seed) for seed in range(4)]
    print(f"\nsteps with a history 'front on GPU, back deleted' out of 60: HiCache-like {hicache}, "
          f"unified Penelope {unified}")
    assert all(count > 0 for count in hicache)
    assert unified == [0, 0, 0, 0]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), gpu_blocks=st.integers(21, 32), cpu_blocks=st.integers(1, 24),
       policy=st.sampled_from(["penelope", "private-head-node"]))
def test_unified_private_head_never_keeps_the_front_and_deletes_the_back(seed, gpu_blocks, cpu_blocks, policy):
    cache = TwoTierCache(4 * gpu_blocks, 4 * cpu_blocks, block_size=4, policy=policy, swap_buffer=4)
    assert count_failures(cache, seed, turns=40) == 0
