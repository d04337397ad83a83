"""Simulator speed: replaying about 3,000 requests under the paper's six eviction policies.

Workloads (one table): the synthetic default cut to 15 sessions (2,930 requests, Qwen3-8B, 256K
GPU cache), and the 32 shared WEKA traces up to 256K tokens (Qwen3-235B-A22B, its 384K cache).
Both replay 4 sessions at once with longest-prefix-first scheduling, through the real cache
manager. Target on a 2-core machine: the six policies of one workload in under 2 minutes.
One round each (`benchmark.pedantic(rounds=1)`): a round is the whole grid.

`extra_info` holds requests per second, seconds per policy and each policy's TTFT change against
SGLang and hit rate, so a speed regression and a behaviour change are both visible (versions,
commit and machine come from `conftest.py`).

Run: ``python -m pytest microbench/bench_simulator.py --benchmark-json out.json``.
"""

import dataclasses
import os
from pathlib import Path

import pytest

from penelope.costmodel.recompute import CostModel
from penelope.costmodel.shapes import get_model
from penelope.sim.run import SimConfig, ablation_policies, default_gpu_cache, run_policies
from penelope.sim.timemodel import TimeModel
from penelope.sim.workloads.load import load_workload
from penelope.sim.workloads.weka import load_weka

TRACES = Path(
    os.environ.get("PENELOPE_WEKA_TRACES")
    or Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "weka-claude-code"
).resolve()
WORKLOADS = {
    # name: (model, loader)
    "synthetic-15": ("qwen3-8b", lambda: _first(load_workload("synthetic"), 15)),
    "weka-32": ("qwen3-235b-a22b", lambda: load_weka(TRACES, max_context=256 * 1024)),
}


def _first(workload, sessions):
    return dataclasses.replace(workload, sessions=workload.sessions[:sessions])


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_replay_six_policies(benchmark, name):
    model, load = WORKLOADS[name]
    workload = load()
    shape = get_model(model)
    time_model = TimeModel.estimate(shape)
    cost = CostModel(shape)
    config = SimConfig(gpu_cache=default_gpu_cache(shape), sessions=4, scheduler="lpm")
    policies = ablation_policies()

    results = benchmark.pedantic(
        run_policies, args=(workload, policies, config, time_model, cost), rounds=1, iterations=1
    )

    seconds = sum(r.replay.wall_time for r in results.values())
    requests = sum(r.summary.requests for r in results.values())
    benchmark.extra_info.update(
        workload=name,
        model=model,
        gpu_cache=config.gpu_cache,
        requests_per_policy=workload.num_requests,
        policies=len(policies),
        replay_seconds=seconds,
        requests_per_second=requests / seconds,
        seconds_per_policy={p: r.replay.wall_time for p, r in results.items()},
        ttft_change_vs_sglang={p: r.changes["ttft_mean"] for p, r in results.items()},
        hit_rate={p: r.summary.hit_rate for p, r in results.items()},
    )
    assert all(r.summary.requests + r.replay.skipped == workload.num_requests for r in results.values())
