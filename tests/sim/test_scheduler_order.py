"""The scheduler's order (ties, holes) and admission with loads from a CPU tier, against a slow
reference written from the rules in `penelope/sim/scheduler.py`'s docstring:

- LPM ranks waiting requests by the tokens the cache holds for their prompt less its last token
  (resident anywhere on the GPU, holes excluded), longest first; ties by send time, then by
  arrival (submission) order. FCFS: by send time, then arrival.
- A request is admitted while its computed tokens, its reply and the CPU-tier tokens it loads fit
  in what is free plus evictable; the first that does not fit stops admission.
- Loads are charged to the first chunk only, and loaded positions read GPU slots after admission.
"""

import random

import pytest
from sim_env import B, make_job

from penelope.cache.manager import KVCache
from penelope.cache.tiers import TwoTierCache
from penelope.cache.tree import BlockState
from penelope.sim.scheduler import Scheduler
from penelope.sim.workloads.types import request_tokens


def resident_tokens(cache, job) -> int:
    """Slow reference: GPU-resident positions of the prompt less its last token, block by block."""
    prompt = job.tokens[:-1]
    spans = cache.match(prompt).spans
    return sum(span.end - span.start for span in spans if span.state == BlockState.GPU)


def reference_order(cache, jobs, order: str) -> list:
    if order == "fcfs":
        return sorted(jobs, key=lambda job: (job.send_time, job.seq))
    resident = {id(job): resident_tokens(cache, job) for job in jobs}
    return sorted(jobs, key=lambda job: (-resident[id(job)], job.send_time, job.seq))


def test_ties_go_to_the_earliest_send_then_the_earliest_arrival():
    cache = KVCache(4096, B, "sglang")
    shared = request_tokens(make_job([1, 2, 3], 3 * B).request, B)
    cache.insert(shared, cache.alloc(len(shared)))
    scheduler = Scheduler(cache, "lpm")
    # Same resident prefix (3 blocks) for all; send times 2, 1, 1, 0 but submitted in this order.
    jobs = [make_job([1, 2, 3, 10 + i], 4 * B + 1, send_time=t, session="s" * (i + 1), index=i)
            for i, t in enumerate([2.0, 1.0, 1.0, 0.0])]
    for job in jobs:
        scheduler.submit(job)
    admitted = [chunk.job for chunk in scheduler.form_prefill()]
    assert admitted == [jobs[3], jobs[1], jobs[2], jobs[0]]


def test_a_request_behind_a_hole_ranks_by_what_is_resident_not_by_its_first_run():
    """Penelope's eviction leaves a hole at the front of a private history: the request still has
    more resident tokens than one whose only resident run is longer than its first run."""
    cache = KVCache(64 * B, B, "penelope")
    long_history = request_tokens(make_job([1, *range(100, 110)], 11 * B).request, B)
    cache.insert(long_history, cache.alloc(len(long_history)))
    short_history = request_tokens(make_job([1, 2, 3, 4], 4 * B).request, B)
    cache.insert(short_history, cache.alloc(len(short_history)))
    # Evict the front of the long private history: blocks 100, 101 become a hole.
    for _ in range(2):
        cache.evict(B)
    behind_hole = make_job([1, *range(100, 110), 500], 12 * B + 1, send_time=1.0, session="hole")
    contiguous = make_job([1, 2, 3, 4, 600], 5 * B + 1, send_time=0.0, session="run")
    match = cache.match(behind_hole.tokens[:-1])
    assert match.holes and match.holes[0][0] == B  # the hole is right after the shared block
    first_run = match.spans[0].end
    assert first_run < resident_tokens(cache, contiguous) < resident_tokens(cache, behind_hole)
    scheduler = Scheduler(cache, "lpm")
    scheduler.submit(contiguous)
    scheduler.submit(behind_hole)
    assert [chunk.job for chunk in scheduler.form_prefill()] == [behind_hole, contiguous]


@pytest.mark.parametrize("order", ["lpm", "fcfs"])
@pytest.mark.parametrize("seed", range(12))
def test_admission_order_matches_the_slow_reference(order, seed):
    """Random caches and queues: everything fits, so the batch is the whole queue in order."""
    rng = random.Random(seed)
    cache = KVCache(256 * B, B, rng.choice(["sglang", "penelope"]))
    for h in range(rng.randint(1, 5)):
        keys = [1] * rng.randint(0, 1) + [1000 * (h + 1) + k for k in range(rng.randint(1, 12))]
        tokens = request_tokens(make_job(keys, len(keys) * B, session=f"h{h}").request, B)
        cache.insert(tokens, cache.alloc(len(tokens)))
    for _ in range(rng.randint(0, 6)):
        cache.evict(B)
    jobs = []
    for i in range(rng.randint(2, 9)):
        h = rng.randint(0, 6)
        keys = [1000 * (h + 1) + k for k in range(rng.randint(0, 12))] + [50_000 + i]
        send = float(rng.randint(0, 3))
        jobs.append(make_job(keys, len(keys) * B + rng.randint(1, 30), send_time=send, session=f"j{i}", index=i))
    scheduler = Scheduler(cache, order, chunk_size=10**9)
    for job in jobs:
        scheduler.submit(job)
    expected = reference_order(cache, jobs, order)
    assert [chunk.job for chunk in scheduler.form_prefill()] == expected
    cache.check_invariants()


def two_tier_with_demoted_history(gpu_blocks=8, cpu_blocks=8):
    """A two-tier cache whose GPU tier was filled twice: the first history is on the CPU tier."""
    cache = TwoTierCache(gpu_blocks * B, cpu_blocks * B, block_size=B, policy="penelope", swap_buffer=B)
    first = request_tokens(make_job(list(range(1, 7)), 6 * B, session="old").request, B)
    cache.insert(first, cache.alloc(len(first)))
    second = request_tokens(make_job(list(range(101, 107)), 6 * B, session="new").request, B)
    cache.insert(second, cache.alloc(len(second)))
    return cache


def test_loads_are_charged_to_the_first_chunk_and_read_gpu_slots():
    cache = two_tier_with_demoted_history()
    job = make_job([*range(1, 7), 9], 7 * B + 1, session="old")
    match = cache.match(job.tokens[:-1])
    to_load = sum(len(span) for span in match.loads)
    assert to_load > 0
    scheduler = Scheduler(cache, "fcfs", chunk_size=B // 2)
    scheduler.submit(job)
    [first] = scheduler.form_prefill()
    assert first.loaded == to_load and job.loaded == to_load
    second = scheduler.form_prefill()
    assert [chunk.loaded for chunk in second] == [0]
    # Every prompt position now has a distinct GPU slot.
    gpu = set(cache.tree.slots_in(BlockState.GPU).tolist()) | set(job.slots.tolist())
    assert set(job.slots.tolist()) <= gpu and len(set(job.slots.tolist())) == len(job.slots)
    cache.check_invariants()


def test_a_request_whose_loads_do_not_fit_waits_and_changes_nothing():
    cache = two_tier_with_demoted_history(gpu_blocks=10)
    job = make_job([*range(1, 7), 9], 7 * B + 1, output_tokens=B, session="old")
    # Hold the rest of the GPU tier for a running request, so the load cannot get its slots.
    running = make_job(list(range(101, 107)) + [300], 7 * B, output_tokens=B, session="run")
    scheduler = Scheduler(cache, "fcfs")
    scheduler.submit(running)
    assert [c.job for c in scheduler.form_prefill()] == [running]
    need = sum(len(s) for s in cache.match(job.tokens[:-1]).loads) + (B + 1) + B
    assert need > cache.free_size() + cache.evictable_size()
    before = (cache.free_size(), cache.evictable_size(), cache.protected_size(), cache.cpu_free_size(),
              sorted((n.start, n.key, n.state.tolist(), n.lock_ref) for n in cache.tree.nodes()))
    scheduler.submit(job)
    assert scheduler.form_prefill() == []
    assert scheduler.waiting == [job]
    after = (cache.free_size(), cache.evictable_size(), cache.protected_size(), cache.cpu_free_size(),
             sorted((n.start, n.key, n.state.tolist(), n.lock_ref) for n in cache.tree.nodes()))
    assert after == before
    scheduler.release(running)
    [chunk] = scheduler.form_prefill()
    assert chunk.job is job and chunk.loaded > 0
    cache.check_invariants()


def test_admission_stops_at_the_first_request_that_does_not_fit_even_if_a_later_one_would():
    cache = KVCache(8 * B, B, "sglang")
    scheduler = Scheduler(cache, "fcfs")
    jobs = [make_job([10 + i, 20 + i, 30 + i], 3 * B + 1, output_tokens=B, send_time=float(i),
                     session="x" * (i + 1), index=i) for i in range(2)]
    tiny = make_job([99], 2, output_tokens=1, send_time=5.0, session="tiny")
    for job in (*jobs, tiny):
        scheduler.submit(job)
    admitted = [chunk.job for chunk in scheduler.form_prefill()]
    # 2 x (3B+1 + B) > 8B: the second does not fit, and the tiny one behind it waits too.
    assert admitted == [jobs[0]] and scheduler.waiting == [jobs[1], tiny]


def test_resident_tokens_not_the_end_of_the_last_resident_span_decide():
    """The other side of the hole rule: a request whose resident span ends later (after a hole)
    but holds fewer resident tokens goes after one holding more."""
    cache = KVCache(64 * B, B, "penelope")
    long_history = request_tokens(make_job([1, 100, 101, 102, 103], 5 * B).request, B)
    cache.insert(long_history, cache.alloc(len(long_history)))
    short_history = request_tokens(make_job([1, 2, 3, 4], 4 * B).request, B)
    cache.insert(short_history, cache.alloc(len(short_history)))
    for _ in range(2):
        cache.evict(B)
    behind_hole = make_job([1, 100, 101, 102, 103, 500], 6 * B + 1, send_time=0.0, session="hole")
    contiguous = make_job([1, 2, 3, 4, 600], 5 * B + 1, send_time=1.0, session="run")
    match = cache.match(behind_hole.tokens[:-1])
    assert match.holes == [(B, 3 * B)] and match.compute_from == 5 * B
    assert resident_tokens(cache, behind_hole) == 3 * B < resident_tokens(cache, contiguous) == 4 * B
    scheduler = Scheduler(cache, "lpm")
    scheduler.submit(behind_hole)
    scheduler.submit(contiguous)
    assert [chunk.job for chunk in scheduler.form_prefill()] == [contiguous, behind_hole]
