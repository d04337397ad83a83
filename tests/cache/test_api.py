"""KVCache API: match, insert, statistics, bad input, and the invariant checks themselves."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from cache_helpers import request_slots, serve, shape
from reference_cache import dump_real

from penelope import memory
from penelope.cache.arguments import int_array
from penelope.cache.manager import KVCache
from penelope.cache.tiers import TwoTierCache
from penelope.cache.tree import BlockState, PrefixHasher
from penelope.errors import CacheFullError, InvariantError, UsageError

BS = 4
S = list(range(1000, 1008))


def tokens(base: int, n: int) -> np.ndarray:
    return np.asarray(S + list(range(base, base + n)), dtype=np.int64)


def snapshot(cache: KVCache):
    alloc = cache.allocator
    return (dump_real(cache), cache.free_size(), cache.evictable_size(), cache.protected_size(),
            cache.tree.clock, alloc.outstanding_size(), alloc._stack[:alloc.free_size()].tolist())


class SumOfPositions:
    """Stand-in cost model: a token at position p costs 10 + p."""

    def span_cost(self, start: int, end: int) -> float:
        return float(sum(10 + p for p in range(start, end)))


def test_match_reports_spans_holes_and_compute_from():
    cache = KVCache(256, block_size=BS, policy="leaf-head-block")
    a = tokens(100, 16)
    for end in (16, 24):
        serve(cache, a[:end])
    cache.evict(4)  # front of the leaf [16, 24)
    m = cache.match(np.concatenate([a, [7, 7]]))
    assert [(s.start, s.end, s.state) for s in m.spans] == [
        (0, 16, BlockState.GPU), (16, 20, BlockState.MISSING), (20, 24, BlockState.GPU)]
    assert m.holes == [(16, 20)] and m.compute_from == 24 and m.matched == 24
    assert m.loads == [] and m.hit_tokens == 20 and m.n_tokens == 26
    assert len(m.spans[0].slots) == 16 and len(m.spans[1].slots) == 0
    # Ending inside the hole: trailing MISSING blocks are just new tokens, not holes.
    m = cache.match(a[:20])
    assert m.holes == [] and m.compute_from == 16 and m.recomputed == [(16, 20)]


def test_a_match_without_slots_reports_the_same_spans_and_no_slots():
    cache = KVCache(256, block_size=BS, policy="leaf-head-block")
    a = tokens(100, 16)
    for end in (16, 24):
        serve(cache, a[:end])
    cache.evict(4)
    for query in (a[:16], a):  # one GPU span; spans with a hole
        full, light = cache.match(query), cache.match(query, slots=False)
        assert [(s.start, s.end, s.state) for s in light.spans] == [(s.start, s.end, s.state) for s in full.spans]
        assert (light.holes, light.compute_from, light.matched) == (full.holes, full.compute_from, full.matched)
        assert all(len(s.slots) == 0 for s in light.spans) and len(full.spans[0].slots) == 16


def test_match_slots_are_the_inserted_slots():
    cache = KVCache(64, block_size=BS)
    a = tokens(100, 8)
    slots = cache.alloc(len(a))
    cache.insert(a, slots)
    m = cache.match(a)
    assert np.array_equal(m.spans[0].slots, slots)
    m.spans[0].slots[:] = -5  # a copy: the caller cannot corrupt the tree
    cache.check_invariants()


def test_insert_frees_duplicates_and_the_partial_block():
    cache = KVCache(64, block_size=BS)
    a = tokens(100, 8)
    first = cache.alloc(len(a) + 2)
    result = cache.insert(np.concatenate([a, [1, 2]]), first)
    assert (result.cached, result.new, result.freed) == (16, 16, 2)
    again = cache.alloc(len(a))
    result = cache.insert(a, again)
    assert (result.already_cached, result.new, result.freed) == (16, 0, 16)
    assert np.array_equal(cache.match(a).spans[0].slots, first[:16])
    assert cache.free_size() == 64 - 16
    cache.check_invariants()


def test_insert_with_the_matched_slots_frees_nothing():
    cache = KVCache(64, block_size=BS)
    a = tokens(100, 8)
    serve(cache, a)
    longer = np.concatenate([a, np.arange(500, 508)])
    m = cache.match(longer)
    result = cache.insert(longer, request_slots(m, len(longer), cache.alloc(8)))
    assert (result.already_cached, result.new, result.freed) == (16, 8, 0)
    cache.check_invariants()


def test_insert_refills_holes_with_the_new_slots():
    cache = KVCache(256, block_size=BS)
    a, b = tokens(100, 16), tokens(200, 8)
    serve(cache, a[:16])
    serve(cache, a)
    serve(cache, b)
    cache.evict(4)  # [8, 12) of A
    m = cache.match(a)
    assert m.holes == [(8, 12)]
    handle = cache.lock(m)
    new = cache.alloc(4)
    result = cache.insert(a, request_slots(m, len(a), new))
    cache.unlock(handle)
    assert (result.refilled, result.new, result.freed) == (4, 0, 0)
    assert np.array_equal(cache.match(a).spans[0].slots[8:12], new)
    cache.check_invariants()


def test_insert_given_its_fresh_match_does_what_walking_again_does():
    def run(with_match: bool):
        cache = KVCache(256, block_size=BS)
        a = tokens(100, 16)
        serve(cache, a[:12])
        serve(cache, a[:20])
        longer = np.concatenate([a, np.arange(500, 510)])
        m = cache.match(longer)
        result = cache.insert(longer, request_slots(m, len(longer), cache.alloc(len(longer) - 20)),
                              m if with_match else None)
        cache.check_invariants()
        return result, dump_real(cache), cache.free_size()

    assert run(True) == run(False)


def test_insert_given_a_match_the_tree_outgrew_walks_again():
    cache = KVCache(256, block_size=BS)
    a = tokens(100, 16)
    serve(cache, a[:12])
    m = cache.match(a)
    mine = request_slots(m, len(a), cache.alloc(len(a) - m.compute_from))
    # Another request caches the rest of the same tokens after the match was made.
    serve(cache, a)
    result = cache.insert(a, mine, m)
    assert (result.already_cached, result.new, result.freed) == (len(a), 0, len(a) - 12)
    assert len(shape(cache)) == 2
    cache.check_invariants()


def test_insert_given_a_stale_match_walks_again():
    cache = KVCache(256, block_size=BS)
    a = tokens(100, 16)
    serve(cache, a)
    m = cache.match(a)
    cache.evict(len(a))  # everything: the match's nodes are gone
    result = cache.insert(a, cache.alloc(len(a)), m)
    assert (result.already_cached, result.new, result.freed) == (0, len(a), 0)
    cache.check_invariants()


def test_insert_keeps_the_tree_prefix_without_reading_its_passed_slots():
    def run(garbage: bool):
        cache = KVCache(256, block_size=BS)
        a = tokens(100, 16)
        serve(cache, a[:12])
        serve(cache, a[:20])
        longer = np.concatenate([a, np.arange(500, 510)])
        m = cache.match(longer)
        assert m.compute_from == 20
        slots = request_slots(m, len(longer), cache.alloc(len(longer) - 20))
        if garbage:
            slots[:20] = -7  # not read: they are the tree's
        result = cache.insert(longer, slots, m, tree_prefix=20 if garbage else 0)
        cache.check_invariants()
        return result, dump_real(cache), cache.free_size()

    assert run(True) == run(False)


@pytest.mark.parametrize("hole", [False, True])
def test_keep_leading_keeps_the_leading_gpu_run_as_a_tree_prefix_would(hole):
    """`keep_leading` finds the leading GPU run itself: the passed slots there are not read, and
    the insert does what a fresh match's `tree_prefix` of that run does; `leading` is the run."""
    def run(keep: bool):
        cache = loaded_cache() if hole else KVCache(256, block_size=BS)
        a = tokens(100, 16)
        if not hole:
            serve(cache, a[:20])
        longer = np.concatenate([a, np.arange(500, 510)])
        m = cache.match(longer)
        run_end = m.spans[0].end
        new = sum(end - start for start, end in m.holes) + len(longer) - m.compute_from
        slots = request_slots(m, len(longer), cache.alloc(new))
        if keep:
            slots[:run_end] = -7  # not read: they are the tree's
            result = cache.insert(longer, slots, keep_leading=True)
        else:
            result = cache.insert(longer, slots, m, tree_prefix=run_end)
        cache.check_invariants()
        return run_end, result, dump_real(cache), cache.free_size()

    run_end, result, *_ = run(True)
    assert result.leading == run_end == (8 if hole else 20)
    assert run(True) == run(False)


def test_keep_leading_and_a_tree_prefix_are_one_or_the_other():
    cache = loaded_cache()
    a = tokens(100, 16)
    m = cache.match(a)
    slots = request_slots(m, len(a), cache.alloc(4 + len(a) - m.compute_from))
    before = snapshot(cache)
    with pytest.raises(UsageError, match="tree_prefix or keep_leading"):
        cache.insert(a, slots, m, tree_prefix=8, keep_leading=True)
    for flag in ("no", 1, np.array([1, 0]), None):
        with pytest.raises(UsageError, match="keep_leading must be True or False"):
            cache.insert(a, slots, keep_leading=flag)
    assert snapshot(cache) == before


@pytest.mark.parametrize("case", ["no match", "stale", "beyond"])
def test_a_tree_prefix_needs_a_fresh_match_whose_leading_gpu_span_covers_it(case):
    cache = loaded_cache()  # [8, 12) of tokens(100, 16) is a hole
    a = tokens(100, 16)
    m = cache.match(a)
    slots = request_slots(m, len(a), cache.alloc(4 + len(a) - m.compute_from))
    if case == "stale":
        cache.evict(4)
    before = snapshot(cache)
    with pytest.raises(UsageError, match="tree_prefix"):
        cache.insert(a, slots, None if case == "no match" else m, tree_prefix=20 if case == "beyond" else 16)
    assert snapshot(cache) == before


def test_insert_of_a_prefix_splits_the_node():
    cache = KVCache(64, block_size=BS)
    a = tokens(100, 8)
    serve(cache, a)
    serve(cache, a[:8])
    assert shape(cache) == [(0, 8, "GG"), (8, 16, "GG")]


def test_int64_arrays_are_used_without_a_copy():
    a = np.arange(100, dtype=np.int64)
    assert int_array(a, "tokens") is a
    assert int_array([1, 2], "tokens").dtype == np.int64
    assert int_array(np.arange(4, dtype=np.int32), "tokens").dtype == np.int64


def test_stats_count_hits_misses_and_recomputed_tokens_with_costs():
    cost = SumOfPositions()
    cache = KVCache(256, block_size=BS, cost_model=cost)
    a, b = tokens(100, 16), tokens(200, 8)
    serve(cache, a[:16])
    serve(cache, a)
    serve(cache, b)
    cache.evict(4)  # hole [8, 12) in A
    before = cache.stats.requests, cache.stats.hit_tokens, cache.stats.missed_tokens
    m, _ = serve(cache, np.concatenate([a, [9, 9, 9]]))
    stats = cache.stats
    assert m.recomputed == [(8, 12)]
    assert stats.requests - before[0] == 1
    assert stats.hit_tokens - before[1] == 20
    assert stats.missed_tokens - before[2] == 4 + 3
    assert stats.hole_tokens == 4 and stats.recomputed_tokens == 4
    assert stats.recomputed_cost == cost.span_cost(8, 12)
    assert stats.evicted_tokens == 4 and stats.evict_calls == 1 and stats.policy == "private-head-block"
    assert 0 < stats.hit_rate < 1


def test_a_request_that_is_not_admitted_is_not_counted():
    cache = KVCache(256, block_size=BS, cost_model=SumOfPositions())
    a = tokens(100, 16)
    serve(cache, a)
    before = dataclasses.replace(cache.stats)
    handle = cache.lock(cache.match(np.concatenate([a, [7, 7]])))
    assert cache.stats.requests == before.requests + 1
    # Its allocation failed: the scheduler gives the lock back and will retry later.
    cache.unlock(handle, admitted=False)
    assert cache.stats == before
    cache.check_invariants()


def test_stats_recognize_tokens_the_policy_deleted():
    cache = KVCache(256, block_size=BS, policy="sglang", cost_model=SumOfPositions())
    a = tokens(100, 16)
    serve(cache, a)
    cache.evict(10**6)  # SGLang deletes the nodes: nothing of A is left in the tree
    assert shape(cache) == []
    m, _ = serve(cache, np.concatenate([a, np.arange(500, 508)]))
    assert m.compute_from == 0 and m.recomputed == [(0, 24)]
    assert cache.stats.recomputed_tokens == 24
    untracked = KVCache(256, block_size=BS, policy="sglang", track_recompute=False)
    serve(untracked, a)
    untracked.evict(10**6)
    assert serve(untracked, a)[0].recomputed == []


def test_stats_with_the_real_cost_model():
    from penelope.costmodel.recompute import CostModel
    from penelope.costmodel.shapes import get_model

    cm = CostModel(get_model("qwen3-8b"))
    cache = KVCache(256, block_size=BS, cost_model=cm)
    a = tokens(100, 16)
    serve(cache, a)
    assert cache.stats.missed_cost == pytest.approx(cm.span_cost(0, 24))
    serve(cache, a)
    assert cache.stats.missed_cost == pytest.approx(cm.span_cost(0, 24))


def test_prefix_hashes_do_not_depend_on_how_a_sequence_is_cut():
    hasher = PrefixHasher(BS)
    t = np.arange(40, dtype=np.int64) * 7919
    whole = hasher.extend(0, 0, t)
    first = hasher.extend(0, 0, t[:12])
    rest = hasher.extend(int(first[-1]), 3, t[12:])
    assert np.array_equal(whole, np.concatenate([first, rest]))
    assert len(set(whole.tolist())) == 10


def reference_prefix_hashes(hasher: PrefixHasher, base: int, tokens: np.ndarray) -> list[int]:
    """The definition, on Python ints: H_i = H_{i-1} * R + d_i (mod 2**64), d_i = 1 + the block's
    tokens (as uint64) weighted by the hasher's mix."""
    mask, bs = (1 << 64) - 1, hasher.block_size
    mix = [int(m) for m in hasher._mix]
    out, h = [], base
    for i in range(len(tokens) // bs):
        block = [int(t) & mask for t in tokens[i * bs:(i + 1) * bs]]
        digest = (sum(t * m for t, m in zip(block, mix, strict=True)) + 1) & mask
        h = (h * PrefixHasher._RADIX + digest) & mask
        out.append(h)
    return out


@pytest.mark.parametrize("block_size", [1, 4, 64])
def test_prefix_hashes_of_short_and_long_runs_follow_the_definition(block_size):
    """Runs of up to 16 blocks are hashed on Python ints, longer ones vectorized: both give the
    recurrence's values, from any base, for tokens that fill all 64 bits."""
    hasher = PrefixHasher(block_size)
    rng = np.random.default_rng(5)
    for blocks in (1, 2, 15, 16, 17, 40):
        t = rng.integers(-2**63, 2**63 - 1, blocks * block_size, dtype=np.int64, endpoint=True)
        base_hash, base_block = int(rng.integers(0, 2**63)) * 2 + 1, int(rng.integers(0, 50))
        got = hasher.extend(base_hash, base_block, t)
        assert got.dtype == np.uint64
        assert got.tolist() == reference_prefix_hashes(hasher, base_hash, t), blocks


@pytest.mark.parametrize("kwargs, message", [
    ({"capacity": 3}, "below one block"),
    ({"capacity": 64, "policy": "lru"}, "unknown eviction policy 'lru'.*penelope.*sglang"),
    ({"capacity": 64, "block_size": 0}, "block_size"),
    ({"capacity": 64.0}, "capacity"),
    ({"capacity": 64, "cost_model": object()}, "span_cost"),
])
def test_bad_construction(kwargs, message):
    kwargs.setdefault("block_size", BS)
    with pytest.raises(UsageError, match=message):
        KVCache(**kwargs)


def loaded_cache():
    cache = KVCache(64, block_size=BS)
    serve(cache, tokens(100, 16))
    serve(cache, tokens(200, 8))
    cache.evict(4)
    return cache


@pytest.mark.parametrize("call, message", [
    (lambda c: c.match([1.5, 2.5, 3.5, 4.5]), "integers"),
    (lambda c: c.match(np.zeros((2, 4), dtype=np.int64)), "1-D"),
    (lambda c: c.match(np.array([True] * 4)), "integers"),
    (lambda c: c.match(["a", "b"]), "integers"),
    (lambda c: c.match([2**64 - 1]), "int64|integers"),
    (lambda c: c.alloc(65), "cannot allocate 65"),
    (lambda c: c.alloc(-1), "non-negative"),
    (lambda c: c.evict(2.0), "non-negative integer"),
    (lambda c: c.free(np.array([60])), "not handed out"),
    (lambda c: c.insert(tokens(100, 16), np.arange(23)), "24 tokens but 23 slots"),
    (lambda c: c.insert(tokens(300, 8), np.arange(40, 56)), "not handed out"),
    (lambda c: c.insert(tokens(300, 8), np.array([-1] * 16)), "outside the pool"),
    (lambda c: c.insert(tokens(300, 8), np.full(16, 64)), "outside the pool"),
    (lambda c: c.insert(np.arange(65), np.arange(65)), "never fit"),
    (lambda c: c.lock(c.match(np.arange(65))), "never fit"),
    (lambda c: c.lock("a match"), "MatchResult"),
    (lambda c: c.unlock(None), "handle"),
])
def test_bad_input_raises_and_leaves_the_cache_unchanged(call, message):
    cache = loaded_cache()
    before = snapshot(cache)
    with pytest.raises(UsageError, match=message):
        call(cache)
    after = snapshot(cache)
    # A match made to build the bad lock call bumps the clock; nothing else may change.
    assert after[:4] == before[:4] and after[5:] == before[5:]
    cache.check_invariants()


def test_insert_rejects_duplicate_and_cached_slots_without_changes():
    cache = loaded_cache()
    new = cache.alloc(16)
    before = snapshot(cache)
    dup = new.copy()
    dup[5] = dup[4]
    with pytest.raises(UsageError, match="appears twice"):
        cache.insert(tokens(300, 8), dup)
    cached = cache.match(tokens(200, 8)).spans[0].slots
    before = snapshot(cache)
    stolen = new.copy()
    stolen[12] = cached[0]  # a new position given a slot the tree holds
    with pytest.raises(UsageError, match="held by the cache"):
        cache.insert(tokens(300, 8), stolen)
    assert snapshot(cache) == before
    cache.insert(tokens(300, 8), new)
    cache.check_invariants()


def test_unlock_twice_and_foreign_handles():
    cache, other = loaded_cache(), loaded_cache()
    handle = cache.lock(cache.match(tokens(200, 8)))
    with pytest.raises(UsageError, match="handle"):
        other.unlock(handle)
    cache.unlock(handle)
    before = snapshot(cache)
    with pytest.raises(UsageError, match="already unlocked"):
        cache.unlock(handle)
    assert snapshot(cache) == before
    with pytest.raises(UsageError, match="MatchResult"):
        other.lock(cache.match(tokens(200, 8)))
    handle = cache.lock(cache.match(tokens(200, 8)))
    before = snapshot(cache)
    for admitted in ("no", None, 0):
        with pytest.raises(UsageError, match="admitted must be True or False"):
            cache.unlock(handle, admitted=admitted)
    assert snapshot(cache) == before and handle.active
    cache.unlock(handle, admitted=False)
    cache.check_invariants()


def test_a_match_is_stale_after_an_eviction():
    cache = loaded_cache()
    m = cache.match(tokens(200, 8))
    assert cache.is_fresh(m)
    cache.evict(4)
    assert not cache.is_fresh(m)
    with pytest.raises(UsageError, match="stale"):
        cache.lock(m)
    cache.lock(cache.match(tokens(200, 8)))
    cache.check_invariants()


def test_cache_full_when_everything_is_locked_leaves_the_cache_unchanged():
    cache = KVCache(32, block_size=BS)
    a = tokens(100, 8)
    serve(cache, a)
    handle = cache.lock(cache.match(a))
    held = cache.alloc(cache.free_size())
    before = snapshot(cache)
    with pytest.raises(CacheFullError, match="locked by running requests"):
        cache.alloc(4)
    assert snapshot(cache) == before
    cache.free(held)
    cache.unlock(handle)
    assert len(cache.alloc(32)) == 32  # everything evictable once unlocked
    cache.check_invariants()


@pytest.mark.parametrize("make", [lambda: KVCache(2**31 - 1, block_size=64),
                                  lambda: TwoTierCache(2**31 - 2**21, 2**20, block_size=64)])
def test_a_huge_alloc_is_checked_against_memory_first(monkeypatch, make):
    cache = make()
    serve(cache, tokens(100, 64 * 4))
    # `snapshot` lists every free slot: too many here.
    stack = cache.allocator._stack
    before = (dump_real(cache), cache.free_size(), cache.outstanding_size(), stack.fresh, stack.returned().tolist())
    # 2**23 slots need over 100 MiB; this machine is told it has 1 MiB left.
    monkeypatch.setattr(memory, "available_bytes", lambda: 2**20)
    for n in (2**23, 2**29):
        with pytest.raises(UsageError, match=f"allocating {n:,} slots: .* needed, more than the 1.0 MiB"):
            cache.alloc(n)
    assert (dump_real(cache), cache.free_size(), cache.outstanding_size(), stack.fresh,
            stack.returned().tolist()) == before
    assert len(cache.alloc(64)) == 64  # small allocations are not checked (no /proc read per call)
    cache.check_invariants()


def test_evict_zero_is_safe_and_evict_reports_slots():
    cache = loaded_cache()
    assert cache.evict(0).freed_tokens == 0
    result = cache.evict(8)
    assert result.freed_tokens == 8 and len(set(result.slots.tolist())) == 8
    assert all(cache.allocator._tags[result.slots] == 0)
    cache.check_invariants()


@pytest.mark.parametrize("corrupt, message", [
    (lambda c, n: setattr(n, "lock_ref", n.lock_ref + 1), "lock_ref"),
    (lambda c, n: n.state.__setitem__(0, int(BlockState.MISSING)), "MISSING block with a slot"),
    (lambda c, n: setattr(c.tree, "evictable_tokens", c.tree.evictable_tokens + 4), "accounting"),
    (lambda c, n: n.slots.__setitem__(0, n.slots[1]), "holds a slot twice"),
    (lambda c, n: setattr(n, "start", n.start + 4), "start"),
    (lambda c, n: c.tree.leaves.discard(n), "leaf set"),
    (lambda c, n: c.allocator._tags.__setitem__(int(n.slots[0]), 0), "tagged free"),
])
def test_check_invariants_detects_corruption(corrupt, message):
    cache = loaded_cache()
    cache.check_invariants()
    leaf = next(n for n in cache.tree.nodes() if not n.children and n.n_gpu == n.n_blocks)
    corrupt(cache, leaf)
    with pytest.raises(InvariantError, match=message):
        cache.check_invariants()
