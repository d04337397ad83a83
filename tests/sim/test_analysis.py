"""`penelope analyze`'s figures on hand-made workloads and records."""

import numpy as np
import pytest

from penelope.commands.progress import progress_bar
from penelope.sim.analysis import reuse_distances, reuse_summary, shared_prefix, unbounded_hit_rate
from penelope.sim.metrics import RequestRecord
from penelope.sim.workloads.types import HUMAN, Request, Session, Workload, WorkloadSummary

B = 64


def request(keys, input_tokens, arrival=None):
    return Request(np.asarray(keys, dtype=np.int64), input_tokens, 1, 0.0, arrival, HUMAN, 10**9, "test")


def workload(sessions, closed_loop=True):
    sessions = tuple(Session(f"s{i}", tuple(reqs)) for i, reqs in enumerate(sessions))
    return Workload(sessions, B, closed_loop, WorkloadSummary(format="test"))


def test_shared_prefix_by_hand():
    work = workload([[request([0, 1, 2, 10], 4 * B)], [request([0, 1, 2, 20], 4 * B)], [request([0, 1, 5], 3 * B)]])
    # All three share blocks 0, 1; the first two share three blocks.
    assert shared_prefix(work) == {"all_sessions": 2 * B, "pairwise_p50": 3 * B, "pairwise_max": 3 * B}
    assert shared_prefix(workload([[request([1], B)]]))["all_sessions"] == 0


def test_unbounded_hit_rate_counts_leading_runs_in_send_order():
    work = workload([[request([1, 2], 130), request([1, 2, 3], 200)], [request([1, 9], 128)]])
    # s0 r1 reuses 2 blocks; s1 r0 reuses block 1 only (its second block differs).
    result = unbounded_hit_rate(work)
    assert result["hit_tokens"] == 3 * B and result["input_tokens"] == 458
    assert result["hit_rate"] == pytest.approx(192 / 458)
    # Open loop: by arrival, so the later request is the one that reuses.
    late_first = workload([[request([1, 2, 3], 200, arrival=5.0)], [request([1, 2], 130, arrival=1.0)]], False)
    assert unbounded_hit_rate(late_first)["hit_tokens"] == 2 * B


def test_reuse_distance_by_hand():
    def record(session, index, send, input_tokens):
        return RequestRecord(session, index, send, send, send, input_tokens, 0)

    records = [record("a", 0, 0, 100), record("b", 0, 1, 300), record("c", 0, 2, 200), record("b", 1, 3, 400),
               record("a", 1, 4, 150)]
    distances = reuse_distances(records[::-1], shared_tokens=50)
    # b1: c0 in between (200 - 50); a1: b at its largest (400 - 50) and c (200 - 50).
    assert distances == [(300, 150), (100, 500)]
    summary = reuse_summary(distances, shared_tokens=50, capacity=600)
    assert summary["reuses"] == 2 and summary["p50"] == 325 and summary["max"] == 500
    # 50 + 300 + 150 = 500 fits 600; 50 + 100 + 500 = 650 does not.
    assert summary["lru_fit"] == 0.5


def test_progress_bar_only_on_a_terminal(monkeypatch):
    monkeypatch.setattr("sys.stderr.isatty", lambda: False)
    assert progress_bar(10, disabled=False) is None
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    bar = progress_bar(10, disabled=False)
    assert bar is not None and bar.total == 10
    bar.close()
    assert progress_bar(10, disabled=True) is None
