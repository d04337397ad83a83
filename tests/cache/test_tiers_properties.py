"""Property tests of the two-tier cache on real KV pools whose rows carry a per-token fingerprint.

Random agent-like workloads (a shared system prompt, sessions growing turn by turn, branching,
compaction, running requests that hold their path across other sessions' turns, explicit
evictions) with random GPU and CPU capacities, swap buffers and policies. Every plan runs through
the swap executor; after it the swap buffer's rows are overwritten with poison. After every step:
every resident block's rows equal its fingerprint (nothing lost, nothing overwritten), the
invariants hold (each block in one tier, host rows against the tree, free + evictable +
protected == capacity per tier, the buffer owns no cached row), the logical capacity holds, and
KV was deleted only when the two tiers together had no room.
"""
from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from tier_helpers import (
    TierHarness,
    run_workload,
    workloads,
)

from penelope.cache.tiers import TwoTierCache


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_every_block_intact(workload):
    run_workload(*workload)


def test_both_tiers_full_exchanges_keep_fingerprints():
    """A fixed workload in which the tiers fill up and loads go through the swap buffer, with the
    Triton copy kernel (interpreted on CPU)."""
    rng = random.Random(7)
    cache = TwoTierCache(32, 32, block_size=4, policy="penelope", swap_buffer=8)
    h = TierHarness(cache)
    h.executor.copy = "triton"
    system = [rng.randrange(50) for _ in range(6)]
    sessions = [system + [rng.randrange(50) for _ in range(4)] for _ in range(3)]
    for step in range(18):
        a = step % 3
        assert h.checked_serve(sessions[a], 2) is not None
        sessions[a] += [rng.randrange(50) for _ in range(rng.randrange(2, 7))]
        if len(sessions[a]) > 28:
            sessions[a] = system + [rng.randrange(50) for _ in range(3)]
    assert cache.counters.swap_loads > 0 and h.executor.counters.swapped_tokens == cache.counters.swapped_tokens
    assert cache.counters.deleted_cpu_tokens > 0
    assert h.executor.counters.bytes_moved == (
        (cache.counters.demoted_tokens + cache.counters.loaded_tokens) * 2 * 2 * 2 * 4
    )
