"""Metric arithmetic on tiny cases computed by hand."""

import math
import random

import pytest

from penelope.errors import UsageError
from penelope.sim.metrics import RequestRecord, changes_against, percentile, session_jcts, summarize


def records():
    return [
        RequestRecord(
            "s1", 0, send_time=0.0, first_token_time=1.0, finish_time=3.0, input_tokens=100, reused_tokens=50
        ),
        RequestRecord(
            "s1",
            1,
            send_time=5.0,
            first_token_time=7.0,
            finish_time=8.0,
            input_tokens=200,
            reused_tokens=150,
            recomputed_tokens=20,
            recompute_cost=1000.0,
            loaded_tokens=64,
            swap_loads=1,
        ),
        RequestRecord(
            "s2", 0, send_time=1.0, first_token_time=5.0, finish_time=6.0, input_tokens=100, reused_tokens=0
        ),
    ]


def test_percentile_interpolates_between_closest_ranks():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([4, 1, 3, 2], 90) == pytest.approx(3.7)
    assert percentile([1, 2, 3, 4], 0) == 1 and percentile([1, 2, 3, 4], 100) == 4
    assert percentile([7.0], 90) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(UsageError):
        percentile([1, 2], 101)


def test_summary_by_hand():
    summary = summarize(records())
    # TTFTs 1, 2, 4: mean 7/3; p50 2; p90 at rank 1.8 -> 2 + 0.8 * (4 - 2) = 3.6.
    assert summary.requests == 3 and summary.sessions == 2
    assert summary.ttft_mean == pytest.approx(7 / 3)
    assert summary.ttft_p50 == 2.0
    assert summary.ttft_p90 == pytest.approx(3.6)
    # JCT: s1 from 0 to 8, s2 from 1 to 6 -> 8 and 5.
    assert session_jcts(records()) == {"s1": 8.0, "s2": 5.0}
    assert summary.jct_mean == 6.5 and summary.jct_p50 == 6.5
    assert summary.jct_p90 == pytest.approx(5 + 0.9 * 3)
    # Hit rate is token-weighted: 200 reused of 400 input tokens (not the mean of 0.5, 0.75, 0).
    assert summary.hit_rate == 0.5
    assert (summary.input_tokens, summary.reused_tokens) == (400, 200)
    assert summary.recomputed_tokens == 20 and summary.recompute_cost == 1000.0
    assert summary.loaded_tokens == 64 and summary.swap_loads == 1
    assert summary.as_dict()["ttft_p50"] == 2.0


def test_summary_ignores_record_order():
    shuffled = records()
    random.Random(0).shuffle(shuffled)
    assert summarize(shuffled) == summarize(records())


def test_empty_summary():
    summary = summarize([])
    assert summary.requests == 0 and summary.sessions == 0
    assert math.isnan(summary.ttft_mean) and math.isnan(summary.hit_rate) and math.isnan(summary.jct_p90)


def test_changes_against_the_baseline():
    base = summarize(records())
    faster = summarize(
        [
            RequestRecord("s1", 0, 0.0, 0.5, 2.0, 100, 80),
            RequestRecord("s1", 1, 4.0, 5.0, 6.0, 200, 190),
            RequestRecord("s2", 0, 1.0, 3.0, 4.0, 100, 30),
        ]
    )
    changes = changes_against({"sglang": base, "penelope": faster})
    assert changes["sglang"]["ttft_mean"] == 0.0
    # TTFTs 0.5, 1, 2: mean 3.5/3 against 7/3 -> -50%.
    assert changes["penelope"]["ttft_mean"] == pytest.approx(-0.5)
    # JCTs 6 and 3: mean 4.5 against 6.5.
    assert changes["penelope"]["jct_mean"] == pytest.approx(4.5 / 6.5 - 1)
    # Hit rate 300/400 against 200/400: +25 points.
    assert changes["penelope"]["hit_rate_points"] == pytest.approx(25.0)
    assert math.isnan(changes["penelope"]["recomputed_tokens"]) is False
    assert changes["penelope"]["recomputed_tokens"] == pytest.approx(-1.0)
    with pytest.raises(UsageError, match="baseline policy 'lru'"):
        changes_against({"penelope": faster}, baseline="lru")


@pytest.mark.parametrize(
    "fields",
    [
        {"send_time": 2.0, "first_token_time": 1.0, "finish_time": 3.0},
        {"first_token_time": 4.0, "finish_time": 3.0},
        {"reused_tokens": 101},
        {"reused_tokens": -1},
        {"recomputed_tokens": -3},
    ],
)
def test_inconsistent_records_are_rejected(fields):
    values = {
        "send_time": 0.0,
        "first_token_time": 1.0,
        "finish_time": 3.0,
        "input_tokens": 100,
        "reused_tokens": 50,
    }
    values.update(fields)
    with pytest.raises(UsageError, match="request 0 of session 's'"):
        RequestRecord("s", 0, **values)
