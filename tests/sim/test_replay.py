"""The replay's event loop: closed- and open-loop timing on tiny workloads with hand-computed
TTFTs, session concurrency, and the real cache's effect on realistic traces."""

import dataclasses

import numpy as np
import pytest
from sim_env import COST, DECODE_STEP, OVERHEAD, PER_PAIR, PER_TOKEN, request, simple_time_model, workload
from trace_paths import WEKA_TRACES

from penelope.cache.manager import KVCache
from penelope.sim.analysis import unbounded_hit_rate
from penelope.sim.metrics import session_jcts, summarize
from penelope.sim.replay import Replay, decode_step_times
from penelope.sim.timemodel import TimeModel
from penelope.sim.workloads.weka import load_weka

B = 64
TRACES = WEKA_TRACES




def prefill(*spans):
    """Hand-computed seconds of one prefill batch computing position `spans`."""
    tokens = sum(b - a for a, b in spans)
    pairs = sum(sum(range(a, b)) for a, b in spans)
    return OVERHEAD + PER_TOKEN * tokens + PER_PAIR * pairs






def run(work, capacity=4096, policy="sglang", **options):
    cache = KVCache(capacity, B, policy, cost_model=COST)
    result = Replay(work, cache, simple_time_model(), COST, **options).run()
    cache.check_invariants()
    return result, {(r.session, r.index): r for r in result.records}


def test_closed_loop_single_session_by_hand():
    work = workload(
        [
            [
                request([1, 2], 130, 3, tail=0),
                request([1, 2, 3, 4], 260, 1, think=5.0, tail=1),
            ]
        ]
    )
    result, records = run(work)
    first, second = records["s0", 0], records["s0", 1]
    ttft0 = prefill((0, 130))
    assert first.send_time == 0 and first.ttft == pytest.approx(ttft0, abs=1e-12)
    # Two more output tokens: two decode steps.
    assert first.finish_time == pytest.approx(ttft0 + 2 * DECODE_STEP, abs=1e-12)
    # Sent after the reply plus the think time; blocks 1, 2 are reused, 128..260 computed.
    assert second.send_time == pytest.approx(first.finish_time + 5.0, abs=1e-12)
    assert second.ttft == pytest.approx(prefill((128, 260)), abs=1e-12)
    assert second.finish_time == second.first_token_time
    assert (first.reused_tokens, second.reused_tokens) == (0, 128)
    assert session_jcts(result.records)["s0"] == pytest.approx(second.finish_time, abs=1e-12)
    assert summarize(result.records).hit_rate == pytest.approx(128 / 390)
    assert (result.prefill_batches, result.decode_steps) == (2, 2)


def test_chunked_prefill_batches_two_sessions_by_hand():
    work = workload([[request([1, 2], 130, 1, tail=0)], [request([3], 70, 1, tail=1)]])
    result, records = run(work, chunk_size=100, order="fcfs")
    batch1 = prefill((0, 100))
    batch2 = prefill((100, 130), (0, 70))
    assert records["s0", 0].ttft == pytest.approx(batch1 + batch2, abs=1e-12)
    assert records["s1", 0].ttft == pytest.approx(batch1 + batch2, abs=1e-12)
    assert result.prefill_batches == 2 and result.prefill_tokens == 200


def test_a_request_arriving_during_prefill_is_prefilled_before_decode_resumes():
    work = workload([[request([1], 64, 5, arrival=0.0, tail=0)], [request([], 32, 3, arrival=0.05, tail=1)]], False)
    result, records = run(work)
    a_first = prefill((0, 64))
    b_first = a_first + prefill((0, 32))
    assert records["s0", 0].ttft == pytest.approx(a_first, abs=1e-12)
    assert records["s1", 0].ttft == pytest.approx(b_first - 0.05, abs=1e-12)
    # Then both decode together: b needs 2 steps, a 4.
    assert records["s1", 0].finish_time == pytest.approx(b_first + 2 * DECODE_STEP, abs=1e-12)
    assert records["s0", 0].finish_time == pytest.approx(b_first + 4 * DECODE_STEP, abs=1e-12)
    assert result.decode_steps == 4


def test_a_request_arriving_during_decode_waits_for_the_step_to_finish():
    work = workload([[request([1], 64, 10, arrival=0.0, tail=0)], [request([], 32, 1, arrival=0.1, tail=1)]], False)
    _, records = run(work)
    a_first = prefill((0, 64))
    # Steps end at a_first + 11, 22, 33 ms; 0.1 s falls in the third step.
    steps_before = 3
    assert a_first + 2 * DECODE_STEP < 0.1 < a_first + 3 * DECODE_STEP
    b_first = a_first + steps_before * DECODE_STEP + prefill((0, 32))
    assert records["s1", 0].ttft == pytest.approx(b_first - 0.1, abs=1e-12)
    assert records["s0", 0].finish_time == pytest.approx(b_first + (9 - steps_before) * DECODE_STEP, abs=1e-12)


def test_sessions_limit_concurrency_and_the_next_session_starts_when_one_ends():
    work = workload(
        [
            [request([1], 64, 1, tail=0), request([1, 2], 128 + 5, 1, think=2.0, tail=1)],
            [request([7], 64, 1, tail=2)],
        ]
    )
    _, records = run(work, sessions=1)
    assert records["s1", 0].send_time == pytest.approx(records["s0", 1].finish_time, abs=1e-12)
    _, together = run(work, sessions=2)
    assert together["s1", 0].send_time == 0.0


def test_a_request_that_never_fits_is_skipped_counted_and_the_session_goes_on():
    work = workload([[request([1], 64, 1, tail=0), request(list(range(1, 10)), 9 * B, 1, think=1.0, tail=1),
                      request([1, 2], 130, 1, think=3.0, tail=2)]])
    result, records = run(work, capacity=4 * B)
    assert result.skipped == 1 and len(result.records) == 2
    # The skipped request counts as done at its send time; the next is sent 3 s later.
    skipped_send = records["s0", 0].finish_time + 1.0
    assert records["s0", 2].send_time == pytest.approx(skipped_send + 3.0, abs=1e-12)


def test_a_batch_that_refills_a_hole_runs_on_the_phantom_kernel():
    # Session 0's history (4 blocks) loses one block while session 1 runs; its next request
    # refills it. Penelope evicts the front, so the batch holds a phantom hole [0, 64) and the
    # new tokens [256, 320); SGLang evicts the tail and recomputes [64, 320) contiguously.
    work = workload([
        [request([1, 2, 3, 4], 256, 1, tail=0), request([1, 2, 3, 4, 5], 320, 1, think=50.0, tail=1)],
        [request([11, 12, 13], 192, 1, tail=2)],
    ])
    outcome = {}
    for kernel in ("fa3", "triton"):
        model = simple_time_model(phantom_kernel=kernel, triton_pair_ratio=1.5)
        for policy in ("sglang", "penelope"):
            cache = KVCache(7 * B, B, policy, cost_model=COST)
            result = Replay(work, cache, model, COST, sessions=2, order="fcfs").run()
            outcome[kernel, policy] = result, {(r.session, r.index): r for r in result.records}
    penelope, records = outcome["triton", "penelope"]
    assert penelope.phantom_batches == 1 and penelope.phantom_tokens == 64
    assert records["s0", 1].ttft == pytest.approx(
        OVERHEAD + PER_TOKEN * 128 + 1.5 * PER_PAIR * (sum(range(0, 64)) + sum(range(256, 320))), abs=1e-12
    )
    assert outcome["fa3", "penelope"][1]["s0", 1].ttft == pytest.approx(prefill((0, 64), (256, 320)), abs=1e-12)
    # SGLang never refills a hole: the kernel choice does not change its replay.
    for key in (("s0", 0), ("s1", 0), ("s0", 1)):
        assert outcome["fa3", "sglang"][1][key] == outcome["triton", "sglang"][1][key]
    assert outcome["triton", "sglang"][0].phantom_batches == 0


def test_decode_step_times_match_the_time_model_step_by_step():
    for name in ("qwen3-8b", "gemma-3-27b", "qwen3-235b-a22b", "gpt-oss-20b"):
        model = TimeModel.estimate(name)
        times = decode_step_times(model, 3, 20_000, 50)
        expected = [model.decode_step_time(3, 20_000 + 3 * k) for k in range(50)]
        np.testing.assert_allclose(times, expected, rtol=1e-12)


def test_without_eviction_every_policy_reuses_exactly_the_unbounded_cache_hits():
    work = load_weka(TRACES / "trace_0008.json", max_context=128 * 1024)
    # One session: the replay's order is the session's, the same as the unbounded analysis.
    hits = unbounded_hit_rate(work)
    requests = [r for s in work.sessions for r in s.requests]
    # Room for every distinct block plus the largest running request: nothing is ever evicted.
    distinct = len({k for r in requests for k in r.keys.tolist()})
    capacity = B * distinct + max(r.input_tokens + r.output_tokens for r in requests) + B
    for policy in ("sglang", "penelope"):
        result, _ = run(work, capacity=capacity, policy=policy)
        assert result.records and not result.skipped
        # The replay never matches a prompt's last token; that block is counted by the analysis
        # only when the input is a whole number of blocks.
        exact = sum(
            B for s in work.sessions for r in s.requests if r.input_tokens % B == 0 and r.n_blocks
        )
        reused = sum(r.reused_tokens for r in result.records)
        assert hits["hit_tokens"] - exact <= reused <= hits["hit_tokens"]
        assert all(r.recomputed_tokens == 0 for r in result.records)


@pytest.fixture(scope="module")
def weka_pressure():
    work = load_weka(TRACES, max_context=128 * 1024, overflow="skip")
    return dataclasses.replace(work, sessions=work.sessions[:8])


def test_under_pressure_penelope_recomputes_less_and_its_phantoms_refill_holes(weka_pressure):
    model = TimeModel.estimate("qwen3-8b")
    outcome = {}
    for policy in ("sglang", "penelope"):
        cache = KVCache(128 * 1024, B, policy, cost_model=COST)
        result = Replay(weka_pressure, cache, model, COST, sessions=4).run()
        cache.check_invariants()
        assert cache.protected_size() == 0 and cache.allocator.outstanding_size() == 0
        outcome[policy] = (summarize(result.records), result)
    sglang, penelope = outcome["sglang"][0], outcome["penelope"][0]
    assert sglang.requests == penelope.requests == weka_pressure.num_requests
    assert outcome["sglang"][1].phantom_tokens == 0 and outcome["penelope"][1].phantom_tokens > 0
    # Front eviction keeps the expensive tail: less recompute cost per recomputed token.
    assert penelope.recompute_cost / penelope.recomputed_tokens < sglang.recompute_cost / sglang.recomputed_tokens
    for s in (sglang, penelope):
        assert 0 < s.hit_rate < 1 and s.ttft_p50 <= s.ttft_p90
