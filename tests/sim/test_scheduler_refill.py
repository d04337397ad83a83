"""The simulator's scheduler as the SGLang plugin runs: holes refilled by `penelope.cache.refill`'s
rule (phantoms or hole-first chunks), prefill batches under SGLang's chunk and `max_prefill_tokens`
budgets in whole pages with request rows, and replies cached where the workload names them."""

import numpy as np
import pytest
from sim_env import sim_request, simple_time_model

from penelope.cache.manager import KVCache
from penelope.cache.refill import plan_refill
from penelope.costmodel.recompute import CostModel
from penelope.costmodel.shapes import get_model
from penelope.errors import UsageError
from penelope.sim.replay import Replay
from penelope.sim.scheduler import Job, Scheduler
from penelope.sim.workloads.types import Session, Workload, WorkloadSummary, reply_tokens, request_tokens

B = 64
HISTORY = [1, 2, 3, 4, 5, 6]


def make_request(keys, input_tokens, output_tokens=1, index=0, output_blocks=None):
    return sim_request(keys, input_tokens, output_tokens, tail_key=10**6 + index, source=f"request {index}",
                       output_blocks=output_blocks)


def make_job(keys, input_tokens, output_tokens=1, index=0, send_time=0.0):
    request = make_request(keys, input_tokens, output_tokens, index)
    return Job(f"s{index}", index, request, send_time, request_tokens(request, B))


def cache_with_holes(holes, keys=HISTORY, cache=None, recent=()):
    """A Penelope cache (new, or `cache`) holding the whole blocks `keys` but the blocks of `holes`
    ((first, end) block indexes, all before the last block): the front of the history evicted,
    then the blocks between the holes refilled. `recent`: token arrays of histories `cache` holds
    already, made more recent first so that the eviction takes this history's front."""
    cache = cache if cache is not None else KVCache(64 * B, B, "penelope")
    tokens = request_tokens(make_request(keys, len(keys) * B), B)
    cache.insert(tokens, cache.alloc(len(tokens)))
    if recent:
        cache.advance(1.0)
        for other in recent:
            cache.match(other)
    front = holes[-1][1]
    cache.evict(front * B)
    match = cache.match(tokens)
    assert match.holes == [(0, front * B)]
    missing = {block for first, end in holes for block in range(first, end)}
    handle = cache.lock(match)
    for block in range(front):
        if block not in missing:
            cache.refill(handle, block * B, cache.alloc(B))
    cache.unlock(handle)
    want = [(first * B, end * B) for first, end in holes]
    assert cache.match(tokens).holes == want
    return cache, want


def run_to_end(scheduler: Scheduler) -> list:
    """Every chunk of every prefill batch until nothing is left, batch by batch."""
    batches = []
    while scheduler.has_work():
        batches.append(scheduler.form_prefill())
        assert batches[-1], "no progress"
    return batches


def test_holes_that_fit_beside_a_page_of_new_tokens_ride_in_the_request_batch():
    cache, holes = cache_with_holes([(0, 1), (2, 3)])
    scheduler = Scheduler(cache, "fcfs", chunk_size=4096)
    job = make_job(HISTORY + [7], 7 * B + 4)
    scheduler.submit(job)
    [chunk] = scheduler.form_prefill()
    assert chunk.phantoms == tuple(holes) and chunk.last
    assert chunk.segments == ((0, B), (2 * B, 3 * B), (6 * B, 7 * B + 4))
    assert chunk.phantom_tokens == 2 * B and chunk.chunk_refill_tokens == 0
    assert job.plan == plan_refill(holes, 6 * B, B + 4, 4096, 2048, 1)
    cache.check_invariants()


@pytest.mark.parametrize("rows", [3, 4])
def test_phantoms_hold_rows_in_their_batch(rows):
    """The request and its two phantoms take three rows: a fourth lets the next request join."""
    cache, holes = cache_with_holes([(0, 1), (2, 3)])
    scheduler = Scheduler(cache, "fcfs", chunk_size=4096, max_running_requests=rows)
    job = make_job(HISTORY + [7], 7 * B + 4)
    other = make_job([20], 10, index=1, send_time=1.0)
    scheduler.submit(job)
    scheduler.submit(other)
    batch = scheduler.form_prefill()
    assert batch[0].phantoms == tuple(holes)
    assert [c.job for c in batch] == ([job] if rows == 3 else [job, other])


def test_a_hole_larger_than_the_chunk_is_refilled_first_and_no_resident_span_is_computed():
    cache, holes = cache_with_holes([(0, 2), (3, 4)])
    scheduler = Scheduler(cache, "fcfs", chunk_size=B)
    job = make_job(HISTORY + [7], 7 * B + 4)
    scheduler.submit(job)
    batches = run_to_end(scheduler)
    segments = [s for batch in batches for chunk in batch for s in chunk.segments]
    # Chunks stop at hole ends and jump the resident [2B, 3B) and [4B, 6B).
    assert segments == [(0, B), (B, 2 * B), (3 * B, 4 * B), (6 * B, 7 * B), (7 * B, 7 * B + 4)]
    assert all(not chunk.phantoms for batch in batches for chunk in batch)
    assert sum(chunk.chunk_refill_tokens for batch in batches for chunk in batch) == 3 * B
    cache.check_invariants()


@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("rows", [1, 2, 3, 2048])
@pytest.mark.parametrize("chunk", [B, 2 * B, 3 * B + 64, 4096])
def test_the_plan_is_refill_py_s_and_exactly_the_holes_and_new_tokens_are_computed(chunk, rows, page):
    """Against `plan_refill` called directly with the batch's chunk budget, its free rows and the
    page size, and against the positions a request must compute: its holes and its new tokens,
    each once, never a resident one, no batch over its chunk budget."""
    cache, holes = cache_with_holes([(0, 2), (3, 4)])
    scheduler = Scheduler(cache, "fcfs", chunk_size=chunk, page_size=page, max_running_requests=rows)
    n = 7 * B + 5
    job = make_job(HISTORY + [7], n)
    scheduler.submit(job)
    batches = run_to_end(scheduler)
    assert job.plan == plan_refill(holes, 6 * B, n - 6 * B, chunk, rows, page)
    computed = [p for batch in batches for chunk_ in batch for a, b in chunk_.segments for p in range(a, b)]
    want = [p for a, b in holes for p in range(a, b)] + list(range(6 * B, n))
    assert sorted(computed) == want
    for batch in batches:
        charged = sum(-(-(c.tokens - c.phantom_tokens) // page) * page + c.phantom_tokens for c in batch)
        assert charged <= chunk
    phantoms = sum(c.phantom_tokens for batch in batches for c in batch)
    refilled = sum(c.chunk_refill_tokens for batch in batches for c in batch)
    assert (phantoms, refilled) == ((3 * B, 0) if job.plan.phantoms else (0, 3 * B))
    cache.check_invariants()


def test_without_free_rows_for_the_phantoms_the_request_goes_hole_first():
    """Two holes need three rows; decoding requests hold all but two."""
    cache, holes = cache_with_holes([(0, 1), (2, 3)])
    scheduler = Scheduler(cache, "fcfs", chunk_size=4096, max_running_requests=10)
    job = make_job(HISTORY + [7], 7 * B + 4)
    scheduler.submit(job)
    [chunk] = scheduler.form_prefill(running=8)
    assert job.plan.hole_first and chunk.phantoms == () and chunk.segments == ((0, B),)
    assert job.plan == plan_refill(holes, 6 * B, B + 4, 4096, 2, 1)


def test_no_free_row_admits_nothing_but_the_continuing_request_runs():
    cache = KVCache(64 * B, B, "sglang")
    scheduler = Scheduler(cache, "fcfs", chunk_size=B, max_running_requests=2)
    long = make_job([1, 2], 2 * B + 1)
    short = make_job([3], 10, index=1)
    scheduler.submit(long)
    scheduler.submit(short)
    assert [c.job for c in scheduler.form_prefill(running=1)] == [long]
    # One row for the decoding request, one for the cut one: `short` waits.
    assert [c.job for c in scheduler.form_prefill(running=1)] == [long]
    assert scheduler.waiting == [short]
    # Its last token leaves budget, but its row and the decoding one are all there are.
    [last] = scheduler.form_prefill(running=1)
    assert last.job is long and last.last and scheduler.waiting == [short]
    assert scheduler.form_prefill(running=2) == [] and scheduler.waiting == [short]
    assert [c.job for c in scheduler.form_prefill(running=1)] == [short]


def test_after_a_hole_first_cut_only_requests_that_fit_whole_join_the_batch():
    """The hole-first request stops at its hole's end with budget left: a short request joins
    whole; a longer one would be cut too, and one request at a time continues, so it waits."""
    cache, holes = cache_with_holes([(0, 1), (2, 3)])
    # The holes (2B) and a page of new tokens do not fit a chunk of 2B: hole-first.
    scheduler = Scheduler(cache, "fcfs", chunk_size=2 * B)
    holed = make_job(HISTORY + [7], 7 * B + 4)
    short = make_job([20], 10, index=1, send_time=1.0)
    longer = make_job([30, 31, 32], 3 * B, index=2, send_time=2.0)
    for job in (holed, short, longer):
        scheduler.submit(job)
    batch = scheduler.form_prefill()
    assert [(c.job, c.segments, c.last) for c in batch] == [(holed, ((0, B),), False), (short, ((0, 10),), True)]
    assert scheduler.chunked is holed and scheduler.waiting == [longer]
    # Next batch: the hole-first request jumps [B, 2B) and stops at the second hole's end.
    batch = scheduler.form_prefill()
    assert [(c.job, c.segments) for c in batch][0] == (holed, ((2 * B, 3 * B),))


@pytest.mark.parametrize(("rows", "extend", "joins"), [(3, 10, True), (3, B + 10, False), (2, 10, False)])
def test_after_a_cut_a_request_with_holes_joins_only_whole_with_its_phantoms(rows, extend, joins):
    """`holed` (three holes) has no rows for its phantoms: it goes hole-first and leaves 2B of the
    chunk. `other` (one hole of B) joins with its phantom when the hole and its whole extend fit
    that budget and a row is left for the phantom; otherwise it would be cut or go hole-first, and
    waits."""
    keys = [1, 2, 3, 4, 5, 6, 7, 8]
    cache, holes = cache_with_holes([(0, 1), (2, 3), (4, 5)], keys=keys)
    history = request_tokens(make_request(keys, len(keys) * B), B)
    cache, other_holes = cache_with_holes([(0, 1)], keys=[11, 12, 13, 14, 15, 16], cache=cache, recent=[history])
    scheduler = Scheduler(cache, "fcfs", chunk_size=3 * B, max_running_requests=rows)
    holed = make_job(keys + [9], 9 * B + 4)
    other = make_job([11, 12, 13, 14, 15, 16, 17], 6 * B + extend, index=1, send_time=1.0)
    scheduler.submit(holed)
    scheduler.submit(other)
    batch = scheduler.form_prefill()
    assert batch[0].job is holed and batch[0].segments == ((0, B),) and holed.plan.hole_first
    if joins:
        assert [(c.job, c.phantoms, c.segments, c.last) for c in batch[1:]] == [
            (other, tuple(other_holes), ((0, B), (6 * B, 6 * B + extend)), True)]
    else:
        assert len(batch) == 1 and scheduler.waiting == [other]
    assert scheduler.chunked is holed


def test_max_prefill_tokens_stops_admission_once_spent():
    for limit, batches in ((100, [["a"], ["b"]]), (16384, [["a", "b"]])):
        scheduler = Scheduler(KVCache(64 * B, B, "sglang"), "fcfs", chunk_size=8192, max_prefill_tokens=limit)
        a = make_job([1, 2], 2 * B + 2)  # 130 tokens: joins whole, spending the limit of 100
        b = make_job([3], B + 6, index=1, send_time=1.0)
        scheduler.submit(a)
        scheduler.submit(b)
        got = [[c.job.session for c in batch] for batch in run_to_end(scheduler)]
        assert got == [[name.replace("a", "s0").replace("b", "s1") for name in batch] for batch in batches]


def test_budgets_are_charged_whole_pages_and_cuts_stop_at_page_boundaries():
    """Chunk 64: `a` (70 tokens) is cut at 64; next batch its 6 tokens cost a page of 16, `b`
    (40 tokens) costs 48, and `c` (10 tokens) finds no budget left. With pages of one token, `c`
    joins (6 + 40 + 10 <= 64)."""
    for page, second in ((16, ["s0", "s1"]), (1, ["s0", "s1", "s2"])):
        scheduler = Scheduler(KVCache(64 * B, B, "sglang"), "fcfs", chunk_size=64, page_size=page)
        jobs = [make_job([1], 70), make_job([2], 40, index=1, send_time=1.0), make_job([3], 10, index=2, send_time=2.0)]
        for job in jobs:
            scheduler.submit(job)
        [first] = scheduler.form_prefill()
        assert first.segments == ((0, 64),) and not first.last
        assert [c.job.session for c in scheduler.form_prefill()] == second


def test_bad_limits_are_refused():
    cache = KVCache(4 * B, B)
    with pytest.raises(UsageError, match="page size 48 must divide"):
        Scheduler(cache, page_size=48)
    with pytest.raises(UsageError, match="page size 16 must divide .* chunk size 100"):
        Scheduler(cache, chunk_size=100, page_size=16)
    with pytest.raises(UsageError, match="max prefill tokens"):
        Scheduler(cache, max_prefill_tokens=0)
    with pytest.raises(UsageError, match="max running requests"):
        Scheduler(cache, max_running_requests=0)


def test_reply_tokens_continue_the_input_blocks():
    """Input 2B + 10, reply 2B: blocks [1, 2] then [7, 8, 9]; the tail's tokens start block 7."""
    request = make_request([1, 2], 2 * B + 10, 2 * B, output_blocks=[7, 8, 9])
    tokens, reply = request_tokens(request, B), reply_tokens(request, B)
    sequence = np.concatenate([k * B + np.arange(B) for k in (1, 2, 7, 8, 9)])
    assert np.array_equal(tokens, sequence[: 2 * B + 10]) and np.array_equal(reply, sequence[2 * B + 10: 4 * B + 10])
    assert reply_tokens(make_request([1, 2], 2 * B + 10, 2 * B), B) is None
    with pytest.raises(UsageError, match="do not name"):
        request_tokens(make_request([1, 2], 2 * B + 10, 2 * B, output_blocks=[7, 8]), B)
    with pytest.raises(UsageError, match="do not name"):
        request_tokens(make_request([1, 2, 3], 2 * B + 10, 2 * B, output_blocks=[7, 8]), B)
    with pytest.raises(UsageError, match="output_blocks"):
        make_request([1], B, 1, output_blocks=[[1]])


@pytest.mark.parametrize("named", [True, False])
def test_a_named_reply_is_cached_at_finish_and_matched_by_the_next_turn(named):
    """Turn 1: input 2B + 10, reply 2B - 10 (KV of all but its last token: 4B - 1 tokens, 3 whole
    blocks). Turn 2 holds turn 1's prompt and reply: it finds 3 blocks resident where the reply
    was named, the 2 input blocks where it was not."""
    blocks = [7, 8] if named else None
    first = make_request([1, 2], 2 * B + 10, 2 * B - 10, index=0, output_blocks=blocks)
    second = make_request([1, 2, 7, 8, 9, 10], 6 * B, 1, index=1)
    session = Session("s", (first, second))
    workload = Workload((session,), B, True, WorkloadSummary("synthetic"))
    cache = KVCache(64 * B, B, "sglang")
    result = Replay(workload, cache, simple_time_model(), CostModel(get_model("qwen3-8b")), sessions=1).run()
    assert [r.reused_tokens for r in result.records] == [0, 3 * B if named else 2 * B]
    cache.check_invariants()


def test_replay_counts_phantom_and_hole_first_tokens_apart():
    """A history whose front was evicted (a hole of two blocks), then its next turn: with a chunk
    that holds the hole beside the new tokens it rides (phantom tokens), with a smaller one the
    request computes it hole-first (chunk refill tokens)."""
    for chunk, want in ((4096, (2 * B, 0, 1)), (B, (0, 2 * B, 0))):
        cache, _ = cache_with_holes([(0, 2)])
        turn = make_request(HISTORY + [7], 7 * B + 4, 1, index=1)
        workload = Workload((Session("s", (turn,)),), B, True, WorkloadSummary("synthetic"))
        result = Replay(workload, cache, simple_time_model(), CostModel(get_model("qwen3-8b")), sessions=1,
                        chunk_size=chunk).run()
        assert (result.phantom_tokens, result.chunk_refill_tokens, result.phantom_batches) == want


def test_decoding_requests_hold_rows_in_a_replay():
    """One request row: the second session's request is admitted only once the first finished
    decoding; with two rows, it joins the first's batch."""
    sessions = tuple(Session(f"s{i}", (make_request([10 * i + 1], B + 1, 5, index=i),)) for i in range(2))
    workload = Workload(sessions, B, True, WorkloadSummary("synthetic"))
    for rows in (1, 2):
        result = Replay(workload, KVCache(64 * B, B, "sglang"), simple_time_model(), CostModel(get_model("qwen3-8b")),
                        sessions=2, max_running_requests=rows).run()
        first, second = sorted(result.records, key=lambda r: r.session)
        if rows == 1:
            assert second.admit_time == first.finish_time
        else:
            assert second.admit_time == first.admit_time
