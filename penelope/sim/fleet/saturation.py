"""Is the simulated server keeping up? Offered load before a replay, saturation after it.

Open-loop traces (Mooncake) send requests at recorded times whatever the servers do. When the
work arrives faster than a server can do it, its queue grows without bound and every figure of
the replay (TTFT, JCT) measures the length of the trace, not the cache. Closed-loop workloads
(WEKA, synthetic) cannot overload a server: a session waits for its reply before it sends again.

Before a replay, `offered_load` estimates the work the trace brings per second of trace, in
seconds of one server's time (`TimeModel`), as a lower bound:
- prefill: each request computes only what no earlier request sent (the prefix reuse of a cache
  that never evicts, `unbounded` reuse, whole blocks), one batch per request;
- decode: every step of a request's reply is its share of a full batch: `batch` requests of its
  context each (the cache holds `capacity / mean context` requests), so the weights' read is
  shared and the request pays its own KV read.
`load` = (prefill + decode seconds) / trace span: above 1, one server cannot keep up even with a
perfect cache; `replicas_needed(u)` is the fewest servers that bring it below utilization u.

After a replay, `measure` looks at how long each server kept its last requests waiting: the
mean queueing time (send to admission into a prefill batch) of the requests it received in the
last `LATE_WINDOW` (10%) of the trace's span (`late_wait`). A stable server admits requests
within seconds however long the trace; a saturated one carries a backlog that grows with the
trace, so its late requests wait a time proportional to the trace's length. A server whose
`late_wait` exceeds both `SATURATED_WAIT` (5%) of the span and `MIN_SATURATED_WAIT` (60 s) is
reported saturated (its queue grew without bound). The floor keeps transients of short traces
apart: a burst queued behind the longest prompts (a 126K-token prefill takes about 13 s of an
H100 under the time model's estimates) can keep requests waiting tens of seconds on a stable
server. Also reported: `drain_time` (seconds from its last arrival to its last finish)
and `utilization` (busy seconds over the seconds from the trace's first arrival to the
fleet's last finish, one window for every replica; a server decoding even one request is busy,
so this is near 1 under any steady traffic and does not tell saturation by itself), and the
requests waiting when its last request arrived.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from penelope.costmodel.recompute import CostModel
from penelope.errors import UsageError
from penelope.sim.analysis import unbounded_reuse
from penelope.sim.timemodel import TimeModel
from penelope.sim.workloads.types import Workload

LATE_WINDOW = 0.1
SATURATED_WAIT = 0.05
MIN_SATURATED_WAIT = 60.0


@dataclass(frozen=True)
class OfferedLoad:
    """Work a trace brings, in seconds of one server (see the module docstring).

    span: seconds from the first to the last arrival; prefill, decode: seconds of work in all;
    batch: the decode batch assumed; reuse: fraction of input tokens an unbounded cache reuses;
    skipped: requests left out because they can never fit a server's cache (the replay skips
    them too)."""

    requests: int
    span: float
    prefill: float
    decode: float
    batch: int
    reuse: float
    skipped: int = 0

    @property
    def load(self) -> float:
        """Offered load on one server: seconds of work per second of trace (inf without a span)."""
        work = self.prefill + self.decode
        return work / self.span if self.span > 0 else (math.inf if work else 0.0)

    def replicas_needed(self, utilization: float = 1.0) -> int:
        """The fewest servers whose share of the load is below `utilization` (in (0, 1])."""
        if not 0 < utilization <= 1:
            raise UsageError(f"utilization must be in (0, 1], got {utilization}")
        if math.isinf(self.load):
            raise UsageError("every request arrives at once: no number of servers keeps up with an infinite rate")
        return math.floor(self.load / utilization) + 1

    def as_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data.update(load=self.load if math.isfinite(self.load) else None, replicas_needed=self.replicas_needed()
                    if math.isfinite(self.load) else None)
        return data


def offered_load(workload: Workload, time_model: TimeModel, cost_model: CostModel, capacity: int) -> OfferedLoad:
    """The estimate of the module docstring for an open-loop `workload` on servers of `capacity`
    KV tokens; raises UsageError for a closed-loop workload (it has no offered rate)."""
    if workload.closed_loop:
        raise UsageError("a closed-loop workload has no offered load: its sessions wait for their replies")
    every = [r for s in workload.sessions for r in s.requests]
    # Requests that can never fit a cache of `capacity` are skipped by the replay: no work.
    requests = sorted((r for r in every if r.input_tokens + r.output_tokens <= capacity), key=lambda r: r.arrival)
    if not requests:
        raise UsageError(f"no request of the workload fits a cache of {capacity:,} tokens")
    contexts = np.array([r.input_tokens + r.output_tokens for r in requests], dtype=np.float64)
    batch = max(1, int(capacity // max(1.0, float(contexts.mean()))))
    prefill = decode = 0.0
    reused_tokens = 0
    for request, reused in unbounded_reuse(requests, workload.block_size):
        reused_tokens += reused
        n = request.input_tokens
        prefill += time_model.prefill_time(n - reused, cost_model.attention_pairs(reused, n))
        if request.output_tokens > 1:
            context = n + request.output_tokens / 2
            step = time_model.decode_step_time(batch, int(batch * context)) / batch
            decode += (request.output_tokens - 1) * step
    span = requests[-1].arrival - requests[0].arrival
    total = sum(r.input_tokens for r in requests)
    return OfferedLoad(len(requests), span, prefill, decode, batch, reused_tokens / total if total else 0.0,
                       skipped=len(every) - len(requests))


@dataclass(frozen=True)
class ServerLoad:
    """One server after a replay. Times in s: `late_wait` the mean queueing time of its requests
    sent in the last `LATE_WINDOW` of the span; `drain_time` from its last arrival to its last
    finish; `utilization` busy seconds over the seconds from the trace's first arrival to the
    fleet's last finish;
    `waiting_at_last_arrival`, `max_waiting`: requests in its queue."""

    replica: int
    late_wait: float
    drain_time: float
    utilization: float
    waiting_at_last_arrival: int
    max_waiting: int
    saturated: bool


@dataclass(frozen=True)
class Saturation:
    """Whether the servers kept up (see the module docstring); `span`: seconds from the first to
    the last arrival of the trace."""

    open_loop: bool
    span: float
    servers: tuple[ServerLoad, ...]

    @property
    def saturated(self) -> list[int]:
        """The saturated servers' numbers."""
        return [s.replica for s in self.servers if s.saturated]

    def warning(self) -> str | None:
        """One line when a server's queue grew without bound, else None."""
        if not self.saturated:
            return None
        worst = max(self.servers, key=lambda s: s.late_wait)
        fleet = len(self.servers) > 1
        which = f"{len(self.saturated)} of {len(self.servers)} replicas" if fleet else "the server"
        sent = f"requests sent to replica {worst.replica}" if fleet else "requests sent"
        return (
            f"SATURATED: {which} could not keep up (queue growing without bound): {sent}"
            f" in the trace's last {LATE_WINDOW:.0%} waited {worst.late_wait:,.0f} s on average "
            f"before their prefill ({worst.late_wait / self.span:.0%} of the trace's {self.span:,.0f} s), "
            f"{worst.waiting_at_last_arrival:,} requests waiting at its last arrival; figures measure the backlog, "
            "not the cache. Add replicas (--replicas), slow the trace down (--time-scale) or see `penelope analyze`"
        )

    def as_dict(self) -> dict:
        return {
            "open_loop": self.open_loop,
            "span": self.span,
            "saturated": self.saturated,
            "servers": [dataclasses.asdict(s) for s in self.servers],
        }


def measure(servers, records, open_loop: bool, first_arrival: float, last_arrival: float) -> Saturation:
    """Saturation of a replay from its servers' counters (`penelope.sim.server.ServerCounters`,
    in replica order), its request records (any order) and the trace's first and last arrival
    times (s)."""
    span = max(0.0, last_arrival - first_arrival)
    late = last_arrival - LATE_WINDOW * span
    waits: list[list[float]] = [[] for _ in servers]
    for record in records:
        if record.send_time >= late and record.admit_time is not None:
            waits[record.replica].append(record.queue_time)
    loads = []
    # One window for every replica (the trace's first arrival to the fleet's last finish), so a
    # replica that served one request reads as idle, not as busy for its own short window.
    fleet_end = max((c.last_finish for c in servers if c.queue), default=first_arrival)
    window = fleet_end - first_arrival
    for replica, counters in enumerate(servers):
        if counters.queue:
            drain = max(0.0, counters.last_finish - counters.last_arrival)
            waiting = counters.queue[-1][1]
        else:
            drain = 0.0
            waiting = 0
        utilization = min(1.0, counters.busy_time / window) if window > 0 else 0.0
        late_wait = float(np.mean(waits[replica])) if waits[replica] else 0.0
        saturated = open_loop and span > 0 and late_wait > max(SATURATED_WAIT * span, MIN_SATURATED_WAIT)
        loads.append(ServerLoad(replica, late_wait, drain, utilization, waiting, counters.max_waiting, saturated))
    return Saturation(open_loop, span, tuple(loads))
