"""Tables, JSON and a plot of an A/B run: every configuration's figures over its runs, and its
change against the baseline PAIRED run by run (round r against the baseline's round r), with 95%
Student-t intervals (`penelope.sim.stats`), as `penelope simulate --repeat` reports policies.

Changes: times, throughput and prefill tokens relative (`(x_r - b_r) / b_r`); the cached fraction
in percentage points; errors as a difference in requests. A change is a win or a loss only when
its interval excludes zero.
"""

from __future__ import annotations

import math

from penelope.loadgen.ab_runner import ABResult
from penelope.loadgen.report import cell
from penelope.sim.ensemble_report import change_interval
from penelope.sim.stats import Estimate, paired_changes, paired_differences
from penelope.tables import format_table

RELATIVE, POINTS, DIFFERENCE = "relative", "points", "difference"
# (field, label, unit, how its change is computed, lower is better)
METRICS = (
    ("ttft_mean", "TTFT mean", "s", RELATIVE, True),
    ("ttft_p50", "TTFT p50", "s", RELATIVE, True),
    ("ttft_p90", "TTFT p90", "s", RELATIVE, True),
    ("ttft_p99", "TTFT p99", "s", RELATIVE, True),
    ("jct_mean", "JCT mean", "s", RELATIVE, True),
    ("throughput", "throughput", "req/s", RELATIVE, False),
    ("cached_fraction", "cached fraction", "fraction", POINTS, False),
    ("errors", "errors", "requests", DIFFERENCE, True),
    ("computed", "prefill computed", "tokens", RELATIVE, True),
    ("recomputed", "prefill recomputed", "tokens", RELATIVE, True),
    ("positions", "prefill attention pairs", "pairs", RELATIVE, True),
)
# The metrics table in two parts, so that each fits a terminal: latency, then the cache's work.
TABLE_COLUMNS = (("ttft_mean", "ttft_p50", "ttft_p90", "ttft_p99", "jct_mean", "throughput", "errors"),
                 ("cached_fraction", "computed", "recomputed", "positions"))


def _metric(field: str) -> tuple:
    return next(m for m in METRICS if m[0] == field)


def estimate(result: ABResult, name: str, field: str) -> Estimate | None:
    """Mean and 95% interval of `field` over `name`'s runs (None: no run)."""
    runs = result.runs_of(name)
    if not runs:
        return None
    return Estimate.of([runs[r].value(field) for r in sorted(runs)])


def change(result: ABResult, name: str, field: str) -> Estimate | None:
    """`name`'s change of `field` against the baseline, paired by round (None: no pair)."""
    rounds = result.paired_rounds(name)
    if not rounds:
        return None
    mine, base = result.runs_of(name), result.runs_of(result.baseline)
    values = [mine[r].value(field) for r in rounds]
    baseline = [base[r].value(field) for r in rounds]
    kind = _metric(field)[3]
    if kind == RELATIVE:
        deltas = paired_changes(values, baseline)
    else:
        deltas = paired_differences(values, baseline)
    return Estimate.of(deltas)


def _cell(value: Estimate | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "tokens":
        if math.isnan(value.mean):
            return "n/a"
        text = f"{value.mean:,.0f}"
        return text + (f" ±{value.half_width:,.0f}" if value.has_interval else "")
    if unit == "pairs":
        if math.isnan(value.mean):
            return "n/a"
        text = f"{value.mean / 1e6:,.2f}M"
        return text + (f" ±{value.half_width / 1e6:,.2f}M" if value.has_interval else "")
    return cell(value, unit)


def _change_cell(value: Estimate | None, kind: str) -> tuple[str, str]:
    if value is None:
        return "-", ""
    if kind == DIFFERENCE:
        if math.isnan(value.mean):
            return "n/a", ""
        interval = f"[{value.low:+.1f}, {value.high:+.1f}]" if value.has_interval else ""
        return f"{value.mean:+.1f}", interval
    if kind == POINTS:
        # Fractions -> percentage points.
        scaled = Estimate(value.mean * 100, value.low * 100, value.high * 100, value.n, value.confidence)
        return change_interval(scaled, points=True)
    return change_interval(value)


def metrics_table(result: ABResult) -> str:
    """One row per configuration: each metric's mean ±half-width of its 95% interval over runs
    (two tables: latency and throughput, then the cache's work)."""
    tables = []
    for columns in TABLE_COLUMNS:
        rows = []
        for config in result.configs:
            runs = len(result.runs_of(config.name))
            rows.append((config.name, runs,
                         *(_cell(estimate(result, config.name, f), _metric(f)[2]) for f in columns)))
        tables.append(format_table(("configuration", "runs", *(_metric(f)[1] for f in columns)), rows))
    return "\n\n".join(tables)


def changes_table(result: ABResult) -> str:
    """Every configuration's change against the baseline per metric, paired by round."""
    rows = []
    for config in result.configs:
        if config.name == result.baseline:
            continue
        pairs = len(result.paired_rounds(config.name))
        for field, label, _, kind, lower in METRICS:
            value = change(result, config.name, field)
            mean, interval = _change_cell(value, kind)
            verdict = value.verdict(lower_is_better=lower) if value is not None else ""
            if value is not None and math.isnan(value.mean):
                verdict = ""
            rows.append((config.name, pairs, label, mean, interval, verdict))
    return format_table(("configuration", "pairs", "metric", "change", "95% interval", "verdict"), rows)


def report_text(result: ABResult) -> str:
    """The metrics table and the paired changes, with how many runs finished."""
    runs = len(result.runs)
    planned = len(result.configs) * result.repeats
    head = (f"{runs} of {planned} runs finished"
            + (" (interrupted: the tables hold the runs and pairs that finished)" if result.interrupted else "")
            + (f" (stopped by an error, {result.error}: the tables hold the runs and pairs that finished)"
               if result.error is not None else "")
            + "; mean ±half-width of the 95% interval over runs")
    text = head + "\n" + metrics_table(result)
    if any(result.paired_rounds(c.name) for c in result.configs if c.name != result.baseline):
        text += (f"\n\nchanges against {result.baseline}, paired run by run (round r against round r; relative, "
                 "cached fraction in points, errors in requests):\n" + changes_table(result))
    else:
        text += f"\nno pair of runs with {result.baseline} finished: no changes to report"
    return text


def report_payload(result: ABResult) -> dict:
    """JSON-ready: every run's figures, the pairing, every estimate and change with its verdict."""
    estimates, changes = {}, {}
    for config in result.configs:
        estimates[config.name] = {f: e.as_dict() for f, *_ in METRICS
                                  if (e := estimate(result, config.name, f)) is not None}
        if config.name == result.baseline:
            continue
        changes[config.name] = {}
        for field, _, _, kind, lower in METRICS:
            value = change(result, config.name, field)
            if value is not None:
                changes[config.name][field] = {**value.as_dict(), "kind": kind,
                                               "verdict": value.verdict(lower_is_better=lower)}
    return {
        "baseline": result.baseline,
        "repeats": result.repeats,
        "servers_mode": result.servers_mode,
        "interrupted": result.interrupted,
        "error": None if result.error is None else str(result.error),
        "configs": [{"name": c.name, "args": list(c.args), **result.servers.get(c.name, {})} for c in result.configs],
        "runs": [run.as_dict() for run in result.runs],
        "pairs": {c.name: result.paired_rounds(c.name) for c in result.configs if c.name != result.baseline},
        "estimates": estimates,
        "changes": changes,
        "records": result.records,
    }


def plot_ab(path: str, result: ABResult, title: str) -> None:
    """Two panels: mean TTFT per configuration with its interval, and each configuration's paired
    change of mean TTFT and of recomputed prefill tokens against the baseline."""
    from penelope.plotting import pyplot, save

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.2))
    names = [c.name for c in result.configs]
    x = list(range(len(names)))
    for i, name in enumerate(names):
        value = estimate(result, name, "ttft_mean")
        if value is not None and not math.isnan(value.mean):
            left.errorbar([i], [value.mean * 1e3], yerr=[value.half_width * 1e3 if value.has_interval else 0],
                          fmt="o", capsize=4)
    left.set_xticks(x, names, rotation=20)
    left.set_ylabel("mean TTFT (ms)")
    left.set_title("mean TTFT, 95% interval over runs")
    others = [n for n in names if n != result.baseline]
    for offset, field in ((-0.1, "ttft_mean"), (0.1, "recomputed")):
        xs, ys, errs = [], [], []
        for i, name in enumerate(others):
            value = change(result, name, field)
            if value is not None and not math.isnan(value.mean):
                xs.append(i + offset)
                ys.append(value.mean * 100)
                errs.append(value.half_width * 100 if value.has_interval else 0)
        right.errorbar(xs, ys, yerr=errs, fmt="o", capsize=4, label=_metric(field)[1])
    right.axhline(0.0, color="black", linewidth=0.8)
    left.set_xlim(-0.5, len(names) - 0.5)
    right.set_xlim(-0.5, max(1, len(others)) - 0.5)
    right.set_xticks(list(range(len(others))), others, rotation=20)
    right.set_ylabel(f"change vs {result.baseline} (%), paired")
    right.set_title("paired change against the baseline")
    right.legend(fontsize=8)
    for axis in (left, right):
        axis.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=10)
    save(fig, path)
