"""Tables and plots of load-generator runs."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from penelope.loadgen.records import RequestRecord
from penelope.loadgen.summary import METRICS, RunSummary, estimates
from penelope.plotting import pyplot, save
from penelope.sim.stats import Estimate
from penelope.tables import format_table


def _value(value: float, unit: str) -> tuple[float, str, str]:
    """(scaled value, format, unit shown) of a metric."""
    if unit == "s":
        return value * 1e3, ".3f" if abs(value) < 0.01 else ".1f", "ms"
    if unit == "fraction":
        return value * 100, ".1f", "%"
    if unit == "requests":
        return value, ".1f" if value != int(value) else ".0f", ""
    return value, ".2f", unit


def cell(estimate: Estimate, unit: str) -> str:
    """`mean ±half-width unit` (the mean alone with one run; `n/a` when nothing was measured)."""
    if math.isnan(estimate.mean):
        return "n/a"
    mean, fmt, shown = _value(estimate.mean, unit)
    text = format(mean, fmt)
    if estimate.has_interval:
        half = _value(estimate.half_width, unit)[0]
        text += " ±" + format(half, fmt)
    return f"{text} {shown}".rstrip()


def results_table(summaries: Sequence[RunSummary]) -> str:
    """Every metric of `METRICS`, mean over runs with the half-width of its 95% interval."""
    values = estimates(summaries)
    header = "mean ±95% over runs" if len(summaries) > 1 else "value"
    return format_table(("metric", header), [(label, cell(values[name], unit)) for name, label, unit in METRICS])


def counts_line(summaries: Sequence[RunSummary]) -> str:
    sent = sum(s.sent for s in summaries)
    finished = sum(s.finished for s in summaries)
    failures: dict[str, int] = {}
    for s in summaries:
        for status, n in s.failures.items():
            failures[status] = failures.get(status, 0) + n
    failed = ", ".join(f"{status} {n}" for status, n in sorted(failures.items())) or "none"
    cut = sum(s.cut for s in summaries)
    runs = f" over {len(summaries)} runs" if len(summaries) > 1 else ""
    stops = sorted({s.stopped for s in summaries})
    return (f"{sent:,} requests sent{runs}, {finished:,} finished, {cut:,} cut by a bound, failed: {failed}; "
            f"{sum(s.sessions_completed for s in summaries):,} sessions completed; stopped: {', '.join(stops)}")


def overhead_line(summaries: Sequence[RunSummary]) -> str:
    """The client's cost, printed beside every TTFT table: what the client adds to the times."""
    mean = np.mean([s.overhead_mean for s in summaries])
    p99 = max(s.overhead_p99 for s in summaries)
    lag = max(s.loop_lag_max for s in summaries)
    return (f"client overhead per request: mean {mean * 1e3:.3f} ms, p99 {p99 * 1e3:.3f} ms of CPU (prompt "
            f"building, JSON encoding, stream parsing); event loop late by at most {lag * 1e3:.1f} ms")


def plot_runs(path: str, records: Sequence[RequestRecord], title: str) -> None:
    """Three panels: TTFT's distribution per run, TTFT against prompt length (colour: cached
    fraction), and the mean cached fraction per turn."""
    plt = pyplot()
    ok = [r for r in records if r.ok and r.ttft is not None]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    runs = sorted({r.repeat for r in ok})
    for repeat in runs:
        ttft = np.sort([r.ttft for r in ok if r.repeat == repeat]) * 1e3
        axes[0].plot(ttft, np.arange(1, ttft.size + 1) / ttft.size, label=f"run {repeat}")
    axes[0].set_xlabel("TTFT (ms)")
    axes[0].set_ylabel("fraction of requests")
    axes[0].set_title("TTFT distribution")
    if 1 < len(runs) <= 10:
        axes[0].legend(fontsize=8)
    cached = [r.cached_tokens / r.prompt_tokens if r.cached_tokens is not None else math.nan for r in ok]
    points = axes[1].scatter([r.prompt_tokens for r in ok], [r.ttft * 1e3 for r in ok], c=cached, s=8,
                             cmap="viridis", vmin=0, vmax=1)
    fig.colorbar(points, ax=axes[1], label="cached fraction")
    axes[1].set_xlabel("prompt tokens")
    axes[1].set_ylabel("TTFT (ms)")
    axes[1].set_title("TTFT against prompt length")
    by_turn: dict[int, list[float]] = {}
    for record, fraction in zip(ok, cached, strict=True):
        if not math.isnan(fraction):
            by_turn.setdefault(record.turn, []).append(fraction)
    turns = sorted(by_turn)
    axes[2].plot(turns, [np.mean(by_turn[t]) for t in turns], marker=".")
    axes[2].set_ylim(0, 1)
    axes[2].set_xlabel("turn of the session")
    axes[2].set_ylabel("mean cached fraction")
    axes[2].set_title("prefix reuse by turn")
    for axis in axes:
        axis.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=10)
    save(fig, path)
