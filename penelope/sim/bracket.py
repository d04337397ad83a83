"""The oracle bracket: how far each policy is from the best possible.

The optimal recompute cost of serving a replay's requests lies between a lower bound
(`penelope.sim.bound`, on the requests as the oracle's replay served them) and what the offline
`oracle` policy paid. Every policy's distance to the oracle is its relative excess over the
oracle's run (recompute cost, mean TTFT, mean JCT: negative means it did better than the
oracle, which farthest-next-use does not forbid), and its recompute cost's excess over the bound.
"""
from __future__ import annotations

import math

from penelope.sim.bound import recompute_bound

ORACLE = "oracle"
# Relative distances to the oracle's run, per summary field.
DISTANCE_FIELDS = ("recompute_cost", "ttft_mean", "jct_mean")


def oracle_bound(workload, replay, cache, cost_model) -> float:
    """Lower bound on the recompute cost of the requests `replay` served, with the cache's logical
    capacity (both tiers)."""
    return recompute_bound(workload, replay.events, cache.total_capacity, cost_model)


def compare_with_oracle(results: dict) -> None:
    """Set every result's `to_oracle` (relative distances per `DISTANCE_FIELDS`, and
    `cost_over_bound`) when an oracle result is among them; leave them empty otherwise."""
    oracle = oracle_of(results)
    if oracle is None:
        return
    bound = oracle.bound
    for result in results.values():
        distances = {field: _relative(getattr(result.summary, field), getattr(oracle.summary, field))
                     for field in DISTANCE_FIELDS}
        distances["cost_over_bound"] = _relative(result.summary.recompute_cost, bound)
        result.to_oracle = distances


def oracle_of(results: dict):
    """The oracle's result among `results`, or None."""
    return next((r for r in results.values() if r.canonical == ORACLE), None)


def _relative(value: float, reference: float) -> float:
    if reference == 0:
        return 0.0 if value == 0 else math.inf
    return value / reference - 1.0
