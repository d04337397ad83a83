"""`penelope reproduce`: the main job writes every step's JSON and plot."""
import json

from penelope.cli import main


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
