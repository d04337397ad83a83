"""Property tests: random agent-like workloads through KVCache and the slow reference model.

A workload: a shared system prompt, sessions whose histories grow turn by turn, occasional
branching (a sub-agent forks a history) and compaction (a history is replaced by the system
prompt plus a summary), running requests that hold locks across other sessions' turns, explicit
evictions, and random capacities. Requests come with hints (arrival, then finish with a tool or
person wait, the time moving on; foresight for the oracle), which the agent-aware policies order
their victims by. After every operation the cache's invariants hold and its tree, sizes, match
results and freed slots equal the reference's.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
from cache_helpers import request_slots
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference_cache import ReferenceCache, dump_real

from penelope.cache.hints import Foresight, Hint
from penelope.cache.manager import KVCache
from penelope.cache.policies import get_policy, policy_names
from penelope.costmodel.recompute import CostModel
from penelope.costmodel.shapes import get_model
from penelope.errors import CacheFullError, UsageError

# Every cost of Qwen3-8B's model is an integer: sums agree whatever their order.
COST = CostModel(get_model("qwen3-8b"))
KINDS = ["turn"] * 8 + ["branch", "compact", "evict", "probe", "open", "open", "close", "arrive", "tick"]
# (kind, session or size, growth or target, fresh slots on insert, branch point)
OPS = st.tuples(st.sampled_from(KINDS), st.integers(0, 3), st.integers(0, 24), st.booleans(),
                st.floats(0, 1))


class Harness:
    """Runs each operation on both caches and compares everything observable."""

    def __init__(self, capacity, block_size, policy):
        self.real = KVCache(capacity, block_size=block_size, policy=policy, cost_model=COST)
        self.ref = ReferenceCache(capacity, block_size, policy, cost_model=COST)
        self.bs, self.capacity = block_size, capacity
        self.outstanding = 0
        self.open: list[tuple] = []
        self.now = 0.0
        self.foresight = get_policy(policy).uses_foresight

    def tick(self, seconds):
        self.now += seconds
        self.real.advance(self.now)
        self.ref.advance(self.now)

    def arrive(self, tokens):
        self.real.hint(np.array(tokens, dtype=np.int64), Hint(self.now, "arrived"))
        self.ref.hint(tokens, self.now, "arrived")

    def finish(self, tokens, kind, wait, reuse):
        """A finish hint; an oracle also learns the next send (`wait` s later, never when None)
        and how many of the tokens the next request reuses."""
        foresight = None
        if self.foresight:
            foresight = Foresight(self.now + wait if wait is not None else float("inf"), reuse)
        self.real.hint(np.array(tokens, dtype=np.int64), Hint(self.now, "finished", kind, foresight))
        self.ref.hint(tokens, self.now, "finished", kind,
                      (foresight.next_send, foresight.reuse) if foresight else None)

    def compare(self):
        self.real.check_invariants()
        assert dump_real(self.real) == self.ref.dump()
        assert self.real.evictable_size() == self.ref.evictable()
        assert self.real.protected_size() == self.ref.protected()
        assert self.real.free_size() == self.capacity - self.ref.cached_tokens() - self.outstanding

    def match(self, tokens):
        m = self.real.match(np.array(tokens, dtype=np.int64))
        spans, holes, compute_from, recomputed, last = self.ref.match(tokens)
        got = [(s.start, s.end, s.state.name, tuple(s.slots.tolist())) for s in m.spans]
        assert got == spans
        assert m.holes == holes and m.compute_from == compute_from
        assert m.recomputed == recomputed
        return m, last

    def lock(self, tokens):
        m, last = self.match(tokens)
        if len(tokens) > self.capacity:
            with pytest.raises(UsageError):
                self.real.lock(m)
            return None
        handle = self.real.lock(m)
        self.ref.lock(last, +1)
        return m, handle, last

    def unlock(self, locked):
        _, handle, last = locked
        self.real.unlock(handle)
        self.ref.unlock(last)

    def turn(self, tokens, fresh_slots):
        """One request: match, lock, alloc what is not resident, insert, unlock."""
        locked = self.lock(tokens)
        if locked is None:
            return False
        m = locked[0]
        holes = sum(end - start for start, end in m.holes)
        need = len(tokens) if fresh_slots else holes + len(tokens) - m.compute_from
        short = need - self.real.free_size()
        full = short > self.ref.evictable()
        try:
            new = self.real.alloc(need)
        except CacheFullError:
            assert full
            self.unlock(locked)
            return False
        assert not full
        if short > 0:
            self.ref.evict(-(-short // self.bs))
        self.outstanding += need
        self.compare()
        slots = new if fresh_slots else request_slots(m, len(tokens), new)
        result = self.real.insert(np.array(tokens, dtype=np.int64), slots)
        returned = self.ref.insert(tokens, slots.tolist())
        assert result.freed == len(returned)
        self.outstanding -= need
        self.unlock(locked)
        return True

    def evict(self, n):
        result = self.real.evict(n)
        freed = self.ref.evict(-(-n // self.bs)) if n else []
        assert sorted(result.slots.tolist()) == sorted(freed)
        assert result.freed_tokens == len(freed)
        return result


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([2, 4]))
    capacity = block_size * draw(st.integers(2, 40)) + draw(st.integers(0, block_size - 1))
    policy = draw(st.sampled_from(policy_names()))
    vocab = draw(st.sampled_from([2, 5, 10_000]))
    seed = draw(st.integers(0, 2**32 - 1))
    system_len = draw(st.integers(0, 3 * block_size))
    n_sessions = draw(st.integers(1, 4))
    ops = draw(st.lists(OPS, min_size=20, max_size=60))
    return block_size, capacity, policy, vocab, seed, system_len, n_sessions, ops


def run_workload(block_size, capacity, policy, vocab, seed, system_len, n_sessions, ops):
    rng = random.Random(seed)

    def fresh(n):
        return [rng.randrange(vocab) for _ in range(n)]

    system = fresh(system_len)
    sessions = [system + fresh(rng.randrange(1, 3 * block_size)) for _ in range(n_sessions)]
    h = Harness(capacity, block_size, policy)
    for kind, a, b, fresh_slots, cut in ops:
        a %= n_sessions
        h.tick(b % 7)
        if kind == "turn":
            h.arrive(sessions[a])
            if h.turn(sessions[a], fresh_slots):
                reuse = len(sessions[a]) if cut < 0.7 else int(cut * len(sessions[a]))
                h.finish(sessions[a], "tool" if fresh_slots else "human", None if cut > 0.95 else b, reuse)
                sessions[a] = sessions[a] + fresh(b)
            if len(sessions[a]) > capacity:
                # An agent compacts its context when it no longer fits.
                sessions[a] = system + fresh(b)
        elif kind == "branch":
            sessions[b % n_sessions] = sessions[a][: int(cut * len(sessions[a]))] + fresh(block_size)
        elif kind == "compact":
            sessions[a] = system + fresh(b)
        elif kind == "evict":
            h.evict(a * b)
        elif kind == "probe":
            h.match(sessions[a])
        elif kind == "open":
            # A running request on the whole history, or on a prefix of it (a forked sub-agent).
            locked = h.lock(sessions[a][: int(cut * len(sessions[a]))] if fresh_slots else sessions[a])
            if locked is not None:
                h.open.append(locked)
        elif kind == "close" and h.open:
            h.unlock(h.open.pop(a % len(h.open)))
        elif kind == "arrive":
            h.arrive(sessions[a])
        h.compare()
    while h.open:
        h.unlock(h.open.pop())
        h.compare()
    # With nothing locked, everything cached can be evicted.
    cached = h.real.evictable_size()
    assert h.evict(10**9).freed_tokens == cached
    h.compare()
    assert h.real.free_size() == capacity


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_cache_agrees_with_reference(workload):
    run_workload(*workload)


@pytest.mark.parametrize("policy", policy_names())
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_sessions=st.integers(2, 3),
       ops=st.lists(OPS, min_size=30, max_size=80))
def test_each_policy_agrees_with_reference(policy, seed, n_sessions, ops):
    run_workload(4, 96, policy, 10_000, seed, 8, n_sessions, ops)
