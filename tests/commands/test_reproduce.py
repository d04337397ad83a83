"""`penelope reproduce`: the main job writes every step's JSON and plot."""
import importlib.util
import json
from pathlib import Path

import pytest

from penelope.cli import main

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name):
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reproduce_writes_all_results(tmp_path, capsys):
    out = tmp_path / "results"
    rc = main(["reproduce", "--out", str(out), "--sweep", "128K,256K", "--ablation-cache", "128K",
               "--limit-sessions", "2", "--repeat", "2", "--jobs", "1", "--no-progress"])
    assert rc == 0
    for name in ("cost", "simulate", "ablation"):
        assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    cost = json.loads((out / "cost.json").read_text())
    assert cost["c_lin"] == 23552 and len(cost["rows"]) == 5
    simulate = json.loads((out / "simulate.json").read_text())
    assert simulate["config"]["ensemble"]["repeat"] == 2 and simulate["config"]["ensemble"]["band"] == 0.03
    sweep = simulate["sweep"]
    assert [entry["gpu_cache"] for entry in sweep] == [128 * 1024, 256 * 1024]
    assert set(sweep[0]["results"]) == {"sglang", "penelope"}
    penelope = sweep[0]["results"]["penelope"]
    assert len(penelope["runs"]) == 2 and penelope["metrics"]["ttft_mean"]["n"] == 2
    ablation = json.loads((out / "ablation.json").read_text())["results"]
    assert len(ablation) == 6
    text = capsys.readouterr().out
    assert "3/3 ablation grid" in text and "--repeat 2" in text and "changes against sglang" in text

    # The README's tables come from these files.
    readme_tables = load_script("readme_tables")
    assert readme_tables.main(["synthetic", str(out)]) == 0
    tables = capsys.readouterr().out
    assert "| 128K | " in tables and "| 256K | " in tables and "2 runs per setting" in tables
    assert "| private-head-block (Penelope) | " in tables and tables.count("\n| leaf-") == 3
    penelope = sweep[0]["results"]["penelope"]["vs_sglang"]["ttft_mean"]
    row = next(line for line in tables.splitlines() if line.startswith("| 128K"))
    expected = f"{penelope['mean']:+.1%} [{penelope['low']:+.1%}, {penelope['high']:+.1%}]"
    assert (expected in row) != (penelope["verdict"] == "no significant difference")


def test_reproduce_repeat_one_is_the_single_unperturbed_replay(tmp_path):
    out = tmp_path / "results"
    assert main(["reproduce", "--out", str(out), "--sweep", "128K", "--ablation-cache", "128K",
                 "--limit-sessions", "1", "--repeat", "1", "--no-progress"]) == 0
    payload = json.loads((out / "simulate.json").read_text())
    assert "ensemble" not in payload["config"] and "metrics" not in payload["results"]["penelope"]


def test_reproduce_stops_at_the_first_failing_step(tmp_path, capsys):
    rc = main(["reproduce", "--out", str(tmp_path), "--model", "no-such-model", "--no-progress"])
    assert rc == 2
    assert not (tmp_path / "simulate.json").exists()


@pytest.mark.parametrize("extra", [["--band", "5"], ["--jitter", "-1"], ["--jobs", "0"], ["--limit-sessions", "0"],
                                   ["--repeat", "1", "--band", "0.1"]])
def test_bad_replay_options_stop_reproduce_before_the_first_step(tmp_path, capsys, extra):
    out = tmp_path / "results"
    assert main(["reproduce", "--no-progress", "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("penelope: error: ") and err.count("\n") == 1, err
    assert not out.exists() or not any(out.iterdir())
