"""Seeded perturbations of a replay, one per run of an ensemble (`penelope.sim.ensemble`).

The time model's constants are estimates, and a closed-loop replay amplifies small timing
differences (which history is evicted next depends on which request finished first). Run i of
an ensemble scales each of `PERTURBED_FIELDS` by its own factor drawn uniformly from
[1 - band, 1 + band], and, with `jitter` > 0, every wait between requests by a factor from
[1 - jitter, 1 + jitter]: a closed-loop think time, or an open-loop gap between consecutive
arrivals (arrival order is kept). The draws depend only on (`seed`, run number): every policy and
every capacity of run i sees the same perturbation (paired runs), and a process computing run i
alone draws what a sequential loop would.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from penelope.errors import UsageError
from penelope.sim.timemodel import TimeModel
from penelope.sim.workloads.types import Workload

# Time-model constants scaled per run: compute speeds, per-batch overheads, bandwidths.
PERTURBED_FIELDS = (
    "sec_per_linear_unit",
    "sec_per_attention_pair",
    "batch_overhead",
    "decode_overhead",
    "hbm_bandwidth",
    "load_bandwidth",
)
DEFAULT_BAND = 0.03


@dataclass(frozen=True)
class Perturbation:
    """How the runs of an ensemble depart from the nominal replay.

    band: relative half-width of the time-model factors (0.03: each constant times a factor in
        [0.97, 1.03]); jitter: relative half-width of the wait factors (0: waits as loaded);
    seed: seed of every draw."""

    band: float = DEFAULT_BAND
    jitter: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("band", "jitter"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise UsageError(f"`{name}` must be a number, got {value!r}")
            if not 0 <= value < 1:
                raise UsageError(f"`{name}` must be in [0, 1) (a relative half-width), got {value}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise UsageError(f"`perturb_seed` must be a non-negative integer, got {self.seed!r}")
        if self.seed >= 2**63:
            raise UsageError(f"`perturb_seed` must be below 2**63, got {self.seed}")

    def factors(self, run: int) -> dict[str, float]:
        """The time-model factors of run `run`, by field name (all 1.0 when `band` is 0)."""
        rng = np.random.default_rng([self.seed, run, 0])
        draws = rng.uniform(1.0 - self.band, 1.0 + self.band, size=len(PERTURBED_FIELDS))
        return {name: float(value) for name, value in zip(PERTURBED_FIELDS, draws, strict=True)}

    def time_model(self, model: TimeModel, run: int) -> TimeModel:
        """`model` with run `run`'s factors applied (the same object when `band` is 0)."""
        if not self.band:
            return model
        factors = self.factors(run)
        return dataclasses.replace(model, **{name: getattr(model, name) * f for name, f in factors.items()})

    def workload(self, workload: Workload, run: int) -> Workload:
        """`workload` with run `run`'s waits (the same object when `jitter` is 0)."""
        if not self.jitter:
            return workload
        rng = np.random.default_rng([self.seed, run, 1])
        if workload.closed_loop:
            return _scale_think_times(workload, rng, self.jitter)
        return _scale_arrival_gaps(workload, rng, self.jitter)

    def describe(self) -> str:
        """One line for tables: what each run changes."""
        text = f"time-model constants x U[{1 - self.band:g}, {1 + self.band:g}]"
        if self.jitter:
            text += f", waits x U[{1 - self.jitter:g}, {1 + self.jitter:g}]"
        return text + f", seed {self.seed}"

    def as_dict(self) -> dict:
        return {"band": self.band, "jitter": self.jitter, "seed": self.seed, "fields": list(PERTURBED_FIELDS)}


def _scale_think_times(workload: Workload, rng: np.random.Generator, jitter: float) -> Workload:
    sessions = []
    for session in workload.sessions:
        factors = rng.uniform(1.0 - jitter, 1.0 + jitter, size=len(session.requests))
        requests = tuple(
            dataclasses.replace(request, think_time=request.think_time * float(f))
            for request, f in zip(session.requests, factors, strict=True)
        )
        sessions.append(dataclasses.replace(session, requests=requests))
    return dataclasses.replace(workload, sessions=tuple(sessions))


def _scale_arrival_gaps(workload: Workload, rng: np.random.Generator, jitter: float) -> Workload:
    # Every request in arrival order (ties by position in the workload); gaps from time 0.
    where = [(s, i) for s, session in enumerate(workload.sessions) for i in range(len(session.requests))]
    arrivals = np.array([workload.sessions[s].requests[i].arrival for s, i in where], dtype=np.float64)
    order = np.argsort(arrivals, kind="stable")
    gaps = np.diff(arrivals[order], prepend=0.0)
    moved = np.empty_like(arrivals)
    moved[order] = np.cumsum(gaps * rng.uniform(1.0 - jitter, 1.0 + jitter, size=gaps.size))
    new = {key: float(value) for key, value in zip(where, moved, strict=True)}
    sessions = tuple(
        dataclasses.replace(
            session,
            requests=tuple(dataclasses.replace(r, arrival=new[s, i]) for i, r in enumerate(session.requests)),
        )
        for s, session in enumerate(workload.sessions)
    )
    return dataclasses.replace(workload, sessions=sessions)
