"""Regression tracking of the microbenchmarks (microbench/compare.py) on hand-made result files."""

import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest

COMPARE_PATH = Path(__file__).resolve().parents[2] / "microbench" / "compare.py"
_spec = importlib.util.spec_from_file_location("microbench_compare", COMPARE_PATH)
compare = importlib.util.module_from_spec(_spec)
# Dataclasses look their module up in sys.modules while the module executes.
sys.modules[_spec.name] = compare
_spec.loader.exec_module(compare)


def _bench(name: str, **extra) -> dict:
    return {
        "name": name,
        "fullname": f"microbench/bench_demo.py::{name}",
        "params": None,
        "stats": {"median": 0.5, "min": 0.4},
        "extra_info": {"machine_kind": "cpu", "commit": "abc123", "device_name": "AMD EPYC", **extra},
    }


def _results(*benches) -> dict:
    return {"machine_info": {"node": "x"}, "commit_info": {"id": "abc123"}, "benchmarks": list(benches)}


BASELINE = _results(
    _bench("test_kernel[8K]", tile_pairs_visited=1200, kv_bytes=4096, speedup=2.0, efficiency=0.9,
           kv_bytes_ratio_vs_sglang=0.25, gbps=3.1, shape="qwen3-8b"),
    _bench("test_curve[8K]", front_query_tokens_exact=2970, measured_speedup=1.1, relative_error=0.02),
)


def _write(tmp_path: Path, name: str, data: dict) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def _run(tmp_path, new: dict, *args, baseline: dict = BASELINE):
    base_path = _write(tmp_path, "base.json", baseline)
    new_path = _write(tmp_path, "new.json", new)
    return compare.main([str(new_path), "--baseline", str(base_path), *args])


def _edit(index: int, **changes) -> dict:
    new = copy.deepcopy(BASELINE)
    new["benchmarks"][index]["extra_info"].update(changes)
    return new


@pytest.mark.parametrize(
    ("key", "value", "kind"),
    [
        ("tile_pairs_visited", 10, "exact"),
        ("causal_pairs", 10, "exact"),
        ("kv_bytes", 10, "exact"),
        ("query_tiles", 3, "exact"),
        ("front_seconds_exact", 1.5, "exact"),
        ("kv_bytes_per_query", 1.5, None),  # a float average, not a count
        ("kv_bytes", 10.5, None),
        ("speedup", 1.2, "ratio"),
        ("measured_speedup", 1.2, "ratio"),
        ("efficiency", 0.9, "ratio"),
        ("tile_efficiency", 0.9, "ratio"),
        ("fraction_of_memcpy_peak", 0.8, "ratio"),
        ("ratio_vs_sglang", 1.3, "ratio"),
        ("ratio", 16.5, "ratio"),
        ("requests_per_second", 1500.0, None),
        ("kv_bytes_ratio_vs_sglang", 0.2, "ratio"),
        ("gbps", 3.0, None),  # an absolute throughput: never compared
        ("median_ms", 3.0, None),
        ("speedup", True, None),
        ("speedup", "fast", None),
        ("speedup", float("nan"), None),
    ],
)
def test_figure_kinds(key, value, kind):
    assert compare.figure_kind(key, value) == kind


def test_identical_results_pass(tmp_path, capsys):
    assert _run(tmp_path, copy.deepcopy(BASELINE)) == 0
    out = capsys.readouterr().out
    assert "no regression" in out
    # Every tracked figure is in the table; untracked ones are not.
    for figure in ("tile_pairs_visited", "kv_bytes", "speedup", "efficiency", "front_query_tokens_exact"):
        assert figure in out
    assert "gbps" not in out and "relative_error" not in out


def test_exact_figure_change_by_one_is_a_regression(tmp_path, capsys):
    assert _run(tmp_path, _edit(0, tile_pairs_visited=1201)) == 1
    out = capsys.readouterr().out
    assert "1 regression(s)" in out
    assert "tile_pairs_visited regression (baseline 1,200, new 1,201)" in out


def test_exact_float_figure_compared_exactly(tmp_path):
    assert _run(tmp_path, _edit(1, front_query_tokens_exact=2970.0)) == 0
    assert _run(tmp_path, _edit(1, front_query_tokens_exact=2970.5)) == 1


@pytest.mark.parametrize(
    ("changes", "code"),
    [
        ({"speedup": 1.75}, 0),  # -12.5%: within the 15% threshold
        ({"speedup": 1.6}, 1),  # -20%
        ({"speedup": 2.6}, 0),  # +30%: an improvement, reported, not a failure
        ({"efficiency": 0.7}, 1),
        ({"kv_bytes_ratio_vs_sglang": 0.2}, 0),  # lower is better for traffic ratios
        ({"kv_bytes_ratio_vs_sglang": 0.3}, 1),  # +20% traffic
        ({"gbps": 0.1}, 0),  # absolute times and throughputs are never compared
        ({"relative_error": 5.0}, 0),
    ],
)
def test_ratio_threshold_and_direction(tmp_path, changes, code):
    index = 0 if set(changes) & {"speedup", "efficiency", "kv_bytes_ratio_vs_sglang", "gbps"} else 1
    assert _run(tmp_path, _edit(index, **changes)) == code


def test_threshold_option(tmp_path):
    new = _edit(0, speedup=1.75)
    assert _run(tmp_path, new) == 0
    assert _run(tmp_path, new, "--threshold", "0.1") == 1
    assert _run(tmp_path, new, "--threshold", "0") == 2


def test_improvement_is_reported(tmp_path, capsys):
    assert _run(tmp_path, _edit(0, speedup=3.0)) == 0
    assert "improved" in capsys.readouterr().out


def test_lower_is_better_option(tmp_path):
    new = _edit(1, measured_speedup=1.5)
    assert _run(tmp_path, new) == 0
    assert _run(tmp_path, new, "--lower-is-better", "measured_*") == 1


def test_benchmark_declares_lower_is_better():
    base = _results(_bench("test_cost", ratio=1.0, lower_is_better=["ratio"]), _bench("test_speed", ratio=1.0))
    new = copy.deepcopy(base)
    for bench in new["benchmarks"]:
        bench["extra_info"]["ratio"] = 1.3
    rows = {row.benchmark.split("::")[1]: row for row in compare.compare(base, new)}
    assert rows["test_cost"].status == compare.REGRESSION and rows["test_cost"].kind == "ratio (lower better)"
    assert rows["test_speed"].status == compare.IMPROVED
    assert compare.figure_kind("lower_is_better", ["ratio"]) is None


def test_missing_benchmark_and_figure(tmp_path, capsys):
    new = copy.deepcopy(BASELINE)
    del new["benchmarks"][1]
    assert _run(tmp_path, new) == 1
    assert "bench_demo::test_curve[8K]: missing" in capsys.readouterr().out
    assert _run(tmp_path, new, "--allow-missing") == 0

    new = copy.deepcopy(BASELINE)
    del new["benchmarks"][0]["extra_info"]["kv_bytes"]
    assert _run(tmp_path, new) == 1
    assert _run(tmp_path, new, "--allow-missing") == 0


def test_new_benchmarks_and_figures_are_listed_not_failed(tmp_path, capsys):
    new = copy.deepcopy(BASELINE)
    new["benchmarks"].append(_bench("test_other", speedup=1.0))
    new["benchmarks"][0]["extra_info"]["causal_pairs"] = 77
    assert _run(tmp_path, new) == 0
    out = capsys.readouterr().out
    assert "test_other" in out and "causal_pairs" in out and " new" in out


def test_default_baseline_is_the_machine_kind(tmp_path, monkeypatch):
    monkeypatch.setattr(compare, "BASELINES", tmp_path / "baselines")
    (tmp_path / "baselines").mkdir()
    new_path = _write(tmp_path, "new.json", BASELINE)
    assert compare.main([str(new_path)]) == 2  # no cpu.json yet
    _write(tmp_path / "baselines", "cpu.json", BASELINE)
    assert compare.main([str(new_path)]) == 0
    assert compare.main([str(_write(tmp_path, "worse.json", _edit(0, kv_bytes=1)))]) == 1


def test_update_baseline_stores_results_without_raw_rounds(tmp_path):
    results = copy.deepcopy(BASELINE)
    results["benchmarks"][0]["stats"]["data"] = [0.4, 0.5, 0.6]
    new_path = _write(tmp_path, "new.json", results)
    stored = tmp_path / "baselines" / "cpu.json"
    assert compare.main([str(new_path), "--baseline", str(stored), "--update-baseline"]) == 0
    data = json.loads(stored.read_text())
    assert "data" not in data["benchmarks"][0]["stats"] and data["benchmarks"][0]["stats"]["median"] == 0.5
    assert data["benchmarks"][1]["extra_info"] == BASELINE["benchmarks"][1]["extra_info"]
    assert compare.main([str(new_path), "--baseline", str(stored)]) == 0
    assert compare.main([str(_write(tmp_path, "worse.json", _edit(0, kv_bytes=1))), "--baseline", str(stored)]) == 1


def test_other_machine_kind_is_refused(tmp_path, capsys):
    gpu = copy.deepcopy(BASELINE)
    for bench in gpu["benchmarks"]:
        bench["extra_info"]["machine_kind"] = "nvidia-h200"
    assert _run(tmp_path, gpu) == 2
    assert "machine kind 'cpu', results from 'nvidia-h200'" in capsys.readouterr().err
    assert _run(tmp_path, gpu, "--any-machine") == 0


def test_mixed_machine_kinds_in_one_file_are_refused(tmp_path):
    mixed = _edit(0, machine_kind="nvidia-h200")
    assert _run(tmp_path, mixed) == 2


@pytest.mark.parametrize("content", ["not json", "[]", '{"benchmarks": 3}', '{"benchmarks": [{"name": "x"}]}'])
def test_unusable_files(tmp_path, content, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert compare.main([str(bad), "--baseline", str(_write(tmp_path, "base.json", BASELINE))]) == 2
    assert compare.main([str(tmp_path / "none.json"), "--baseline", str(bad)]) == 2
    assert "compare: error:" in capsys.readouterr().err


def test_committed_cpu_baseline_compares_clean_with_itself():
    path = COMPARE_PATH.parent / "baselines" / "cpu.json"
    data = compare.load_results(path)
    assert compare.machine_kind(data, path) == "cpu"
    rows = compare.compare(data, data)
    assert rows and not compare.failures(rows)
    # The committed baseline tracks exact work counts and ratios of the cost curve.
    figures = {(row.benchmark.split("::")[0], row.kind) for row in rows}
    assert ("microbench/bench_cost_curve.py", "exact") in figures
    assert ("microbench/bench_cost_curve.py", "ratio") in figures
