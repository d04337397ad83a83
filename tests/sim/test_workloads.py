"""The workload model (`penelope.sim.workloads.types`): request tokens from keys, workload statistics on
the WEKA traces, think-time modes, loading by format, and request validation."""
import numpy as np
import pytest
from trace_paths import WEKA_TRACES
from workload_helpers import CONTEXT_128K, common_prefix, write_jsonl

from penelope.errors import UsageError
from penelope.sim.workloads.load import load_workload
from penelope.sim.workloads.types import (
    HUMAN,
    TOOL,
    Request,
    Session,
    ThinkTime,
    Workload,
    WorkloadSummary,
    request_tokens,
    workload_stats,
)
from penelope.sim.workloads.weka import load_weka

TRACES = WEKA_TRACES


@pytest.fixture(scope="module")
def weka():
    return load_weka(TRACES)


def test_request_tokens_expand_keys_and_keep_tails_unique(weka):
    session = weka.sessions[0]
    a, b = session.requests[3], session.requests[4]
    tokens_a, tokens_b = request_tokens(a, 64), weka.tokens(b)
    assert tokens_a.dtype == np.int64 and tokens_a.shape == (a.input_tokens,)
    full = a.n_blocks * 64
    expected = (a.keys[:, None] * 64 + np.arange(64)).reshape(-1)
    assert np.array_equal(tokens_a[:full], expected)
    assert np.array_equal(tokens_a[full:], a.tail_key * 64 + np.arange(a.input_tokens - full))
    shared_blocks = common_prefix(a.keys, b.keys)
    assert common_prefix(tokens_a, tokens_b) == shared_blocks * 64
    # Tail tokens never occur among another request's tokens.
    others = np.concatenate([weka.tokens(r) for r in session.requests[:10] if r is not a])
    assert not np.isin(tokens_a[full:], others).any()


def test_request_tokens_partial_last_key():
    request = Request(
        keys=np.array([7, 9], dtype=np.int64),
        input_tokens=5,
        output_tokens=1,
        think_time=0.0,
        arrival=0.0,
        kind=HUMAN,
        tail_key=100,
        source="t",
    )
    assert request_tokens(request, 4).tolist() == [28, 29, 30, 31, 36]
    no_keys = Request(
        keys=np.zeros(0, dtype=np.int64),
        input_tokens=3,
        output_tokens=1,
        think_time=0.0,
        arrival=None,
        kind=TOOL,
        tail_key=5,
        source="t",
    )
    assert request_tokens(no_keys, 4).tolist() == [20, 21, 22]


def test_weka_stats_match_the_readme_facts(weka):
    stats = workload_stats(weka)
    # README: previous request's ids a full prefix of the next in 91% of transitions (whole set),
    # tool waits median 8 s / p90 67 s, human waits median 131 s, inputs p50 104K (whole set).
    assert 0.85 < stats["extension_fraction"] < 0.97
    assert 0.005 < stats["compaction_fraction"] < 0.05
    assert 5 <= stats["tool_wait_p50"] <= 10
    assert 40 <= stats["tool_wait_p90"] <= 90
    assert 90 <= stats["human_wait_p50"] <= 200


def tiny_workload():
    def request(think, kind):
        return Request(
            keys=np.zeros(0, dtype=np.int64),
            input_tokens=10,
            output_tokens=1,
            think_time=think,
            arrival=None,
            kind=kind,
            tail_key=1,
            source="t",
        )

    sessions = (
        Session("a", (request(0.0, HUMAN), request(2.0, TOOL), request(500.0, HUMAN), request(10.0, TOOL))),
        Session("b", (request(0.0, TOOL), request(4.0, TOOL), request(3000.0, HUMAN))),
    )
    return Workload(sessions=sessions, block_size=64, closed_loop=True, summary=WorkloadSummary("test"))


def test_think_time_modes_by_hand():
    workload = tiny_workload()
    waits = lambda w: [[r.think_time for r in s.requests] for s in w.sessions]  # noqa: E731
    assert ThinkTime().apply(workload) is workload
    # Tool waits after the first request: 2, 10, 4 -> median 4 replaces the human waits.
    assert waits(ThinkTime(mode="tool").apply(workload)) == [[0.0, 2.0, 4.0, 10.0], [0.0, 4.0, 4.0]]
    assert waits(ThinkTime(scale=0.5).apply(workload)) == [[0.0, 1.0, 250.0, 5.0], [0.0, 2.0, 1500.0]]
    assert waits(ThinkTime(scale=2.0, cap=100.0).apply(workload)) == [
        [0.0, 4.0, 100.0, 20.0],
        [0.0, 8.0, 100.0],
    ]
    # The original is unchanged.
    assert waits(workload) == [[0.0, 2.0, 500.0, 10.0], [0.0, 4.0, 3000.0]]
    for bad in ({"mode": "human"}, {"scale": -1.0}, {"cap": -2.0}, {"scale": float("nan")}):
        with pytest.raises(UsageError):
            ThinkTime(**bad)


def test_load_workload_dispatches_by_format(tmp_path):
    weka = load_workload("weka", TRACES / "trace_0008.json", max_context=CONTEXT_128K)
    assert weka.summary.format == "weka" and len(weka.sessions) == 1
    path = write_jsonl(
        tmp_path / "m.jsonl", [{"timestamp": 0, "input_length": 64, "output_length": 1, "hash_ids": [1]}]
    )
    assert load_workload("mooncake", path, block_size=64).num_requests == 1
    synthetic = load_workload("synthetic", seed=3, sessions=2, requests_per_session=5)
    assert len(synthetic.sessions) == 2 and synthetic.summary.sources == ["synthetic(seed=3)"]
    with pytest.raises(UsageError, match="unknown workload format"):
        load_workload("sharegpt", path)
    with pytest.raises(UsageError, match="`format` weka needs a `trace`"):
        load_workload("weka")
    with pytest.raises(UsageError, match="`format` synthetic takes no `trace`$"):
        load_workload("synthetic", path)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"keys": np.zeros((1, 2), dtype=np.int64)}, "1-D int64"),
        ({"keys": np.zeros(2, dtype=np.int32)}, "1-D int64"),
        ({"input_tokens": -1}, "non-negative"),
        ({"think_time": float("nan")}, "non-negative"),
        ({"kind": "robot"}, "kind must be one of"),
    ],
)
def test_request_rejects_bad_fields(fields, message):
    values = dict(
        keys=np.zeros(0, dtype=np.int64),
        input_tokens=1,
        output_tokens=1,
        think_time=0.0,
        arrival=None,
        kind=TOOL,
        tail_key=1,
        source="here",
    )
    values.update(fields)
    with pytest.raises(UsageError, match=f"here: .*{message}"):
        Request(**values)
