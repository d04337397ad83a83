"""Replay ensembles: Student-t intervals, paired changes, seeded perturbations, parallel runs equal
to sequential ones, zero spread without perturbation, and intervals that narrow with more runs."""

import dataclasses
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from penelope.costmodel.recompute import CostModel
from penelope.costmodel.shapes import get_model
from penelope.errors import UsageError
from penelope.sim.ensemble import Ensemble, run_ensembles
from penelope.sim.perturb import PERTURBED_FIELDS, Perturbation
from penelope.sim.run import SimConfig
from penelope.sim.stats import LOSS, NO_DIFFERENCE, WIN, Estimate, paired_changes, t_quantile, t_two_sided
from penelope.sim.timemodel import TimeModel
from penelope.sim.workloads.load import load_workload

COST = CostModel(get_model("qwen3-8b"))
MODEL = TimeModel.estimate("qwen3-8b")


@pytest.mark.parametrize(
    "df, t95, t99",
    # Printed tables of Student's t (two-sided 95% and 99%).
    [(1, 12.706, 63.657), (2, 4.303, 9.925), (3, 3.182, 5.841), (4, 2.776, 4.604), (9, 2.262, 3.250),
     (10, 2.228, 3.169), (29, 2.045, 2.756), (120, 1.980, 2.617)],
)
def test_t_quantiles_match_printed_tables(df, t95, t99):
    assert t_quantile(0.95, df) == pytest.approx(t95, abs=5e-4)
    assert t_quantile(0.99, df) == pytest.approx(t99, abs=5e-4)
    assert t_two_sided(t_quantile(0.95, df), df) == pytest.approx(0.95, abs=1e-12)
    # Many degrees of freedom: the normal distribution's 1.96.
    assert t_quantile(0.95, 100_000) == pytest.approx(1.95996, abs=1e-4)
    with pytest.raises(UsageError):
        t_quantile(0.95, 0)
    with pytest.raises(UsageError):
        t_quantile(1.5, 3)


def test_estimate_by_hand_and_verdicts():
    estimate = Estimate.of([1.0, 2.0, 3.0, 4.0])
    # s = sqrt(5/3); half-width = t(0.975, 3) * s / 2.
    half = 3.182446 * math.sqrt(5 / 3) / 2
    assert estimate.mean == 2.5 and estimate.n == 4
    assert (estimate.low, estimate.high) == pytest.approx((2.5 - half, 2.5 + half), abs=1e-5)
    assert estimate.verdict() == LOSS and estimate.verdict(lower_is_better=False) == WIN
    assert Estimate.of([-0.3, -0.2, -0.25]).verdict() == WIN
    assert Estimate.of([-0.3, 0.2, -0.25]).verdict() == NO_DIFFERENCE
    # One run, or a NaN in the runs: no interval, nothing significant.
    single = Estimate.of([-0.5])
    assert single.mean == -0.5 and not single.has_interval and single.verdict() == NO_DIFFERENCE
    assert math.isnan(Estimate.of([0.1, math.nan]).mean)
    # Equal values: zero spread exactly, and a difference that is never zero is significant.
    equal = Estimate.of([0.1] * 5)
    assert equal.low == equal.high == equal.mean == 0.1 and equal.verdict() == LOSS


def test_paired_changes_are_per_run_not_the_change_of_the_means():
    baseline, policy = [1.0, 10.0, 4.0], [0.5, 10.0, 3.0]
    changes = paired_changes(policy, baseline)
    assert changes == [-0.5, 0.0, -0.25]
    assert Estimate.of(changes).mean == pytest.approx(-0.25)
    # The change of the means would say -10%.
    assert np.mean(policy) / np.mean(baseline) - 1 == pytest.approx(-0.1)
    with pytest.raises(UsageError, match="paired runs"):
        paired_changes([1.0], [1.0, 2.0])


def test_perturbations_are_seeded_per_run_and_within_the_band():
    perturbation = Perturbation(band=0.03, jitter=0.2, seed=7)
    factors = [perturbation.factors(run) for run in range(50)]
    values = np.array([list(f.values()) for f in factors])
    assert values.min() >= 0.97 and values.max() <= 1.03 and values.std() > 0.01
    # Each run's draw depends on (seed, run) only.
    assert perturbation.factors(3) == factors[3] != factors[4]
    assert Perturbation(band=0.03, jitter=0.2, seed=8).factors(3) != factors[3]
    model = perturbation.time_model(MODEL, 3)
    for name in dataclasses.asdict(MODEL):
        expected = getattr(MODEL, name) * factors[3][name] if name in PERTURBED_FIELDS else getattr(MODEL, name)
        assert getattr(model, name) == expected, name
    assert Perturbation(band=0.0).time_model(MODEL, 3) is MODEL
    for kwargs, message in (({"band": 1.0}, "`band` must be in"), ({"jitter": -0.1}, "`jitter` must be in"),
                            ({"seed": -1}, "`perturb_seed`")):
        with pytest.raises(UsageError, match=message):
            Perturbation(**kwargs)


def test_jitter_scales_waits_and_keeps_arrival_order():
    closed = small_workload(2)
    jittered = Perturbation(band=0.0, jitter=0.2, seed=1).workload(closed, 0)
    assert jittered is not closed
    for old_session, new_session in zip(closed.sessions, jittered.sessions, strict=True):
        assert new_session.requests[0].think_time == old_session.requests[0].think_time == 0.0
        for old, new in zip(old_session.requests, new_session.requests, strict=True):
            assert 0.8 * old.think_time <= new.think_time <= 1.2 * old.think_time
            assert new.keys is old.keys and new.input_tokens == old.input_tokens
    assert Perturbation(jitter=0.0).workload(closed, 0) is closed
    # Open loop: arrivals move by their gaps, in the same order.
    sessions = tuple(
        dataclasses.replace(s, requests=tuple(dataclasses.replace(r, arrival=10.0 * (i + n)) for n, r in
                                              enumerate(s.requests)))
        for i, s in enumerate(closed.sessions)
    )
    open_loop = dataclasses.replace(closed, sessions=sessions, closed_loop=False)
    moved = Perturbation(jitter=0.2, seed=1).workload(open_loop, 0)
    before = [r.arrival for s in open_loop.sessions for r in s.requests]
    after = [r.arrival for s in moved.sessions for r in s.requests]
    assert np.argsort(before, kind="stable").tolist() == np.argsort(after, kind="stable").tolist()
    assert after != before and all(0.8 * b <= a <= 1.2 * b for a, b in zip(after, before, strict=True))


def small_workload(sessions: int):
    work = load_workload("synthetic", None, max_context=128 * 1024)
    return dataclasses.replace(work, sessions=work.sessions[:sessions])


def comparable(ensemble: Ensemble) -> list[dict]:
    """Every run's figures but the replay's wall time."""
    return [{name: {k: v for k, v in r.as_dict().items() if k != "wall_time"} for name, r in run.items()}
            for run in ensemble.runs]


def test_zero_perturbation_gives_zero_spread():
    work = small_workload(2)
    (ensemble,) = run_ensembles(work, ["sglang", "penelope"], [SimConfig(gpu_cache=64 * 1024)], MODEL, COST,
                                repeat=3, perturbation=Perturbation(band=0.0, jitter=0.0))
    runs = comparable(ensemble)
    assert runs[0] == runs[1] == runs[2]
    for name in ensemble.policies:
        for field in ("ttft_mean", "ttft_p90", "jct_mean", "hit_rate", "recompute_cost"):
            estimate = ensemble.estimate(name, field)
            assert estimate.low == estimate.mean == estimate.high, (name, field)
    change = ensemble.change("penelope", "ttft_mean")
    assert change.low == change.mean == change.high != 0.0


@pytest.fixture(scope="module")
def pressured():
    """Two synthetic sessions in 64K tokens: both policies evict, every run differs."""
    return small_workload(2), [SimConfig(gpu_cache=64 * 1024)]


RUNS = 24


@pytest.fixture(scope="module")
def sequential(pressured):
    work, configs = pressured
    (ensemble,) = run_ensembles(work, ["sglang", "penelope"], configs, MODEL, COST, repeat=RUNS,
                                perturbation=Perturbation(band=0.05, jitter=0.1), jobs=1)
    return ensemble


def test_parallel_runs_equal_sequential_runs_exactly(pressured, sequential):
    work, configs = pressured
    ticks = []

    class Counter:
        def update(self, n):
            ticks.append(n)

    (parallel,) = run_ensembles(work, ["sglang", "penelope"], configs, MODEL, COST, repeat=6,
                                perturbation=Perturbation(band=0.05, jitter=0.1), jobs=2, progress=Counter())
    # Run i is the same whatever the ensemble's size, so the first 6 sequential runs compare.
    assert comparable(parallel) == comparable(sequential)[:6]
    # The progress of every replay of the ensemble reached this process.
    assert sum(ticks) == 6 * 2 * work.num_requests


def test_changes_are_paired_run_by_run(sequential):
    base = sequential.values("sglang", "ttft_mean")
    policy = sequential.values("penelope", "ttft_mean")
    assert len(set(base)) == RUNS, "every run must differ"
    per_run = [p / b - 1 for p, b in zip(policy, base, strict=True)]
    change = sequential.change("penelope", "ttft_mean")
    assert change.mean == pytest.approx(np.mean(per_run), rel=1e-12)
    assert change.mean != pytest.approx(np.mean(policy) / np.mean(base) - 1, rel=1e-6)
    points = sequential.change("penelope", "hit_rate_points")
    expected = [100 * (p - b) for p, b in zip(sequential.values("penelope", "hit_rate"),
                                              sequential.values("sglang", "hit_rate"), strict=True)]
    assert points.mean == pytest.approx(np.mean(expected), rel=1e-12)
    data = sequential.policy_dict("penelope")
    assert data["vs_sglang"]["ttft_mean"]["mean"] == change.mean and len(data["runs"]) == RUNS
    assert data["vs_sglang"]["ttft_mean"]["verdict"] == sequential.verdict("penelope", "ttft_mean")


def test_intervals_narrow_as_runs_are_added(sequential):
    # One ensemble's interval depends on its draws; the mean half-width over disjoint blocks of n
    # runs (8 blocks of 3, 4 of 6, the whole 24) is expected to fall like t(n-1) / sqrt(n):
    # 2.48, 1.05, 0.42 standard deviations.
    def mean_width(n, interval):
        blocks = [Ensemble(sequential.config, sequential.runs[i : i + n], sequential.perturbation)
                  for i in range(0, RUNS, n)]
        return np.mean([interval(block).half_width for block in blocks])

    checks = {
        "sglang TTFT": lambda e: e.estimate("sglang", "ttft_mean"),
        "penelope TTFT": lambda e: e.estimate("penelope", "ttft_mean"),
        "penelope hit rate": lambda e: e.estimate("penelope", "hit_rate"),
        "TTFT change": lambda e: e.change("penelope", "ttft_mean"),
    }
    for name, interval in checks.items():
        widths = [mean_width(n, interval) for n in (3, 6, RUNS)]
        assert widths[0] > widths[1] > widths[2] > 0, (name, widths)


def test_ensemble_arguments_are_checked(pressured):
    work, configs = pressured
    with pytest.raises(UsageError, match="`repeat`"):
        run_ensembles(work, ["sglang"], configs, MODEL, COST, repeat=0)
    with pytest.raises(UsageError, match="`jobs`"):
        run_ensembles(work, ["sglang"], configs, MODEL, COST, repeat=2, jobs=0)


def test_table_cells_say_no_significant_difference_unless_the_interval_excludes_zero(sequential):
    from penelope.sim.ensemble_report import ensemble_tables, markdown_change

    assert markdown_change(Estimate(-0.287, -0.312, -0.261, 10)) == "-28.7% [-31.2%, -26.1%]"
    assert markdown_change(Estimate(0.004, -0.011, 0.019, 10)) == "no significant difference [-1.1%, +1.9%]"
    assert markdown_change(Estimate(0.0, 0.0, 0.0, 10)) == "identical in every run"
    assert markdown_change(Estimate(1.5, 0.7, 2.3, 10), lower_is_better=False, points=True) == "+1.50 [+0.70, +2.30]"
    text = ensemble_tables(64 * 1024, sequential)
    assert f"{RUNS} runs (time-model constants x U[0.95, 1.05], waits x U[0.9, 1.1], seed 0)" in text
    row = next(line for line in text.splitlines() if "TTFT mean" in line and line.startswith("penelope"))
    assert row.split()[-1] == sequential.verdict("penelope", "ttft_mean") or row.endswith(NO_DIFFERENCE)


_HELD_TOGETHER = """
import os, signal, sys, time
from penelope.cli import Terminated, _raise_terminated
from penelope.sim.ensemble import {window}
assert len(os.listdir("/proc/self/task")) == 1, "a second thread could take the signals after the window"
signal.signal(signal.SIGTERM, _raise_terminated)
try:
    with {window}():
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
    for _ in range(1000):
        pass
except Terminated:
    print("terminated")
except KeyboardInterrupt:
    print("interrupted")
else:
    print("lost")
"""


@pytest.mark.parametrize("window", ["_signals_deferred", "_signals_ignored"])
def test_a_termination_held_beside_a_ctrl_c_wins(window):
    """A SIGTERM and a Ctrl-C that arrive while signals are held back or ignored: Python would
    handle SIGINT first (signal-number order); the run must end as terminated, not lose it.

    The process has one thread (numpy's BLAS pool is kept to the main thread): a signal that
    another thread takes is handled when that thread runs, which on a loaded machine can be
    after the window has closed, by whichever handler is installed then."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", _HELD_TOGETHER.format(window=window)], capture_output=True,
                         text=True, timeout=60, env=env)
    assert run.stdout.strip() == "terminated", run.stderr[-2000:]
