"""scripts/readme_tables.py's table against SGLang's own policies, on hand-made ensemble results."""
import json

import pytest
from scripts_env import load_script

from penelope.sim.stats import Estimate

tables = load_script("readme_tables")

POLICIES = {"sglang": "leaf-tail-node", "sglang-lfu": "sglang-lfu", "sglang-slru": "sglang-slru",
            "sglang-tlru": "sglang-tlru", "sglang-session": "sglang-session", "penelope": "private-head-block"}


def ensemble(policy: str, ttft: list[float], p90: list[float], hit: float) -> dict:
    runs = [{"ttft_mean": t, "ttft_p90": p, "hit_rate": hit} for t, p in zip(ttft, p90, strict=True)]
    metrics = {"ttft_mean": Estimate.of(ttft).as_dict(), "hit_rate": Estimate.of([hit] * len(ttft)).as_dict()}
    return {"policy": policy, "metrics": metrics, "runs": runs}


def results(ttft: dict[str, list[float]]) -> dict:
    return {name: ensemble(POLICIES[name], ttft[name], [2 * t for t in ttft[name]], 0.9) for name in ttft}


def row_cells(table: str) -> list[str]:
    return [cell.strip() for cell in table.splitlines()[2].strip("|").split("|")]


def test_penelope_is_compared_with_the_sglang_policy_of_lowest_mean_ttft_run_by_run():
    ttft = {name: [1.0, 1.2, 1.1] for name in POLICIES}
    ttft["sglang-slru"] = [0.8, 1.0, 0.9]          # the best of SGLang's
    ttft["penelope"] = [0.4, 0.5, 0.45]            # half of SLRU's in every run
    cells = row_cells(tables.sglang_policies_table([(128 * 1024, results(ttft))]))
    assert cells[0] == "128K"
    assert cells[1] == "90.0% ±0.0 / 1.100"
    assert cells[3] == "90.0% ±0.0 / 0.900"
    assert cells[6] == "SLRU"
    assert cells[7].startswith("-50") and cells[8].startswith("-50")


def test_a_policy_that_beats_penelope_shows_as_a_positive_change():
    ttft = {name: [1.0, 1.1, 1.2] for name in POLICIES}
    ttft["sglang-session"] = [0.5, 0.52, 0.55]
    cells = row_cells(tables.sglang_policies_table([(192 * 1024, results(ttft))]))
    assert cells[6] == "session cache"
    assert cells[7].startswith("+")


def test_a_sweep_without_one_of_sglangs_policies_is_refused():
    ttft = {name: [1.0, 1.1] for name in POLICIES if name != "sglang-tlru"}
    with pytest.raises(tables.TableError, match="sglang-tlru"):
        tables.sglang_policies_table([(128 * 1024, results(ttft))])


def test_a_setting_that_left_requests_out_says_so():
    ttft = {name: [1.0, 1.1] for name in POLICIES}
    runs = results(ttft)
    for result in runs.values():
        for run in result["runs"]:
            run.update(requests=1626, skipped_requests=326)
    assert tables.skipped_note(runs) == " (326 of 1952 requests never fit the cache, left out)"
    for result in runs.values():
        for run in result["runs"]:
            run.update(skipped_requests=0)
    assert tables.skipped_note(runs) == ""


def test_missing_or_foreign_results_are_one_line_naming_the_script_that_writes_them(tmp_path, capsys):
    assert tables.main(["weka", str(tmp_path / "none")]) == 2
    (tmp_path / "gpu_sweep.json").write_text(json.dumps({"config": {"ensemble": {}}, "results": {}}))
    assert tables.main(["weka", str(tmp_path)]) == 2
    (tmp_path / "simulate.json").write_text("[" * 100000)
    assert tables.main(["synthetic", str(tmp_path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3, lines
    assert lines[0].startswith("readme_tables: ") and "gpu_sweep.json: missing" in lines[0]
    assert "scripts/weka_results.sh writes the results" in lines[0]
    assert "are not what scripts/weka_results.sh writes" in lines[1]
    assert "simulate.json: not JSON" in lines[2] and "penelope reproduce" in lines[2]


def test_a_results_file_whose_configuration_is_not_its_rows_label_is_refused():
    tables.check_setting("two_tier_equal", {"cpu_cache": 128 * 1024})
    tables.check_setting("triton_kernel", {"cpu_cache": 0, "time_model": {"phantom_kernel": "triton"}})
    with pytest.raises(tables.TableError, match="two_tier_equal.json: cpu_cache is 0, its table row says 131072"):
        tables.check_setting("two_tier_equal", {"cpu_cache": 0})
    with pytest.raises(tables.TableError, match="time_model.phantom_kernel is 'fa3'"):
        tables.check_setting("triton_kernel", {"cpu_cache": 0, "time_model": {"phantom_kernel": "fa3"}})
    with pytest.raises(tables.TableError, match="gemma3.json: model is 'qwen3-8b'"):
        tables.check_setting("gemma3", {"model": "qwen3-8b", "cpu_cache": 0})
