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

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tier_helpers import FingerprintRig

from penelope.cache.policy import policy_names
from penelope.cache.tiers import TwoTierCache
from penelope.cache.tree import BlockState
from penelope.errors import CacheFullError

KINDS = ["turn"] * 12 + ["branch", "compact", "evict", "probe", "open", "close"]
OPS = st.tuples(st.sampled_from(KINDS), st.integers(0, 3), st.integers(0, 24), st.integers(0, 6), st.floats(0, 1))


class TierHarness(FingerprintRig):
    """FingerprintRig plus the checks that need the cache's counters around each operation."""

    def __init__(self, cache):
        super().__init__(cache, cache.host_rows)
        self.open: list = []
        # Only the unified cache promises to delete nothing while the two tiers have room.
        self.unified = isinstance(cache, TwoTierCache)

    def room(self) -> int:
        """Tokens the two tiers can still take without deleting anything (whole blocks on the host)."""
        bs = self.cache.block_size
        return self.cache.free_size() + self.cache.cpu_free_size() // bs * bs

    def checked_serve(self, tokens, output_tokens):
        cache = self.cache
        before = cache.counters.deleted_gpu_tokens + cache.counters.deleted_cpu_tokens
        room = self.room()
        served = self.serve(tokens, output_tokens)
        deleted = cache.counters.deleted_gpu_tokens + cache.counters.deleted_cpu_tokens - before
        if deleted and self.unified:
            # Deleting is the last resort: the request's new KV did not fit in both tiers.
            assert room < len(tokens) + output_tokens, (room, len(tokens), output_tokens)
        self.check_step()
        return served

    def check_step(self):
        cache = self.cache
        cache.check_invariants()
        self.verify_all()
        gpu_cached = cache.evictable_size() + cache.protected_size()
        cpu_cached = cache.cpu_evictable_size() + cache.cpu_protected_size()
        assert gpu_cached + cpu_cached <= cache.total_capacity
        if self.unified:
            assert len(np.intersect1d(cache.buffer_slots(), cache.tree.slots_in(BlockState.CPU))) == 0

    def open_request(self, tokens):
        """A running request: its path locked and loaded onto the GPU, held across other turns."""
        cache = self.cache
        match = cache.match(np.asarray(tokens, dtype=np.int64))
        handle = cache.lock(match)
        try:
            if match.loads:
                cache.load(handle)
        except CacheFullError:
            cache.unlock(handle)
            return
        self.run_plans()
        self.open.append(handle)


@st.composite
def workloads(draw):
    bs = draw(st.sampled_from([2, 4]))
    gpu = bs * draw(st.integers(3, 14)) + draw(st.integers(0, bs - 1))
    cpu = bs * draw(st.integers(1, 14)) + draw(st.integers(0, bs - 1))
    buffer = draw(st.integers(bs, 3 * bs + 1))
    policy = draw(st.sampled_from(policy_names()))
    seed = draw(st.integers(0, 2**32 - 1))
    system_len = draw(st.integers(0, 3 * bs))
    n_sessions = draw(st.integers(1, 4))
    ops = draw(st.lists(OPS, min_size=25, max_size=60))
    return bs, gpu, cpu, buffer, policy, seed, system_len, n_sessions, ops


def run_workload(bs, gpu, cpu, buffer, policy, seed, system_len, n_sessions, ops, make_cache=None):
    rng = random.Random(seed)

    def fresh(n):
        return [rng.randrange(50) for _ in range(n)]

    if make_cache is None:
        cache = TwoTierCache(gpu, cpu, block_size=bs, policy=policy, swap_buffer=buffer)
    else:
        cache = make_cache(gpu, cpu, bs)
    h = TierHarness(cache)
    system = fresh(system_len)
    sessions = [system + fresh(rng.randrange(1, 3 * bs)) for _ in range(n_sessions)]
    for kind, a, b, output, cut in ops:
        a %= n_sessions
        if kind == "turn":
            if len(sessions[a]) + output <= gpu and h.checked_serve(sessions[a], output) is not None:
                sessions[a] = sessions[a] + fresh(b)
            if len(sessions[a]) + 6 > gpu:
                sessions[a] = system + fresh(b % (gpu // 2))
        elif kind == "branch":
            sessions[b % n_sessions] = sessions[a][: int(cut * len(sessions[a]))] + fresh(bs)
        elif kind == "compact":
            sessions[a] = system + fresh(b % (gpu // 2))
        elif kind == "evict":
            result = cache.evict(a * b)
            assert result.freed_tokens >= min(a * b, result.freed_tokens)
            h.run_plans()
        elif kind == "probe":
            cache.match(np.asarray(sessions[a], dtype=np.int64))
        elif kind == "open" and len(sessions[a]) <= gpu:
            h.open_request(sessions[a][: int(cut * len(sessions[a]))] if b % 2 else sessions[a])
        elif kind == "close" and h.open:
            cache.unlock(h.open.pop(a % len(h.open)))
        h.check_step()
    while h.open:
        cache.unlock(h.open.pop())
        h.check_step()
    return h


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
