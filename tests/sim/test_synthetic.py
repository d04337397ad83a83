"""The synthetic workload reproduces the paper's Claude Code statistics, measured on the output."""

import numpy as np
import pytest

from penelope.errors import UsageError
from penelope.sim.workloads.synthetic import SyntheticConfig, generate
from penelope.sim.workloads.types import HUMAN, SESSION_KEY_STRIDE, TOOL, session_key_base, workload_stats

SHARED_BLOCKS = 15_600 // 64


@pytest.fixture(scope="module", params=[0, 1, 2])
def workload(request):
    return generate(SyntheticConfig(seed=request.param))


def test_matches_the_papers_statistics(workload):
    stats = workload_stats(workload)
    # Paper: 24 sessions, 4,688 requests (about 195 each), per-turn context median about 80K.
    assert stats["sessions"] == 24
    assert 180 <= stats["requests_per_session"] <= 210
    assert 72_000 <= stats["input_p50"] <= 88_000
    assert stats["input_max"] <= 128 * 1024
    # About 3% compactions; the other transitions extend the history.
    assert 0.02 <= stats["compaction_fraction"] <= 0.04
    assert stats["extension_fraction"] + stats["compaction_fraction"] == pytest.approx(1.0)
    # WEKA waits: tool median 8 s, p90 67 s; human median 131 s for a small fraction of turns.
    assert 6.5 <= stats["tool_wait_p50"] <= 9.5
    assert 55 <= stats["tool_wait_p90"] <= 80
    assert 100 <= stats["human_wait_p50"] <= 170
    assert 0.05 <= stats["human_fraction"] <= 0.11
    # Agent outputs: a few hundred tokens.
    assert 150 <= stats["output_p50"] <= 400


def test_history_structure(workload):
    for index, session in enumerate(workload.sessions):
        base = session_key_base(index)
        first = session.requests[0]
        assert first.kind == HUMAN and first.think_time == 0.0
        for request in session.requests:
            keys = request.keys
            assert keys.shape == (request.input_tokens // 64,) and keys.dtype == np.int64
            assert not keys.flags.writeable
            # The 15.6K prefix is the shared id space; everything else is the session's own.
            assert np.array_equal(keys[:SHARED_BLOCKS], np.arange(SHARED_BLOCKS))
            private = keys[SHARED_BLOCKS:]
            assert np.all((private >= base) & (private < base + SESSION_KEY_STRIDE // 2))
            assert request.kind in (HUMAN, TOOL) and request.think_time >= 0
            assert 1 <= request.output_tokens <= 8192
        for a, b in zip(session.requests, session.requests[1:], strict=False):
            n = min(a.n_blocks, b.n_blocks)
            differ = np.flatnonzero(a.keys[:n] != b.keys[:n])
            kept = int(differ[0]) if differ.size else n
            if kept == a.n_blocks:
                # Extension: the context grew by the previous output plus new input.
                assert b.input_tokens >= a.input_tokens + a.output_tokens
            else:
                # Compaction: only the shared prefix survives.
                assert kept == SHARED_BLOCKS


def test_private_blocks_never_collide_across_sessions(workload):
    private = [
        np.unique(np.concatenate([r.keys[SHARED_BLOCKS:] for r in s.requests])) for s in workload.sessions
    ]
    everything = np.concatenate(private)
    assert np.unique(everything).size == everything.size
    tails = [r.tail_key for _, _, r in workload.requests()]
    assert len(set(tails)) == len(tails) and not np.isin(tails, everything).any()


def test_seeded_and_sessions_independent():
    a = generate(SyntheticConfig(seed=7))
    b = generate(SyntheticConfig(seed=7))
    c = generate(SyntheticConfig(seed=8))
    few = generate(SyntheticConfig(seed=7, sessions=3))

    def fingerprint(session):
        return [
            (r.input_tokens, r.output_tokens, r.think_time, r.kind, r.keys.tolist()) for r in session.requests
        ]

    assert [fingerprint(s) for s in a.sessions] == [fingerprint(s) for s in b.sessions]
    assert fingerprint(a.sessions[0]) != fingerprint(c.sessions[0])
    # Adding sessions does not change the earlier ones.
    assert [fingerprint(s) for s in few.sessions] == [fingerprint(s) for s in a.sessions[:3]]


def test_smaller_window_still_respected():
    workload = generate(SyntheticConfig(sessions=4, max_context=64 * 1024, summary_median=8_000.0))
    assert max(r.input_tokens for _, _, r in workload.requests()) <= 64 * 1024
    assert workload_stats(workload)["compaction_fraction"] > 0.03


@pytest.mark.parametrize(
    "override",
    [
        {"sessions": 0},
        {"requests_per_session": -1},
        {"requests_spread": 1.0},
        {"human_fraction": 1.5},
        {"tool_wait_p90": 4.0},
        {"compaction_range": (0.5, 1.2)},
        {"max_context": 32 * 1024},
    ],
)
def test_invalid_configs_are_rejected(override):
    with pytest.raises(UsageError, match="synthetic workload"):
        SyntheticConfig(**override)
