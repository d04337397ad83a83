"""Print docs/results.md's result tables (Markdown) from the JSON that ensemble replays wrote.

    python scripts/readme_tables.py weka results/weka    # after scripts/weka_results.sh
    python scripts/readme_tables.py synthetic results    # after penelope reproduce
    python scripts/readme_tables.py fleet results/mooncake/fleet.json    # after scripts/mooncake_fleet.sh

Every figure is a mean over the ensemble's runs with its 95% interval: hit rates as mean ±half-width,
changes against SGLang as mean [low, high], or "no significant difference [low, high]" when the
interval contains zero (`penelope.sim.ensemble_report.markdown_change`). Head-to-head rows compare
two policies run by run (paired), from the per-run figures in the JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from penelope.errors import UsageError
from penelope.sim.ensemble_report import markdown_change
from penelope.sim.stats import Estimate, paired_changes
from penelope.units import format_size

PENELOPE = ("penelope", "private-head-block")
# The script that writes each mode's JSON, named when a file is missing.
WRITERS = {"weka": "scripts/weka_results.sh", "synthetic": "penelope reproduce",
           "fleet": "scripts/mooncake_fleet.sh"}


class TableError(Exception):
    """Input the tables cannot be made from: one line on stderr, exit 2."""


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise TableError(f"{path}: missing")
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise TableError(f"{path}: not JSON") from None


def load(path: Path) -> tuple[dict, list[tuple[int, dict]]]:
    """(config, [(GPU capacity, results by policy)]) of one `penelope simulate --repeat` JSON."""
    payload = read_json(path)
    config = payload.get("config") if isinstance(payload, dict) else None
    if not isinstance(config, dict) or "ensemble" not in config:
        raise TableError(f"{path}: not an ensemble (run penelope simulate with --repeat N)")
    if "sweep" in payload:
        return config, [(entry["gpu_cache"], entry["results"]) for entry in payload["sweep"]]
    return config, [(config["gpu_cache"], payload["results"])]


def penelope_of(results: dict) -> dict:
    return next(results[name] for name in PENELOPE if name in results)


def baseline_of(results: dict) -> dict:
    return next(r for r in results.values() if r["policy"] == "leaf-tail-node")


def hit_rate(result: dict) -> str:
    estimate = Estimate.from_dict(result["metrics"]["hit_rate"])
    return f"{estimate.mean:.1%} ±{100 * estimate.half_width:.1f}"


def change(result: dict, field: str) -> str:
    return markdown_change(Estimate.from_dict(result["vs_sglang"][field]))


def skipped_note(results: dict) -> str:
    """The note " (N of M requests never fit the cache, left out)" when a run skipped requests."""
    run = penelope_of(results)["runs"][0]
    skipped = run.get("skipped_requests", 0)
    return f" ({skipped} of {run['requests'] + skipped} requests never fit the cache, left out)" if skipped else ""


def main_row(setting: str, results: dict) -> str:
    base, ours = baseline_of(results), penelope_of(results)
    cells = [setting + skipped_note(results), hit_rate(base), hit_rate(ours), change(ours, "ttft_mean"),
             change(ours, "ttft_p90"), change(ours, "jct_mean")]
    return "| " + " | ".join(cells) + " |"


MAIN_HEAD = (
    "| setting | SGLang hit rate (pressure) | Penelope hit rate | TTFT mean | TTFT p90 | JCT |\n"
    "|---|---|---|---|---|---|"
)


def head_to_head(results: dict, policy: str, other: str, field: str) -> Estimate:
    """`policy`'s change of `field` against `other`, paired run by run."""
    mine = [run[field] for run in results[policy]["runs"]]
    theirs = [run[field] for run in results[other]["runs"]]
    return Estimate.of(paired_changes(mine, theirs))


def ablation_table(sweep: list[tuple[int, dict]]) -> str:
    sizes = [format_size(capacity) for capacity, _ in sweep]
    columns = [f"TTFT mean, GPU {s}" for s in sizes] + [f"TTFT p90, GPU {s}" for s in sizes]
    lines = ["| policy | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name in sweep[0][1]:
        if sweep[0][1][name]["policy"] == "leaf-tail-node":
            continue
        label = f"{name} (Penelope)" if name in PENELOPE else name
        cells = [change(results[name], "ttft_mean") for _, results in sweep]
        cells += [change(results[name], "ttft_p90") for _, results in sweep]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


SGLANG_POLICIES = {"leaf-tail-node": "LRU (sglang)", "sglang-lfu": "LFU", "sglang-slru": "SLRU",
                   "sglang-tlru": "T-LRU", "sglang-session": "session cache"}


def sglang_policies_table(sweep: list[tuple[int, dict]]) -> str:
    """Per GPU capacity: each of SGLang's policies' hit rate and mean TTFT, then Penelope's change
    against the best of them (lowest mean TTFT over the ensemble), paired run by run."""
    head = ["GPU cache"] + [f"{label} hit rate / TTFT s" for label in SGLANG_POLICIES.values()]
    head += ["best SGLang policy", "Penelope TTFT mean vs best", "Penelope TTFT p90 vs best"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for capacity, results in sweep:
        ours = next(name for name in PENELOPE if name in results)
        theirs = {r["policy"] if r["policy"] == "leaf-tail-node" else name: name
                  for name, r in results.items() if name not in PENELOPE}
        missing = [policy for policy in SGLANG_POLICIES if policy not in theirs]
        if missing:
            raise TableError(f"GPU {format_size(capacity)}: no results for {', '.join(missing)}")
        cells = [format_size(capacity)]
        for policy in SGLANG_POLICIES:
            result = results[theirs[policy]]
            ttft = Estimate.from_dict(result["metrics"]["ttft_mean"])
            cells.append(f"{hit_rate(result)} / {ttft.mean:.3f}")
        best = min(SGLANG_POLICIES, key=lambda p: Estimate.from_dict(results[theirs[p]]["metrics"]["ttft_mean"]).mean)
        cells.append(SGLANG_POLICIES[best])
        cells += [markdown_change(head_to_head(results, ours, theirs[best], field))
                  for field in ("ttft_mean", "ttft_p90")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ensemble_note(config: dict) -> str:
    ensemble = config["ensemble"]
    text = (f"{ensemble['repeat']} runs per setting, each time-model constant x U[{1 - ensemble['band']:g}, "
            f"{1 + ensemble['band']:g}]")
    if ensemble["jitter"]:
        text += f", waits x U[{1 - ensemble['jitter']:g}, {1 + ensemble['jitter']:g}]"
    return text + f", seed {ensemble['seed']}; 95% intervals over runs, changes paired run by run"


# What each WEKA results file's label says of its configuration: (path in the config, value).
WEKA_SETTINGS = {
    "gpu_sweep": (("model", "qwen3-8b"), ("cpu_cache", 0), ("scheduler", "lpm")),
    "ablation": (("model", "qwen3-8b"), ("cpu_cache", 0)),
    "fcfs": (("scheduler", "fcfs"), ("cpu_cache", 0)),
    "tool_waits": (("workload.think_time.mode", "tool"), ("workload.think_time.cap", 60.0), ("cpu_cache", 0)),
    "gemma3": (("model", "gemma-3-27b"), ("cpu_cache", 0)),
    "qwen3_32b": (("model", "qwen3-32b"), ("cpu_cache", 0)),
    "triton_kernel": (("time_model.phantom_kernel", "triton"), ("cpu_cache", 0)),
    "two_tier_equal": (("cpu_cache", 128 * 1024),),
    "two_tier_4x": (("cpu_cache", 512 * 1024),),
}


def check_setting(name: str, config: dict) -> None:
    """TableError unless `config` (a WEKA results file's) is what the row's label says."""
    for path, expected in WEKA_SETTINGS[name]:
        value = config
        for key in path.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        if value != expected:
            raise TableError(f"{name}.json: {path} is {value!r}, its table row says {expected!r}")


def weka_file(folder: Path, name: str) -> tuple[dict, list[tuple[int, dict]]]:
    config, sweep = load(folder / f"{name}.json")
    check_setting(name, config)
    return config, sweep


def weka(folder: Path) -> None:
    rows = []
    config, sweep = weka_file(folder, "gpu_sweep")
    for capacity, results in sweep:
        setting = f"GPU {format_size(capacity)}" + (" (the paper's setting)" if capacity == 256 * 1024 else "")
        rows.append(main_row(setting, results))
    for name, label in (("fcfs", "FCFS, GPU {}"), ("tool_waits", "tool waits only, capped at 60 s, GPU {}"),
                        ("gemma3", "gemma-3-27b (sliding window), GPU {}"), ("qwen3_32b", "Qwen3-32B, GPU {}"),
                        ("triton_kernel", "phantom batches on the Triton kernel, GPU {}")):
        for capacity, results in weka_file(folder, name)[1]:
            rows.append(main_row(label.format(format_size(capacity)), results))
    for name, cpu in (("two_tier_equal", "128K"), ("two_tier_4x", "512K")):
        for capacity, results in weka_file(folder, name)[1]:
            setting = f"two tiers, GPU {format_size(capacity)} + CPU {cpu} (vs HiCache-like)"
            rows.append(main_row(setting, results))
    print(f"Main table ({ensemble_note(config)}):\n")
    print(MAIN_HEAD + "\n" + "\n".join(rows))
    print("\nAgainst each of SGLang's own policies (GPU only), same ensembles; hit rate mean ±half-width, "
          "mean TTFT over the runs; Penelope's change paired run by run:\n")
    print(sglang_policies_table(sweep))
    ablation_config, ablation = weka_file(folder, "ablation")
    print(f"\nAblation grid, changes against SGLang ({ensemble_note(ablation_config)}):\n")
    print(ablation_table(ablation))
    print("\nHead to head, leaf-head-block against Penelope (private-head-block), paired run by run:\n")
    print("| GPU cache | TTFT mean | TTFT p90 | recompute cost |\n|---|---|---|---|")
    for capacity, results in ablation:
        cells = [markdown_change(head_to_head(results, "leaf-head-block", "private-head-block", field))
                 for field in ("ttft_mean", "ttft_p90", "recompute_cost")]
        print(f"| {format_size(capacity)} | " + " | ".join(cells) + " |")


def synthetic(folder: Path) -> None:
    config, sweep = load(folder / "simulate.json")
    print(f"Capacity sweep ({ensemble_note(config)}):\n")
    rows = [main_row(format_size(capacity), results) for capacity, results in sweep]
    print(MAIN_HEAD.replace("| setting |", "| GPU cache |") + "\n" + "\n".join(rows))
    ablation_config, ablation = load(folder / "ablation.json")
    print(f"\nAblation grid, changes against SGLang ({ensemble_note(ablation_config)}):\n")
    print(ablation_table(ablation))


def mean_of_runs(result: dict, key: str) -> float:
    """Mean over an ensemble's runs of a figure of each run's fleet (`imbalance`, ...)."""
    values = [run["fleet"][key] for run in result["runs"]]
    return sum(values) / len(values)


def plus_minus_seconds(result: dict, field: str) -> str:
    estimate = Estimate.from_dict(result["metrics"][field])
    return f"{estimate.mean:.2f} ±{estimate.half_width:.2f}"


def fleet(path: Path) -> None:
    """One row per (GPU capacity, router) of a `simulate --replicas N --router ... --repeat M` JSON."""
    payload = read_json(path)
    config = payload.get("config") if isinstance(payload, dict) else None
    if not isinstance(config, dict) or "ensemble" not in config or config.get("replicas", 1) < 2:
        raise TableError(f"{path}: not a fleet ensemble (run penelope simulate with --replicas N --repeat M)")
    entries = payload["sweep"] if "sweep" in payload else [
        {"gpu_cache": config["gpu_cache"], "router": config["routers"][0], "results": payload["results"]}]
    print(f"Fleet of {config['replicas']} replicas ({ensemble_note(config)}):\n")
    print("| GPU cache per replica | router | SGLang hit rate | Penelope hit rate | SGLang TTFT mean s | TTFT mean "
          "| TTFT p90 | JCT | load imbalance (busy max/mean) |\n|---|---|---|---|---|---|---|---|---|")
    for entry in entries:
        results = entry["results"]
        base, ours = baseline_of(results), penelope_of(results)
        cells = [format_size(entry["gpu_cache"]), entry["router"], hit_rate(base), hit_rate(ours),
                 plus_minus_seconds(base, "ttft_mean"), change(ours, "ttft_mean"), change(ours, "ttft_p90"),
                 change(ours, "jct_mean"), f"{mean_of_runs(base, 'imbalance'):.2f}"]
        print("| " + " | ".join(cells) + " |")


def main(argv: list[str]) -> int:
    modes = {"weka": weka, "synthetic": synthetic, "fleet": fleet}
    if len(argv) != 2 or argv[0] not in modes:
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        return 2
    try:
        modes[argv[0]](Path(argv[1]))
    except TableError as err:
        print(f"readme_tables: {err} ({WRITERS[argv[0]]} writes the results)", file=sys.stderr)
        return 2
    except (KeyError, TypeError, UsageError) as err:
        print(f"readme_tables: the results in {argv[1]} are not what {WRITERS[argv[0]]} writes "
              f"({type(err).__name__}: {err})", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
