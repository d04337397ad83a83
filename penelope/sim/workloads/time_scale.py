"""Every wait between a workload's requests slowed down or sped up by one factor."""

from __future__ import annotations

import dataclasses
import math

from penelope.errors import UsageError
from penelope.sim.workloads.types import Workload

# Slowing a trace down or speeding it up more than this turns seconds into days or microseconds.
TIME_SCALE_RANGE = (1e-4, 1e4)


def check_time_scale(factor: float) -> float:
    low, high = TIME_SCALE_RANGE
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        raise UsageError(f"`time_scale` must be a positive number, got {factor!r}")
    if not low <= factor <= high:
        raise UsageError(f"`time_scale` must be in [{low:g}, {high:g}], got {factor:g}")
    return float(factor)


def scale_time(workload: Workload, factor: float) -> Workload:
    """`workload` with every wait between requests times `factor`: open-loop arrivals (so the
    request rate is divided by it), closed-loop think times. The same object when `factor` is 1."""
    factor = check_time_scale(factor)
    if factor == 1.0:
        return workload
    sessions = []
    for session in workload.sessions:
        if workload.closed_loop:
            requests = tuple(dataclasses.replace(r, think_time=r.think_time * factor) for r in session.requests)
        else:
            requests = tuple(dataclasses.replace(r, arrival=r.arrival * factor) for r in session.requests)
        sessions.append(dataclasses.replace(session, requests=requests))
    return dataclasses.replace(workload, sessions=tuple(sessions))
