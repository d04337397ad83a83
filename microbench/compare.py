"""Compare a pytest-benchmark JSON with a stored baseline of the same machine kind.

Raw times are not compared: they move with the machine's load, clocks and neighbours. What is
compared are the figures each benchmark records in ``extra_info``:

- exact figures: work counts that must not change unless the work itself changed. A key is exact
  when its name ends in ``_exact``, or when its value is an integer and its name matches one of
  ``EXACT_PATTERNS`` (``*_pairs``, ``tile_pairs_*``, ``*_bytes``, ``*_tiles``, and the compile
  report's ``registers`` and ``*mma_instructions``; its spill and shared-memory figures end in
  ``_bytes``). Any difference is a regression.
- ratio figures: ratios of times measured in the same run (speedups, throughput against a
  baseline provider, efficiencies), which cancel most of the machine's drift. A key is a ratio
  when its name matches ``RATIO_PATTERNS`` (``ratio``, ``*_ratio``, ``ratio_*``, ``*_ratio_*``,
  ``*speedup*``, ``*efficiency*``, ``fraction_of_*``). Higher is better, except keys matching
  ``LOWER_IS_BETTER`` (``*bytes_ratio*``: traffic against a reference), patterns given with
  ``--lower-is-better``, and patterns a benchmark lists in its own ``extra_info["lower_is_better"]``
  (e.g. ``["ratio"]`` for a cost ratio). A change worse than ``--threshold`` (relative, default
  0.15) is a regression.

Other keys (environment, shapes, absolute times) are shown nowhere and never fail. A benchmark
or a tracked figure of the baseline that is missing from the new results is a regression (pass
``--allow-missing`` when benchmarks were deliberately removed or skipped).

Usage::

    python microbench/compare.py NEW.json [--baseline BASE.json] [--threshold 0.15]

The default baseline is ``microbench/baselines/<machine_kind>.json``, ``machine_kind`` being the
value the microbenchmarks' conftest records (``cpu``, ``nvidia-h200``, ...). Comparing results of
different machine kinds is refused unless ``--any-machine`` is given.

``--update-baseline`` stores the new results as the baseline instead (without pytest-benchmark's
raw per-round times).

Exit codes: 0 no regression, 1 regressions, 2 unusable input.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

BASELINES = Path(__file__).resolve().parent / "baselines"
EXACT_PATTERNS = ("*_pairs", "tile_pairs_*", "*_bytes", "*_tiles", "registers", "*mma_instructions")
RATIO_PATTERNS = ("ratio", "*_ratio", "ratio_*", "*_ratio_*", "*speedup*", "*efficiency*", "fraction_of_*")
LOWER_IS_BETTER = ("*bytes_ratio*",)
DEFAULT_THRESHOLD = 0.15

OK, IMPROVED, REGRESSION, MISSING, NEW = "ok", "improved", "REGRESSION", "MISSING", "new"


class InputError(Exception):
    """A results file that cannot be compared (unreadable, not pytest-benchmark, other machine)."""


@dataclass(frozen=True)
class Row:
    """One compared figure of one benchmark (``figure`` is "" for a whole missing benchmark)."""

    benchmark: str
    figure: str
    kind: str
    baseline: float | int | None
    new: float | int | None
    change: float | None
    status: str


def _matches(key: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in patterns)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def figure_kind(key: str, value) -> str | None:
    """``"exact"``, ``"ratio"`` or None (not tracked) for an ``extra_info`` entry."""
    if not _is_number(value):
        return None
    if key.endswith("_exact") or (isinstance(value, int) and _matches(key, EXACT_PATTERNS)):
        return "exact"
    if _matches(key, RATIO_PATTERNS):
        return "ratio"
    return None


def load_results(path: str | Path) -> dict:
    """A pytest-benchmark JSON file as a dict; raises InputError when it is not one."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except (OSError, json.JSONDecodeError) as err:
        raise InputError(f"{path}: not readable JSON ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list):
        raise InputError(f"{path}: not a pytest-benchmark JSON (no 'benchmarks' list)")
    for bench in data["benchmarks"]:
        if not isinstance(bench, dict) or "fullname" not in bench:
            raise InputError(f"{path}: a benchmark entry without 'fullname'")
    return data


def machine_kind(data: dict, path: str | Path = "results") -> str:
    """The ``machine_kind`` all benchmarks of ``data`` agree on ("unknown" when none records it)."""
    kinds = {b.get("extra_info", {}).get("machine_kind") for b in data["benchmarks"]} - {None}
    if len(kinds) > 1:
        raise InputError(f"{path}: results from several machine kinds: {sorted(kinds)}")
    return kinds.pop() if kinds else "unknown"


def compare(baseline: dict, new: dict, threshold: float = DEFAULT_THRESHOLD, lower_is_better=(),
            allow_missing: bool = False) -> list[Row]:
    """Rows for every tracked figure of every benchmark in either file, with a status each."""
    lower = tuple(LOWER_IS_BETTER) + tuple(lower_is_better)
    base_by_name = {b["fullname"]: b for b in baseline["benchmarks"]}
    new_by_name = {b["fullname"]: b for b in new["benchmarks"]}
    missing_status = OK if allow_missing else MISSING
    rows = []
    for name, base_bench in base_by_name.items():
        new_bench = new_by_name.get(name)
        if new_bench is None:
            rows.append(Row(name, "", "", None, None, None, missing_status))
            continue
        base_info, new_info = base_bench.get("extra_info", {}), new_bench.get("extra_info", {})
        for key, base_value in sorted(base_info.items()):
            kind = figure_kind(key, base_value)
            if kind is None:
                continue
            value = new_info.get(key)
            if not _is_number(value):
                rows.append(Row(name, key, kind, base_value, None, None, missing_status))
            elif kind == "exact":
                status = OK if value == base_value else REGRESSION
                change = (value - base_value) / base_value if base_value else None
                rows.append(Row(name, key, kind, base_value, value, change, status))
            else:
                declared = _declared_lower(base_info) + _declared_lower(new_info)
                rows.append(_ratio_row(name, key, base_value, value, threshold, _matches(key, lower + declared)))
        for key, value in sorted(new_info.items()):
            kind = figure_kind(key, value)
            if kind is not None and key not in base_info:
                rows.append(Row(name, key, kind, None, value, None, NEW))
    for name in sorted(new_by_name.keys() - base_by_name.keys()):
        rows.append(Row(name, "", "", None, None, None, NEW))
    return rows


def _declared_lower(info: dict) -> tuple[str, ...]:
    """Key patterns a benchmark declares lower-is-better in ``extra_info["lower_is_better"]``."""
    declared = info.get("lower_is_better", ())
    if isinstance(declared, str):
        return (declared,)
    if not isinstance(declared, (list, tuple)):
        return ()
    return tuple(item for item in declared if isinstance(item, str))


def _ratio_row(name, key, base_value, value, threshold, lower_better) -> Row:
    if base_value == 0:
        change = None if value == 0 else math.copysign(math.inf, value)
    else:
        change = value / base_value - 1.0
    worse = change is not None and (change > threshold if lower_better else change < -threshold)
    better = change is not None and (change < -threshold if lower_better else change > threshold)
    status = REGRESSION if worse else IMPROVED if better else OK
    kind = "ratio (lower better)" if lower_better else "ratio"
    return Row(name, key, kind, base_value, value, change, status)


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.4g}"


def _short(name: str) -> str:
    # "microbench/bench_x.py::test_y[param]" -> "bench_x::test_y[param]"
    path, _, test = name.partition("::")
    return f"{Path(path).stem}::{test}" if test else name


def format_table(rows: list[Row]) -> str:
    """A plain-text table of the rows (benchmark, figure, kind, baseline, new, change, status)."""
    header = ("benchmark", "figure", "kind", "baseline", "new", "change", "status")
    lines = [header]
    for row in rows:
        change = "-" if row.change is None else f"{row.change:+.1%}"
        lines.append((_short(row.benchmark), row.figure, row.kind, _fmt(row.baseline), _fmt(row.new), change,
                      row.status))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
                     for line in lines)


def write_baseline(data: dict, path: str | Path) -> None:
    """Store ``data`` as a baseline, without the raw per-round times (never compared, and large)."""
    stored = dict(data)
    stored["benchmarks"] = []
    for bench in data["benchmarks"]:
        bench = dict(bench)
        if isinstance(bench.get("stats"), dict):
            bench["stats"] = {key: value for key, value in bench["stats"].items() if key != "data"}
        stored["benchmarks"].append(bench)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stored, indent=1) + "\n")


def failures(rows: list[Row]) -> list[Row]:
    return [row for row in rows if row.status in (REGRESSION, MISSING)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="new pytest-benchmark JSON (--benchmark-json)")
    parser.add_argument("--baseline", help="baseline JSON (default: microbench/baselines/<machine_kind>.json)")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                        help=f"relative change of a ratio that counts as a regression (default {DEFAULT_THRESHOLD})")
    parser.add_argument("--lower-is-better", action="append", default=[], metavar="PATTERN",
                        help="ratio keys (fnmatch pattern) for which lower is better; repeatable")
    parser.add_argument("--allow-missing", action="store_true",
                        help="do not fail on baseline benchmarks or figures absent from the new results")
    parser.add_argument("--any-machine", action="store_true", help="compare even if the machine kinds differ")
    parser.add_argument("--update-baseline", action="store_true",
                        help="store the results as the baseline (--baseline or the default) instead of comparing")
    args = parser.parse_args(argv)
    if not args.threshold > 0:
        print(f"compare: error: --threshold must be positive, got {args.threshold}", file=sys.stderr)
        return 2
    try:
        new = load_results(args.results)
        kind = machine_kind(new, args.results)
        baseline_path = Path(args.baseline) if args.baseline else BASELINES / f"{kind}.json"
        if args.update_baseline:
            write_baseline(new, baseline_path)
            print(f"stored {len(new['benchmarks'])} results of machine kind {kind!r} as {baseline_path}")
            return 0
        baseline = load_results(baseline_path)
        base_kind = machine_kind(baseline, baseline_path)
        if base_kind != kind and not args.any_machine:
            raise InputError(f"baseline {baseline_path} is from machine kind {base_kind!r}, results from {kind!r}")
    except InputError as err:
        print(f"compare: error: {err}", file=sys.stderr)
        return 2

    rows = compare(baseline, new, args.threshold, args.lower_is_better, args.allow_missing)
    print(f"baseline: {baseline_path} ({base_kind}, commit {_commit(baseline)})")
    print(f"results:  {args.results} ({kind}, commit {_commit(new)})")
    print(f"threshold for ratios: {args.threshold:.0%}; exact figures must match\n")
    print(format_table(rows))
    bad = failures(rows)
    if bad:
        print(f"\n{len(bad)} regression(s):")
        for row in bad:
            what = f"{row.figure} " if row.figure else ""
            print(f"  {_short(row.benchmark)}: {what}{row.status.lower()} "
                  f"(baseline {_fmt(row.baseline)}, new {_fmt(row.new)})")
        return 1
    print("\nno regression")
    return 0


def _commit(data: dict) -> str:
    commits = {b.get("extra_info", {}).get("commit") for b in data["benchmarks"]} - {None}
    commit = commits.pop() if len(commits) == 1 else (data.get("commit_info") or {}).get("id")
    return (commit or "unknown")[:12]


if __name__ == "__main__":
    sys.exit(main())
