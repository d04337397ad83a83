"""Results of a replay per replica and for the fleet: who served what, how evenly, and whether
every replica kept up.

- Per replica: the summary of the requests it served (`penelope.sim.metrics.Summary`: TTFT, hit
  rate, recompute cost; JCT over the part of each session it served), its busy seconds and its
  saturation figures (`penelope.sim.fleet.saturation.ServerLoad`).
- Load imbalance: the busiest replica's busy seconds over the mean (1.0: perfectly even), and the
  same for requests served.
The fleet's own TTFT, JCT and hit rate are the summary of all records (`PolicyResult.summary`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from penelope.sim.fleet.saturation import Saturation, ServerLoad, measure
from penelope.sim.metrics import Summary, summarize
from penelope.sim.workloads.types import Workload


@dataclass(frozen=True)
class ReplicaSummary:
    """One replica: `summary` of its requests (None when it served none), `busy_time` (s),
    `prefill_tokens` computed, and its saturation figures `load`."""

    replica: int
    summary: Summary | None
    busy_time: float
    prefill_tokens: int
    load: ServerLoad

    def as_dict(self) -> dict:
        return {
            "replica": self.replica,
            "summary": self.summary.as_dict() if self.summary is not None else None,
            "busy_time": self.busy_time,
            "prefill_tokens": self.prefill_tokens,
            "load": dataclasses.asdict(self.load),
        }


@dataclass(frozen=True)
class FleetSummary:
    """Per-replica results, load imbalance (max / mean, busy seconds and requests), the router's
    decisions by kind, and the saturation check of the replay."""

    router: str | None
    replicas: tuple[ReplicaSummary, ...]
    imbalance: float
    request_imbalance: float
    routing: dict
    saturation: Saturation

    def as_dict(self) -> dict:
        return {
            "router": self.router,
            "replicas": len(self.replicas),
            "imbalance": self.imbalance,
            "request_imbalance": self.request_imbalance,
            "routing": dict(self.routing),
            "saturation": self.saturation.as_dict(),
            "per_replica": [r.as_dict() for r in self.replicas],
        }


def max_over_mean(values) -> float:
    """max / mean of non-negative `values`; 1.0 when all are zero."""
    array = np.asarray(values, dtype=np.float64)
    mean = float(array.mean()) if array.size else 0.0
    return float(array.max()) / mean if mean > 0 else 1.0


def fleet_summary(outcome, workload: Workload, config, summary: Summary | None = None) -> FleetSummary:
    """The fleet view of a `ReplayResult` of `workload` under `config` (a `SimConfig`); `summary`:
    the summary of all its records when already made (one replica's is the same)."""
    arrivals = [r.arrival for s in workload.sessions for r in s.requests if r.arrival is not None]
    open_loop = not workload.closed_loop
    saturation = measure(outcome.servers, outcome.records, open_loop, min(arrivals, default=0.0),
                         max(arrivals, default=0.0))
    by_replica: list[list] = [[] for _ in outcome.servers]
    for record in outcome.records:
        by_replica[record.replica].append(record)
    replicas = tuple(
        ReplicaSummary(
            replica=i,
            summary=(summary if summary is not None and len(by_replica) == 1 else summarize(records))
            if records else None,
            busy_time=counters.busy_time,
            prefill_tokens=counters.prefill_tokens,
            load=saturation.servers[i],
        )
        for i, (records, counters) in enumerate(zip(by_replica, outcome.servers, strict=True))
    )
    return FleetSummary(
        router=config.router if config.replicas > 1 else None,
        replicas=replicas,
        imbalance=max_over_mean([c.busy_time for c in outcome.servers]),
        request_imbalance=max_over_mean([c.finished for c in outcome.servers]),
        routing=dict(outcome.routing),
        saturation=saturation,
    )
