"""Print docs/results.md's "Beyond the paper" tables (Markdown) from the JSON that
scripts/beyond_results.sh wrote.

    python scripts/beyond_tables.py results/beyond

Per setting, per policy: TTFT mean and p90, JCT mean, hit rate, recompute cost (means over the
runs, ± the half-width of the 95% interval), the paired change of mean TTFT and JCT against
Penelope, and the distance to the oracle's run (recompute cost and mean TTFT, paired); then the
oracle bracket (lower bound, oracle) on the optimal recompute cost.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from penelope.sim.ensemble_report import markdown_change
from penelope.sim.stats import Estimate, paired_changes

SETTINGS = (
    ("gpu_capped", "GPU-only 160K, think times capped at 30 s (loaded)"),
    ("two_tier_capped", "two tiers 128K + 128K, think times capped at 30 s (loaded)"),
    ("gpu_recorded", "GPU-only 160K, recorded think times"),
    ("two_tier_recorded", "two tiers 128K + 128K, recorded think times"),
)


def plus_minus(values: list[float], fmt: str) -> str:
    estimate = Estimate.of(values)
    return f"{estimate.mean:{fmt}} ±{estimate.half_width:{fmt}}" if estimate.has_interval else f"{estimate.mean:{fmt}}"


def paired(results: dict, policy: str, other: str, field: str) -> Estimate:
    mine = [run[field] for run in results[policy]["runs"]]
    theirs = [run[field] for run in results[other]["runs"]]
    return Estimate.of(paired_changes(mine, theirs))


def setting_table(results: dict) -> str:
    lines = ["| policy | TTFT mean s | TTFT p90 s | JCT mean s | hit rate | recompute cost | TTFT vs penelope "
             "| JCT vs penelope | cost vs oracle | TTFT vs oracle |", "|---" * 10 + "|"]
    for name, result in results.items():
        runs = result["runs"]
        cells = [
            plus_minus([r["ttft_mean"] for r in runs], ".2f"),
            plus_minus([r["ttft_p90"] for r in runs], ".2f"),
            plus_minus([r["jct_mean"] for r in runs], ",.0f"),
            plus_minus([100 * r["hit_rate"] for r in runs], ".1f") + "%",
            plus_minus([r["recompute_cost"] for r in runs], ".3g"),
            "—" if name == "penelope" else markdown_change(paired(results, name, "penelope", "ttft_mean")),
            "—" if name == "penelope" else markdown_change(paired(results, name, "penelope", "jct_mean")),
            "—" if name == "oracle" else markdown_change(paired(results, name, "oracle", "recompute_cost")),
            "—" if name == "oracle" else markdown_change(paired(results, name, "oracle", "ttft_mean")),
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    oracle = results["oracle"]["runs"]
    lines.append("")
    bound = plus_minus([r["recompute_bound"] for r in oracle], ".3g")
    paid = plus_minus([r["recompute_cost"] for r in oracle], ".3g")
    lines.append(f"Oracle bracket on the optimal recompute cost: [{bound} (lower bound), {paid} (oracle)].")
    return "\n".join(lines)


def main(folder: str) -> None:
    for name, title in SETTINGS:
        path = Path(folder) / f"{name}.json"
        payload = json.loads(path.read_text())
        runs = payload["config"]["ensemble"]["repeat"]
        print(f"#### {title} ({runs} runs)\n")
        print(setting_table(payload["results"]))
        print()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python scripts/beyond_tables.py RESULTS_FOLDER")
    main(sys.argv[1])
