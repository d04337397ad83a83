"""The simulator's scheduler: admission through the real cache, order, chunked prefill, release."""

import numpy as np
import pytest
from sim_env import B, make_job, simple_time_model

from penelope.cache.manager import KVCache
from penelope.costmodel.recompute import CostModel
from penelope.costmodel.shapes import get_model
from penelope.errors import CacheFullError, UsageError
from penelope.sim.scheduler import Scheduler
from penelope.sim.server import Server
from penelope.sim.workloads.types import request_tokens


def cache_with_history(capacity, keys, policy="sglang"):
    """A cache holding the whole blocks `keys`, unlocked."""
    cache = KVCache(capacity, B, policy)
    tokens = request_tokens(make_job(keys, len(keys) * B).request, B)
    cache.insert(tokens, cache.alloc(len(tokens)))
    return cache


def test_admission_allocates_every_computed_token_and_the_reply_and_locks_the_path():
    cache = cache_with_history(1024, [1, 2, 3])
    scheduler = Scheduler(cache, "fcfs")
    job = make_job([1, 2, 3, 4], 4 * B + 10, output_tokens=20)
    scheduler.submit(job)
    [chunk] = scheduler.form_prefill()
    # Resident: 3 blocks; computed: block 4 and the 10 tail tokens; reply: 20.
    assert chunk.segments == ((3 * B, 4 * B + 10),) and chunk.last
    assert job.reused == 3 * B and job.recomputed == []
    assert len(job.out_slots) == 20 and len(job.slots) == 4 * B + 10
    assert cache.protected_size() == 3 * B and cache.evictable_size() == 0
    assert cache.free_size() == 1024 - 3 * B - (B + 10) - 20
    # Resident positions keep their cached slots, the rest are fresh and distinct.
    assert np.array_equal(job.slots[: 3 * B], cache.match(job.tokens[: 3 * B]).spans[0].slots)
    assert len(np.unique(np.concatenate([job.slots, job.out_slots]))) == 4 * B + 10 + 20
    cache.check_invariants()


def test_a_request_waits_until_its_kv_fits_and_blocks_those_behind_it():
    cache = KVCache(8 * B, B, "sglang")
    scheduler = Scheduler(cache, "fcfs")
    running = make_job([10, 11, 12, 13], 4 * B + 5, output_tokens=B, session="a")
    big = make_job([20, 21, 22], 3 * B + 5, output_tokens=B, send_time=1.0, session="bb")
    small = make_job([30], B + 1, output_tokens=1, send_time=2.0, session="ccc")
    scheduler.submit(running)
    assert [c.job for c in scheduler.form_prefill()] == [running]
    # running holds 4B+5 + B slots; 8B - 5B - 5 = 3B - 5 free < 3B + 5 + B for `big`.
    scheduler.submit(big)
    scheduler.submit(small)
    assert scheduler.form_prefill() == []
    # `small` would fit, but FCFS stops at the first request that does not (as SGLang does).
    assert scheduler.waiting == [big, small]
    # The running request's KV is locked: even a direct allocation cannot evict it.
    with pytest.raises(CacheFullError):
        cache.alloc(4 * B)
    scheduler.release(running)
    cache.check_invariants()
    chunks = scheduler.form_prefill()
    assert [c.job for c in chunks] == [big, small]
    # Admitting `big` evicted the finished request's cached blocks through the cache.
    assert cache.stats.evicted_tokens > 0
    cache.check_invariants()


def test_admission_evicts_unlocked_kv_but_never_a_running_path():
    cache = cache_with_history(6 * B, [1, 2, 3, 4])
    scheduler = Scheduler(cache, "fcfs")
    first = make_job([1, 2], 2 * B + 3, output_tokens=1, session="a")
    scheduler.submit(first)
    scheduler.form_prefill()
    # Blocks 1, 2 are locked by `first`; blocks 3, 4 are evictable.
    assert cache.protected_size() == 2 * B and cache.evictable_size() == 2 * B
    second = make_job([7, 8], 2 * B + 1, output_tokens=B - 1, session="bb")
    scheduler.submit(second)
    [chunk] = scheduler.form_prefill()
    assert chunk.job is second
    assert cache.match(first.tokens[:-1]).hit_tokens == 2 * B
    assert cache.match(request_tokens(make_job([1, 2, 3, 4], 4 * B).request, B)).hit_tokens < 4 * B
    cache.check_invariants()


def test_lpm_admits_the_longest_resident_match_first_and_fcfs_the_earliest():
    for order, expected in (("lpm", ["late", "early"]), ("fcfs", ["early", "late"])):
        cache = cache_with_history(4096, [1, 2, 3, 4, 5])
        scheduler = Scheduler(cache, order)
        early = make_job([50, 51], 2 * B + 1, send_time=0.0, session="early")
        late = make_job([1, 2, 3, 4, 5, 6], 6 * B + 1, send_time=1.0, session="late")
        scheduler.submit(early)
        scheduler.submit(late)
        assert [c.job.session for c in scheduler.form_prefill()] == expected


def test_chunked_prefill_cuts_one_request_and_continues_it_first():
    cache = KVCache(4096, B, "sglang")
    scheduler = Scheduler(cache, "fcfs", chunk_size=100)
    a = make_job([1, 2], 2 * B + 2, session="a")  # 130 tokens
    b = make_job([3], B + 6, send_time=0.5, session="bb")  # 70 tokens
    scheduler.submit(a)
    scheduler.submit(b)
    [first] = scheduler.form_prefill()
    assert first.job is a and first.segments == ((0, 100),) and not first.last
    assert scheduler.chunked is a and scheduler.waiting == [b]
    second = scheduler.form_prefill()
    assert [(c.job, c.segments, c.last) for c in second] == [(a, ((100, 130),), True), (b, ((0, 70),), True)]
    assert not scheduler.has_work()


def test_holes_larger_than_the_chunk_are_refilled_hole_first():
    # Penelope evicts the front of a private history: a hole the next request must refill.
    cache = cache_with_history(8 * B, [1, 2, 3, 4, 5], policy="penelope")
    cache.evict(2 * B)
    holes = cache.match(request_tokens(make_job([1, 2, 3, 4, 5], 5 * B).request, B)).holes
    assert holes == [(0, 2 * B)]
    scheduler = Scheduler(cache, "fcfs", chunk_size=B)
    job = make_job([1, 2, 3, 4, 5, 6], 6 * B + 4)
    scheduler.submit(job)
    [chunk] = scheduler.form_prefill()
    # The hole does not fit the chunk beside a page of new tokens: no phantoms, the request computes
    # the hole itself, a chunk at a time, then jumps the resident [2B, 5B).
    assert job.plan.hole_first and chunk.phantoms == ()
    assert chunk.segments == ((0, B),) and not chunk.last
    assert chunk.chunk_refill_tokens == B and chunk.phantom_tokens == 0
    assert job.recomputed[: len(holes)] == holes
    [rest] = scheduler.form_prefill()
    assert rest.segments == ((B, 2 * B),) and rest.chunk_refill_tokens == B
    segments = []
    while scheduler.has_work():
        segments += [s for c in scheduler.form_prefill() for s in c.segments]
    assert segments == [(5 * B, 6 * B), (6 * B, 6 * B + 4)]
    cache.check_invariants()


def test_release_inserts_the_prompt_frees_the_reply_and_unlocks():
    cache = KVCache(1024, B, "sglang")
    scheduler = Scheduler(cache, "fcfs")
    job = make_job([1, 2, 3], 3 * B + 7, output_tokens=9)
    tokens = job.tokens.copy()
    scheduler.submit(job)
    scheduler.form_prefill()
    scheduler.release(job)
    cache.check_invariants()
    assert cache.protected_size() == 0 and cache.evictable_size() == 3 * B
    assert cache.free_size() == 1024 - 3 * B
    assert cache.match(tokens).hit_tokens == 3 * B


def test_a_request_that_can_never_fit_is_refused():
    scheduler = Scheduler(KVCache(4 * B, B, "sglang"))
    with pytest.raises(UsageError, match="can never fit"):
        scheduler.submit(make_job([1, 2, 3], 3 * B + 10, output_tokens=B))
    with pytest.raises(UsageError, match="scheduler"):
        Scheduler(KVCache(4 * B, B), order="random")
    with pytest.raises(UsageError, match="chunk size"):
        Scheduler(KVCache(4 * B, B), chunk_size=0)


def test_a_cut_prompt_is_cached_chunk_by_chunk_and_stays_locked():
    cache = KVCache(4096, B, "sglang-lru")
    scheduler = Scheduler(cache, "fcfs", chunk_size=2 * B)
    job = make_job([1, 2, 3, 4, 5], 5 * B + 9, output_tokens=3)
    scheduler.submit(job)
    ends = []
    while scheduler.has_work():
        [chunk] = scheduler.form_prefill()
        if not chunk.last:
            scheduler.checkpoint(job)
            ends.append(chunk.segments[-1][1])
            cache.check_invariants()
            # What it computed is in the tree, locked: none of it can be evicted.
            assert cache.protected_size() == ends[-1] and cache.evictable_size() == 0
    assert ends == [2 * B, 4 * B]
    requests = cache.stats.requests
    scheduler.release(job)
    cache.check_invariants()
    assert cache.stats.requests == requests == 1
    # One node a chunk, as SGLang's tree after its checkpoints: a whole-leaf policy frees the last.
    assert sorted((node.start, node.end) for node in cache.tree.nodes() if node is not cache.tree.root) \
        == [(0, 2 * B), (2 * B, 4 * B), (4 * B, 5 * B)]
    assert cache.evict(1).ranges == [(4 * B, 5 * B)]


def test_a_checkpoint_takes_the_trees_copy_of_kv_another_request_cached_meanwhile():
    cache = KVCache(4096, B, "penelope")
    scheduler = Scheduler(cache, "fcfs", chunk_size=2 * B)
    a = make_job([1, 2, 3], 3 * B + 1, session="a")
    scheduler.submit(a)
    [first] = scheduler.form_prefill()
    assert first.segments == ((0, 2 * B),) and not first.last
    # Another request computed and cached the same blocks while a's first chunk ran.
    cache.insert(a.tokens[:3 * B], cache.alloc(3 * B))
    free = cache.free_size()
    scheduler.checkpoint(a)
    cache.check_invariants()
    # a's two computed blocks were duplicates: freed, and a reads the tree's copy from now on.
    assert cache.free_size() == free + 2 * B
    np.testing.assert_array_equal(a.slots[:2 * B], cache.match(a.tokens[:2 * B]).spans[0].slots)
    [last] = scheduler.form_prefill()
    assert last.last
    scheduler.release(a)
    cache.check_invariants()
    assert cache.protected_size() == 0 and cache.evictable_size() == 3 * B


def test_the_server_checkpoints_a_cut_prompt_when_its_chunk_has_run():
    cache = KVCache(4096, B, "sglang-lru")
    server = Server(0, cache, simple_time_model(), CostModel(get_model("qwen3-8b")), order="fcfs", chunk_size=2 * B)
    job = make_job([1, 2, 3], 3 * B + 5, output_tokens=2)
    server.receive(job, 0.0)
    assert server.start() and not any(chunk.last for chunk in server.action)
    assert cache.protected_size() == 0
    server.complete()
    cache.check_invariants()
    assert cache.protected_size() == 2 * B and cache.match(job.tokens[:2 * B]).hit_tokens == 2 * B
