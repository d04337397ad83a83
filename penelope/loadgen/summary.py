"""What a load-generator run measured, per run and over repeats.

Per run (`summarize`), over the requests that finished (`ok`): TTFT mean and percentiles, ITL
and end-to-end latency, throughput (finished requests and output tokens per second of the run's
wall time), the cached fraction (the server's cached tokens over the prompt tokens, over the
requests whose cached tokens it reported), and per session the JCT: from its first send to its
last reply, think times included, for sessions whose every request finished in the run. Failed
requests are counted by status; requests cut by a bound are counted apart and left out of every
latency. The client's own cost: `overhead` per request (mean, p99) and the event loop's lateness.
Priming turns (`LoadConfig.prime`) count as sent and finished and nowhere else: latencies, the
cached fraction, JCT and throughput are over the measured turns (JCT from a session's first
measured send; throughput from the run's first measured send to its end).

Over repeats (`estimates`): every metric's mean over the runs with its 95% Student-t interval
(`penelope.sim.stats.Estimate`); with one run the interval is unknown.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from penelope.loadgen.records import CUT, RequestRecord
from penelope.loadgen.runner import RunResult
from penelope.sim.stats import Estimate

# (field, label, unit) of every metric, in table order; times in seconds.
METRICS = (
    ("ttft_mean", "TTFT mean", "s"),
    ("ttft_p50", "TTFT p50", "s"),
    ("ttft_p90", "TTFT p90", "s"),
    ("ttft_p99", "TTFT p99", "s"),
    ("itl_mean", "ITL mean", "s"),
    ("itl_p90", "ITL p90", "s"),
    ("e2e_mean", "E2E mean", "s"),
    ("e2e_p90", "E2E p90", "s"),
    ("jct_mean", "JCT mean", "s"),
    ("throughput", "throughput", "req/s"),
    ("output_tps", "output tokens/s", "tok/s"),
    ("cached_fraction", "cached fraction", "fraction"),
    ("errors", "errors", "requests"),
    ("overhead_mean", "client overhead mean", "s"),
    ("overhead_p99", "client overhead p99", "s"),
    ("loop_lag_p99", "event-loop lag p99", "s"),
)


@dataclass(frozen=True)
class RunSummary:
    """One run's figures (see the module docstring); NaN where nothing was measured."""

    repeat: int
    sent: int
    finished: int
    cut: int
    not_sent: int
    failures: dict
    sessions_completed: int
    wall: float
    stopped: str
    ttft_mean: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    itl_mean: float
    itl_p90: float
    e2e_mean: float
    e2e_p90: float
    jct_mean: float
    throughput: float
    output_tps: float
    cached_fraction: float
    errors: int
    overhead_mean: float
    overhead_p99: float
    loop_lag_p99: float
    loop_lag_max: float
    prompt_tokens: int
    cached_tokens: int | None

    def as_dict(self) -> dict:
        return asdict(self)


def _mean(values) -> float:
    return float(np.mean(values)) if len(values) else math.nan


def _pct(values, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def session_jcts(records: Sequence[RequestRecord]) -> list[float]:
    """JCT of every session whose requests all finished: first send to last reply, in seconds,
    over its measured turns (a priming turn and the wait after it left out)."""
    by_session: dict[str, list[RequestRecord]] = {}
    for record in records:
        by_session.setdefault(record.session, []).append(record)
    jcts = []
    for group in by_session.values():
        measured = [r for r in group if r.measured]
        if len(group) == group[0].turns and all(r.ok for r in group) and measured:
            first = min(r.sent_at for r in measured)
            jcts.append(max(r.sent_at + r.e2e for r in measured) - first)
    return jcts


def summarize(result: RunResult) -> RunSummary:
    records = result.records
    ok = [r for r in records if r.ok]
    # Priming turns (LoadConfig.prime) count as sent and finished, not in latencies or reuse.
    measured = [r for r in ok if r.measured]
    ttft = [r.ttft for r in measured if r.ttft is not None]
    itl = [r.itl for r in measured if r.itl is not None]
    e2e = [r.e2e for r in measured]
    overhead = [r.overhead for r in records]
    reported = [r for r in measured if r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in reported)
    cached = sum(r.cached_tokens for r in reported) if reported else None
    failures = Counter(r.status for r in records if r.failed)
    jcts = session_jcts(records)
    wall = span = result.wall
    if len(measured) < len(ok):
        # Priming turns: throughput over the measured turns, from the first of them on.
        span -= min((r.sent_at for r in measured), default=span)
    return RunSummary(
        repeat=result.repeat,
        sent=len(records),
        finished=len(ok),
        cut=sum(r.status == CUT for r in records),
        not_sent=result.not_sent,
        failures=dict(sorted(failures.items())),
        sessions_completed=len(jcts),
        wall=wall,
        stopped=result.stopped,
        ttft_mean=_mean(ttft),
        ttft_p50=_pct(ttft, 50),
        ttft_p90=_pct(ttft, 90),
        ttft_p99=_pct(ttft, 99),
        itl_mean=_mean(itl),
        itl_p90=_pct(itl, 90),
        e2e_mean=_mean(e2e),
        e2e_p90=_pct(e2e, 90),
        jct_mean=_mean(jcts),
        throughput=len(measured) / span if span > 0 else math.nan,
        output_tps=sum(r.output_tokens for r in measured) / span if span > 0 else math.nan,
        cached_fraction=cached / prompt if cached is not None and prompt else math.nan,
        errors=sum(failures.values()),
        overhead_mean=_mean(overhead),
        overhead_p99=_pct(overhead, 99),
        loop_lag_p99=_pct(result.loop_lag, 99),
        loop_lag_max=max(result.loop_lag) if result.loop_lag else math.nan,
        prompt_tokens=sum(r.prompt_tokens for r in ok),
        cached_tokens=cached,
    )


def estimates(summaries: Sequence[RunSummary]) -> dict[str, Estimate]:
    """Every metric of `METRICS`: the mean over runs with its 95% interval."""
    return {name: Estimate.of([getattr(s, name) for s in summaries]) for name, _, _ in METRICS}
