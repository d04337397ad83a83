"""Unit tests of the eviction rules of docs/design.md section 3, one rule per test.

Block size 4. `S` is a shared system prompt of 2 blocks; histories grow by one node of 2 blocks
per turn, so node boundaries sit at positions 8, 16, 24, ...
"""
from __future__ import annotations

import numpy as np
import pytest
from cache_helpers import serve, shape

from penelope.cache.manager import KVCache
from penelope.cache.policies import policy_names

BS = 4
S = list(range(1000, 1008))


def history(base: int, n: int, shared: bool = True) -> list[int]:
    return (S if shared else []) + list(range(base, base + n))


def grow(cache: KVCache, tokens: list[int], step: int = 8, start: int = 8) -> None:
    """Serve `tokens` turn by turn, `step` tokens more each turn (one node per turn)."""
    for end in range(start, len(tokens) + 1, step):
        serve(cache, tokens[:end])


def states(cache: KVCache, tokens) -> list[tuple[int, int, str]]:
    match = cache.match(np.asarray(tokens, dtype=np.int64))
    return [(s.start, s.end, s.state.name) for s in match.spans]


def two_sessions(policy: str, capacity: int = 256) -> tuple[KVCache, list[int], list[int]]:
    """A = S + 16 tokens (nodes [8,16), [16,24)) served first, then B = S + 8 tokens."""
    cache = KVCache(capacity, block_size=BS, policy=policy)
    a, b = history(100, 16), history(200, 8)
    grow(cache, a)
    grow(cache, b, start=16)
    return cache, a, b


def test_walk_stops_before_the_root():
    cache = KVCache(256, block_size=BS)
    h = history(100, 24, shared=False)
    grow(cache, h)
    assert cache.evict(4).ranges == [(0, 4)]
    assert shape(cache) == [(0, 4, "M"), (4, 8, "G"), (8, 16, "GG"), (16, 24, "GG")]
    cache.check_invariants()


def test_walk_stops_before_a_shared_parent():
    cache, a, b = two_sessions("penelope")
    # A is least recently used; its private history starts right after the shared prompt.
    assert cache.evict(4).ranges == [(8, 12)]
    assert states(cache, a) == [(0, 8, "GPU"), (8, 12, "MISSING"), (12, 24, "GPU")]
    assert states(cache, b) == [(0, 16, "GPU")]


def test_walk_stops_before_a_locked_parent():
    cache = KVCache(256, block_size=BS)
    h = history(100, 24, shared=False)
    grow(cache, h)
    handle = cache.lock(cache.match(h[:8]))
    assert cache.evict(4).ranges == [(8, 12)]
    cache.check_invariants()
    cache.unlock(handle)


def test_walk_stops_before_a_parent_whose_kv_is_missing():
    cache = KVCache(256, block_size=BS)
    h = history(100, 24, shared=False)
    grow(cache, h)
    # Lock [0, 8) so the next eviction empties [8, 16); then unlock: resident, hole, resident.
    handle = cache.lock(cache.match(h[:8]))
    assert cache.evict(8).ranges == [(8, 16)]
    cache.unlock(handle)
    assert shape(cache) == [(0, 8, "GG"), (8, 16, "MM"), (16, 24, "GG")]
    # The walk from the leaf stops at the hole: [16, 20) goes next, not [0, 4).
    assert cache.evict(4).ranges == [(16, 20)]
    cache.check_invariants()


def test_eviction_splits_nodes_at_block_boundaries():
    cache = KVCache(256, block_size=BS)
    h = history(100, 16, shared=False)
    serve(cache, h)
    assert shape(cache) == [(0, 16, "GGGG")]
    assert cache.evict(3).freed_tokens == 4
    assert shape(cache) == [(0, 4, "M"), (4, 16, "GGG")]
    match = cache.match(np.asarray(h, dtype=np.int64))
    assert match.holes == [(0, 4)] and match.compute_from == 16


def test_eviction_continues_forward_along_the_same_history():
    cache, a, b = two_sessions("penelope")
    # 3 blocks: both blocks of [8, 16), then the first of [16, 24); B is untouched.
    result = cache.evict(12)
    assert result.ranges == [(8, 16), (16, 20)]
    assert states(cache, a) == [(0, 8, "GPU"), (8, 20, "MISSING"), (20, 24, "GPU")]
    assert states(cache, b) == [(0, 16, "GPU")]
    cache.check_invariants()


def test_exhausted_private_chain_is_pruned_and_the_shared_parent_becomes_evictable():
    cache, a, b = two_sessions("penelope")
    # A's 4 private blocks, then the next victim: B's leaf. The prompt has one child left, so
    # it is B's private history now and its front goes first.
    result = cache.evict(20)
    assert result.ranges == [(8, 16), (16, 24), (0, 4)]
    assert shape(cache) == [(0, 4, "M"), (4, 8, "G"), (8, 16, "GG")]
    assert states(cache, a) == [(0, 4, "MISSING"), (4, 8, "GPU")]
    cache.check_invariants()


def test_hole_with_nothing_resident_after_it_is_pruned():
    cache, a, b = two_sessions("penelope")
    cache.evict(8)
    assert states(cache, a)[1] == (8, 16, "MISSING")
    serve(cache, b)  # B becomes most recent again, A's tail is the next victim
    cache.evict(8)
    assert all(node.start < 8 or node.tokens[0] >= 200 for node in cache.tree.nodes())
    cache.check_invariants()


def test_unlock_prunes_a_locked_leaf_left_without_resident_kv():
    cache = KVCache(256, block_size=BS)
    h = history(100, 16, shared=False)
    grow(cache, h)
    cache.evict(8)  # [0, 8) becomes a hole
    handle = cache.lock(cache.match(h[:8]))  # a request on the hole alone
    cache.evict(8)  # [8, 16) goes; the locked hole stays
    assert shape(cache) == [(0, 8, "MM")]
    cache.check_invariants()
    cache.unlock(handle)
    assert shape(cache) == []
    cache.check_invariants()


@pytest.mark.parametrize("policy", policy_names())
def test_shared_prefix_is_never_evicted_while_two_histories_use_it(policy):
    cache = KVCache(512, block_size=BS, policy=policy)
    for base in (100, 200, 300):
        grow(cache, history(base, 24))
    steps_while_shared = 0
    while cache.evictable_size():
        cache.evict(4)
        cache.check_invariants()
        nodes = list(cache.tree.nodes())
        if any(n.end == len(S) and len(n.children) > 1 for n in nodes):
            steps_while_shared += 1
            assert all(n.n_gpu == n.n_blocks for n in nodes if n.end <= len(S))
    assert steps_while_shared >= 2 and cache.free_size() == cache.capacity


@pytest.mark.parametrize("policy", policy_names())
def test_locked_path_is_never_evicted(policy):
    cache = KVCache(512, block_size=BS, policy=policy)
    a = history(100, 24)
    for base in (100, 200, 300):
        grow(cache, history(base, 24))
    handle = cache.lock(cache.match(a))
    evictable = cache.evictable_size()
    assert cache.evict(10**6).freed_tokens == evictable
    assert states(cache, a) == [(0, 32, "GPU")]
    assert cache.protected_size() == 32 and cache.evictable_size() == 0
    cache.check_invariants()
    cache.unlock(handle)
    assert cache.evict(10**6).freed_tokens == 32
    assert cache.free_size() == cache.capacity


@pytest.mark.parametrize("policy, ranges, a_after", [
    # SGLang: the least-recently-used leaf node is deleted whole.
    ("sglang", [(16, 24)], [(0, 16, "GPU")]),
    ("leaf-tail-block", [(20, 24)], [(0, 20, "GPU")]),
    # Evicting the whole leaf from its head leaves nothing to reuse: pruned like SGLang.
    ("leaf-head-node", [(16, 24)], [(0, 16, "GPU")]),
    ("leaf-head-block", [(16, 20)], [(0, 16, "GPU"), (16, 20, "MISSING"), (20, 24, "GPU")]),
    ("private-head-node", [(8, 16)], [(0, 8, "GPU"), (8, 16, "MISSING"), (16, 24, "GPU")]),
    ("penelope", [(8, 12)], [(0, 8, "GPU"), (8, 12, "MISSING"), (12, 24, "GPU")]),
])
def test_where_and_how_much_each_policy_evicts(policy, ranges, a_after):
    cache, a, b = two_sessions(policy)
    assert cache.evict(4).ranges == ranges
    assert states(cache, a) == a_after
    assert states(cache, b) == [(0, 16, "GPU")]
    cache.check_invariants()


def test_sglang_eviction_moves_up_to_the_parent_once_it_is_a_leaf():
    cache, a, b = two_sessions("sglang")
    # A's two nodes, newest first, then B's node, then the shared prompt.
    assert cache.evict(24).ranges == [(16, 24), (8, 16), (8, 16)]
    assert cache.evict(4).ranges == [(0, 8)]
    assert cache.free_size() == cache.capacity


def test_recency_is_the_last_match():
    cache, a, b = two_sessions("penelope")
    cache.match(np.asarray(a, dtype=np.int64))  # a probe is an access
    assert cache.evict(4).ranges == [(8, 12)]
    assert states(cache, b) == [(0, 8, "GPU"), (8, 12, "MISSING"), (12, 16, "GPU")]


def test_recency_is_a_logical_clock():
    cache = KVCache(256, block_size=BS)
    serve(cache, history(100, 8))  # match + insert
    assert cache.tree.clock == 2
    cache.match(history(100, 8))
    assert cache.tree.clock == 3
    assert sorted(n.last_access for n in cache.tree.nodes()) == [3]


def test_same_operations_give_the_same_tree():
    def run():
        cache = KVCache(96, block_size=BS)
        for turn in range(6):
            for base in (100, 200, 300):
                serve(cache, history(base, 8 * turn + 5))
        return shape(cache), [n.last_access for n in cache.tree.nodes()]

    assert run() == run()
