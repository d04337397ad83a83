"""The lower bound on recompute cost (`penelope.sim.bound`): below what every policy paid on the
sequence of requests it served, on random workloads, GPU-only and with two tiers; zero without
pressure; and not trivially zero under pressure."""

import dataclasses

import pytest

from penelope.cache.manager import KVCache
from penelope.cache.policies import policy_names
from penelope.cache.tiers import TwoTierCache
from penelope.costmodel.recompute import CostModel
from penelope.costmodel.shapes import get_model
from penelope.sim.bound import recompute_bound
from penelope.sim.replay import Replay
from penelope.sim.timemodel import TimeModel
from penelope.sim.workloads.synthetic import SyntheticConfig, generate

COST = CostModel(get_model("qwen3-8b"))
TIME = TimeModel.estimate("qwen3-8b")
CONFIG = SyntheticConfig(sessions=6, requests_per_session=12, prefix_tokens=1024, max_context=16384,
                         first_prompt_median=2000, tool_result_median=800, human_fraction=0.3,
                         tool_wait_median=2.0, tool_wait_p90=12.0, human_wait_median=20.0,
                         summary_median=2000, output_median=120)


def paid_and_bound(workload, cache, capacity):
    result = Replay(workload, cache, TIME, COST, sessions=4).run()
    paid = sum(record.recompute_cost for record in result.records)
    return paid, recompute_bound(workload, result.events, capacity, COST)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_no_policy_pays_less_than_the_bound_on_its_own_requests(seed):
    workload = generate(dataclasses.replace(CONFIG, seed=seed))
    capacity = (14 + 4 * seed) * 1024
    bounds = []
    for policy in policy_names():
        paid, bound = paid_and_bound(workload, KVCache(capacity, 64, policy=policy, cost_model=COST), capacity)
        assert bound <= paid * (1 + 1e-9), f"{policy}: paid {paid:.4g} below the bound {bound:.4g}"
        bounds.append(bound)
    assert max(bounds) > 0, "the bound is trivially zero on a pressured workload"


@pytest.mark.parametrize("policy", ["penelope", "penelope-agent", "oracle"])
def test_with_two_tiers_the_bound_counts_both_tiers(policy):
    workload = generate(dataclasses.replace(CONFIG, seed=5))
    gpu, cpu = 12 * 1024, 4 * 1024
    cache = TwoTierCache(gpu, cpu, block_size=64, policy=policy, cost_model=COST, swap_buffer=1024)
    paid, bound = paid_and_bound(workload, cache, cache.total_capacity)
    assert 0 < bound <= paid * (1 + 1e-9)


def test_without_pressure_the_bound_is_zero():
    workload = generate(dataclasses.replace(CONFIG, seed=0))
    capacity = 10**6
    _, bound = paid_and_bound(workload, KVCache(capacity, 64, policy="oracle", cost_model=COST), capacity)
    assert bound == 0.0
