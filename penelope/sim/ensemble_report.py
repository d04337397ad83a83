"""Tables and plots of replay ensembles (`penelope.sim.ensemble.Ensemble`): every metric as mean
and 95% interval, every change against SGLang with its interval and verdict.

Cells: an absolute metric is `mean ±h` (h: half-width of its interval; the Student-t interval is
symmetric); a change is `mean [low, high]`, and a change whose interval contains zero reads
`no significant difference [low, high]` in Markdown (`markdown_change`), so a table never calls a
difference a win or a loss that the runs do not support.
"""

from __future__ import annotations

import math

from penelope.sim.fleet.report import fleet_label
from penelope.sim.stats import NO_DIFFERENCE, Estimate
from penelope.tables import format_table
from penelope.units import format_size

# Changes listed for every policy (field, label); times and costs relative, hit rate in points.
CHANGE_ROWS = (
    ("ttft_mean", "TTFT mean"),
    ("ttft_p50", "TTFT p50"),
    ("ttft_p90", "TTFT p90"),
    ("jct_mean", "JCT mean"),
    ("hit_rate_points", "hit rate (points)"),
    ("recompute_cost", "recompute cost"),
)


def plus_minus(estimate: Estimate, fmt: str) -> str:
    """`mean ±half-width` in format `fmt` (for example `.3f`); the mean alone without an interval."""
    if math.isnan(estimate.mean):
        return "n/a"
    text = format(estimate.mean, fmt)
    if estimate.has_interval:
        text += " ±" + format(estimate.half_width, fmt)
    return text


def change_interval(estimate: Estimate, points: bool = False) -> tuple[str, str]:
    """(`mean`, `[low, high]`) of a change: percentages, or percentage points when `points`."""
    if math.isnan(estimate.mean):
        return "n/a", ""
    # Changes well under 1% (a session's completion time) get a second decimal, not "-0.0%".
    largest = max(abs(v) for v in (estimate.mean, estimate.low, estimate.high) if not math.isnan(v))
    digits = 2 if largest < 0.01 else 1

    def one(value: float) -> str:
        return f"{value:+.2f}" if points else f"{value:+.{digits}%}"

    interval = f"[{one(estimate.low)}, {one(estimate.high)}]" if estimate.has_interval else ""
    return one(estimate.mean), interval


def markdown_change(estimate: Estimate, lower_is_better: bool = True, points: bool = False) -> str:
    """A cell of docs/results.md's tables: `-28.7% [-31.2%, -26.1%]`, or `no significant difference
    [-1.1%, +1.9%]`, or `identical in every run` when every run's change is exactly zero."""
    if estimate.low == estimate.mean == estimate.high == 0.0:
        return "identical in every run"
    mean, interval = change_interval(estimate, points)
    if estimate.verdict(lower_is_better) == NO_DIFFERENCE:
        return f"{NO_DIFFERENCE} {interval}".rstrip()
    return f"{mean} {interval}".rstrip()


def ensemble_tables(capacity: int, ensemble) -> str:
    """The two tables of one capacity: metrics per policy, then changes against SGLang."""
    base = ensemble.baseline
    first = ensemble.runs[0][base]
    pressure = ensemble.estimate(base, "hit_rate")
    skipped = first.replay.skipped
    perturbation = ensemble.perturbation.describe() if ensemble.perturbation else "no perturbation"
    head = (
        f"GPU cache {format_size(capacity)}{fleet_label(ensemble.config)}: pressure = SGLang hit rate "
        f"{plus_minus(pressure, '.1%')}, "
        f"{first.summary.requests:,} requests"
        + (f" ({skipped} never fit the cache and were skipped)" if skipped else "")
        + f"\n{ensemble.repeat} runs ({perturbation}); mean ±half-width of the "
        f"{ensemble.confidence:.0%} interval over runs"
    )
    rows = []
    for name in ensemble.policies:
        rows.append((
            name,
            plus_minus(ensemble.estimate(name, "ttft_mean"), ".3f"),
            plus_minus(ensemble.estimate(name, "ttft_p50"), ".3f"),
            plus_minus(ensemble.estimate(name, "ttft_p90"), ".3f"),
            plus_minus(ensemble.estimate(name, "jct_mean"), ",.1f"),
            plus_minus(ensemble.estimate(name, "hit_rate"), ".2%"),
            plus_minus(ensemble.estimate(name, "recomputed_tokens"), ",.0f"),
            plus_minus(ensemble.estimate(name, "recompute_cost"), ".3g"),
        ))
    metrics = format_table(
        ("policy", "TTFT mean s", "TTFT p50", "TTFT p90", "JCT mean s", "hit rate", "recomputed tok",
         "recompute cost"),
        rows,
    )
    changes = []
    for name in ensemble.policies:
        if name == base:
            continue
        for field, label in CHANGE_ROWS:
            mean, interval = change_interval(ensemble.change(name, field), points=field == "hit_rate_points")
            changes.append((name, label, mean, interval, ensemble.verdict(name, field)))
    text = head + "\n" + metrics
    if ensemble.has_oracle:
        text += "\n" + oracle_rows(ensemble)
    if changes:
        text += (
            f"\nchanges against {base}, paired run by run (mean and {ensemble.confidence:.0%} interval):\n"
            + format_table(("policy", "metric", "change", "interval", "verdict"), changes)
        )
    return text


def oracle_rows(ensemble) -> str:
    """The oracle bracket and every policy's distance to the oracle's run, paired run by run."""
    oracle = next(name for name, r in ensemble.runs[0].items() if r.bound is not None)
    bracket = (f"oracle bracket: the optimal recompute cost lies in [{plus_minus(ensemble.bound(), '.3g')} "
               f"(lower bound), {plus_minus(ensemble.estimate(oracle, 'recompute_cost'), '.3g')} (oracle)]; "
               "distance to the oracle's run, paired run by run:")
    rows = []
    for name in ensemble.policies:
        cells = [" ".join(change_interval(ensemble.to_oracle(name, field))).strip()
                 for field in ("recompute_cost", "cost_over_bound", "ttft_mean", "jct_mean")]
        rows.append((name, *cells))
    return bracket + "\n" + format_table(
        ("policy", "cost vs oracle", "cost vs bound", "TTFT vs oracle", "JCT vs oracle"), rows)


def plot_ensembles(path: str, sweep: list, model: str) -> None:
    """Against the GPU capacity, per policy: mean TTFT, its paired change against SGLang, and the
    hit rate, each with its interval as error bars; with an oracle, also the recompute cost with
    the oracle bracket (lower bound to oracle) shaded."""
    from penelope.plotting import capacity_axis, pyplot, save, shade_oracle_bracket

    plt = pyplot()
    oracle = sweep[0][1].has_oracle
    fig, axes = plt.subplots(1, 4 if oracle else 3, figsize=(20 if oracle else 15, 4))
    left, middle, right = axes[:3]
    labels = [format_size(capacity) for capacity, _ in sweep]
    x = list(range(len(sweep)))
    policies = sweep[0][1].policies

    def bars(axis, offset, name, estimates, scale):
        # Shift policies apart a little so their error bars do not hide each other.
        shifted = [i + 0.04 * (offset - (len(policies) - 1) / 2) for i in x]
        means = [scale * e.mean for e in estimates]
        errors = [scale * e.half_width if e.has_interval else 0.0 for e in estimates]
        axis.errorbar(shifted, means, yerr=errors, fmt="o-", capsize=3, label=name)

    for offset, name in enumerate(policies):
        bars(left, offset, name, [e.estimate(name, "ttft_mean") for _, e in sweep], 1.0)
        bars(middle, offset, name, [e.change(name, "ttft_mean") for _, e in sweep], 100.0)
        bars(right, offset, name, [e.estimate(name, "hit_rate") for _, e in sweep], 100.0)
    middle.axhline(0.0, color="black", linewidth=0.8)
    if oracle:
        for offset, name in enumerate(policies):
            bars(axes[3], offset, name, [e.estimate(name, "recompute_cost") for _, e in sweep], 1.0)
        oracle_name = next(n for n, r in sweep[0][1].runs[0].items() if r.bound is not None)
        shade_oracle_bracket(axes[3], x, [e.bound().mean for _, e in sweep],
                             [e.estimate(oracle_name, "recompute_cost").mean for _, e in sweep], labels)
    repeat = sweep[0][1].repeat
    for axis, label in ((left, "mean TTFT (s)"), (middle, "mean TTFT change vs sglang (%), paired"),
                        (right, "hit rate (%)")):
        capacity_axis(axis, x, labels, label)
    left.legend(fontsize=8)
    save(fig, path, f"{model}: trace replay by eviction policy ({repeat} runs, 95% intervals)")
