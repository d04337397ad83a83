"""Penelope against SGLang's own eviction policies in SGLang's real HTTP server on CPU: the table.

    python scripts/sglang_ab_table.py --out results/cpu/ab-table          # about 90 minutes on 2 cores
    python scripts/sglang_ab_table.py --pool 61440 --out results/cpu/ab-table-61k   # the same, more pressure
    python scripts/sglang_ab_table.py --out results/cpu/ab-table --render # the table of a finished run

Runs `penelope ab` (docs/ab.md) with six configurations (Penelope's cache and SGLang 0.5.23's
`lru`, `lfu`, `slru`, `tlru` and session radix cache), every server up at once and the rounds
interleaved, on:
- the scale model of Qwen3-8B at scale 7 (`--model scale:7`: every token count divided by 7, the
  linear cost per token divided by 7, so the cost model predicts at 1/7 of the context the ratios it
  predicts for Qwen3-8B at full context) with the prefix-aware CPU attention;
- four WEKA Claude Code sessions that reach 118K-131K tokens (17K-19K after scaling), each started
  at its first prompt of 104K tokens or more (`--from-context`: its whole history as one prompt,
  then 7 more turns as recorded), all four at once, a twentieth of the recorded waits (at most 1 s);
- each session's first turn primes the server (`--prime`, not measured): the measured turns start
  from histories the server has computed, as in a long-running agent session;
- a pool of 63,488 tokens (62K): the four histories need about 66K, so every configuration evicts
  (SGLang's LRU caches 91% of prompt tokens); `--pool 61440` puts LRU at 85% (docs/ab.md has both
  tables).

`--render` prints the markdown table of `OUT/ab.json` (also written as `OUT/table.md`): per
configuration TTFT mean and p90 with their 95% intervals over the rounds, the cached fraction, the
prefill tokens recomputed (the servers' own counters less a never-evicting cache's), and Penelope's
paired change against each of SGLang's policies.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT.parent / "shared" / "traces" / "weka-claude-code"
SESSIONS = ("trace_0287.json", "trace_0353.json", "trace_0586.json", "trace_0604.json")
CONFIGS = ("penelope", "sglang-lru", "sglang-lfu", "sglang-slru", "sglang-tlru", "sglang-session")
SGLANG = CONFIGS[1:]


def ab_command(out: Path, traces: Path, repeat: int, pool: int) -> list[str]:
    return [sys.executable, "-m", "penelope.cli", "ab", *CONFIGS, "--baseline", "sglang-lru",
            "--model", "scale:7", "--scale", "7", "--pool", str(pool), "--chunk", "1024", "--page-size", "16",
            "--trace", str(traces), "--from-context", "104K", "--turns", "8", "--prime", "--sessions", "4",
            "--think-time", "scale:0.05,cap:1", "--repeat", str(repeat), "--resident-servers",
            "--warmup", "1", "--warmup-requests", "4", "--no-progress", "--out", str(out)]


def link_traces(folder: Path, source: Path) -> Path:
    """A folder with the table's four sessions (links to the shared traces)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in SESSIONS:
        target = source / name
        if not target.is_file():
            raise SystemExit(f"{target}: missing (the WEKA traces live in shared/traces/weka-claude-code)")
        link = folder / name
        if not link.exists():
            link.symlink_to(target)
    return folder


def _interval(estimate: dict, digits: int = 2) -> str:
    """mean [low, high]; the mean alone when one run gives no interval."""
    if estimate.get("low") is None or estimate.get("high") is None:
        return f"{estimate['mean']:.{digits}f}"
    return f"{estimate['mean']:.{digits}f} [{estimate['low']:.{digits}f}, {estimate['high']:.{digits}f}]"


def _change(values: list[float], base: list[float]) -> str:
    from penelope.sim.stats import Estimate, paired_changes

    estimate = Estimate.of(paired_changes(values, base))
    return f"{estimate.mean:+.1%} [{estimate.low:+.1%}, {estimate.high:+.1%}]"


def render(payload: dict) -> str:
    """The markdown table of an `ab.json` (see the module docstring)."""
    runs: dict[str, dict[int, dict]] = {}
    for run in payload["runs"]:
        runs.setdefault(run["config"], {})[run["round"]] = run
    est = payload["estimates"]
    lines = ["| configuration | rounds | TTFT mean s [95% CI] | TTFT p90 s [95% CI] | cached fraction | "
             "prefill recomputed (tokens) | Penelope's TTFT mean change vs it [95% CI] | "
             "Penelope's TTFT p90 change vs it |",
             "|---|---|---|---|---|---|---|---|"]
    mine = runs.get("penelope", {})
    for name in CONFIGS:
        if name not in runs:
            continue
        e = est[name]
        versus = p90 = "-"
        if name != "penelope":
            rounds = sorted(set(mine) & set(runs[name]))
            if len(rounds) >= 2:
                versus = _change([mine[r]["ttft_mean"] for r in rounds], [runs[name][r]["ttft_mean"] for r in rounds])
                p90 = _change([mine[r]["ttft_p90"] for r in rounds], [runs[name][r]["ttft_p90"] for r in rounds])
        recomputed = e.get("recomputed")
        redone = "-" if recomputed is None else _interval(recomputed, digits=0)
        lines.append(f"| {name} | {len(runs[name])} | {_interval(e['ttft_mean'])} | {_interval(e['ttft_p90'])} | "
                     f"{e['cached_fraction']['mean']:.1%} | {redone} | {versus} | {p90} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output folder (penelope ab's, and table.md)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--pool", type=int, default=63488, help="KV pool in tokens (default 63,488)")
    parser.add_argument("--traces", type=Path, default=TRACES, help="the WEKA trace folder")
    parser.add_argument("--render", action="store_true", help="only print the table of OUT/ab.json")
    args = parser.parse_args(argv)
    if not args.render:
        traces = link_traces(args.out.parent / f"{args.out.name}-traces", args.traces)
        command = ab_command(args.out, traces, args.repeat, args.pool)
        print(" ".join(command), flush=True)
        # tests/engine_stub stands in for sgl_kernel's CPU build, as in every CPU run of SGLang here.
        path = os.pathsep.join(p for p in (str(ROOT / "tests" / "engine_stub"), os.environ.get("PYTHONPATH")) if p)
        code = subprocess.call(command, env={**os.environ, "PYTHONPATH": path}, cwd=ROOT)
        if code not in (0, 130, 143):
            return code
    path = args.out / "ab.json"
    if not path.is_file():
        raise SystemExit(f"{path}: no ab.json (the run wrote nothing)")
    table = render(json.loads(path.read_text()))
    (args.out / "table.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
