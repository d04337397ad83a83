"""``scripts/sim_vs_server.py`` on a tiny ab.json: the workload, pool, page, chunk, sessions and
policy settings it reads reach the simulator, the verdicts (Penelope's change inside the server's
interval, recomputed tokens within 5%) follow the figures, a poor calibration is labelled, and
bad input is one line."""
import json
from pathlib import Path

import pytest
import scripts_env
from trace_paths import WEKA_TRACES

import penelope.sim.run as sim_run
from penelope.sim.stats import Estimate, paired_changes

CONFIG = {"hidden_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
          "head_dim": 128, "intermediate_size": 1536, "vocab_size": 1000, "model_type": "qwen3"}


script = scripts_env.load_script("sim_vs_server")


def estimate(mean, half=0.1):
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": 2}


def fixture(tmp_path, recomputed=1000.0, source="test calibration"):
    """An ab.json of two WEKA sessions (6 turns, scale 16, primed) on a pool of 4.5K tokens, three
    configurations over two rounds, and its model and calibration."""
    model = tmp_path / "tinymodel"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(CONFIG))
    calibration = tmp_path / "cal.json"
    calibration.write_text(json.dumps({"model": "tinymodel", "source": source, "batch_overhead": 0.01,
                                       "sec_per_linear_unit": 1e-9, "sec_per_attention_pair": 1e-8}))
    names = ("penelope", "sglang-lru", "sglang-tlru")
    ttft = {"penelope": (1.0, 1.2), "sglang-lru": (4.0, 4.8), "sglang-tlru": (1.1, 1.3)}
    ab = {
        "setup": {"model": str(model), "pool": 4608, "page": 16, "chunk": 256,
                  "tlru": {"threshold": 300, "next_prompt_estimate": 40}, "slru_protected": None},
        "workload": {"format": "weka", "trace": str(WEKA_TRACES), "max_context": 131072, "seed": None,
                     "think_time": {"mode": "recorded", "scale": 0.05, "cap": 1.0}, "limit_sessions": None,
                     "loader": {"sources": [str(WEKA_TRACES / "trace_0008.json"),
                                            str(WEKA_TRACES / "trace_0011.json")]},
                     "shared_prefix": True, "subagents": "skip", "overflow": "truncate", "turns": 6,
                     "from_context": None, "scale": 16.0, "time_scale": 1.0},
        "load": {"sessions": 2, "prime": True},
        "configs": [{"name": n, "applied": {"policy": "private-head-block"} if n == "penelope" else {}}
                    for n in names],
        "runs": [{"config": n, "round": r, "ttft_mean": ttft[n][r], "ttft_p90": 2 * ttft[n][r]}
                 for n in names for r in (0, 1)],
        "estimates": {n: {"ttft_mean": estimate(sum(ttft[n]) / 2), "ttft_p90": estimate(sum(ttft[n])),
                          "cached_fraction": estimate(0.9, 0.01), "recomputed": estimate(recomputed, 50)}
                      for n in names},
    }
    path = tmp_path / "ab.json"
    path.write_text(json.dumps(ab))
    return path, calibration


def run(tmp_path, *argv):
    out = tmp_path / "out.json"
    code = script.main([*argv, "--json", str(out)])
    return code, (json.loads(out.read_text()) if code == 0 else None)


def test_the_comparison_of_a_tiny_ab_json(tmp_path, capsys):
    path, calibration = fixture(tmp_path)
    code, result = run(tmp_path, "--ab", str(path), "--calibration", str(calibration))
    assert code == 0, capsys.readouterr().err
    rows = {row["config"]: row for row in result["rows"]}
    assert list(rows) == ["penelope", "sglang-lru", "sglang-tlru"]
    assert rows["penelope"]["policy"] == "private-head-block"
    assert rows["sglang-tlru"]["policy"] == "sglang-tlru:threshold=300:next_prompt_estimate=40"
    assert (result["pool"], result["page"], result["chunk"], result["sessions"], result["prime"]) == \
        (4608, 16, 256, 2, True)
    # 12 requests, the 2 priming ones left out of the simulated figures.
    assert result["requests"] == 12 and {row["sim"]["requests"] for row in rows.values()} == {10}
    for name in ("sglang-lru", "sglang-tlru"):
        change = rows[name]["penelope_ttft_change"]
        mine, theirs = rows["penelope"]["sim"]["ttft_mean"], rows[name]["sim"]["ttft_mean"]
        assert change["sim"] == pytest.approx((mine - theirs) / theirs)
        server = Estimate.of(paired_changes([1.0, 1.2], [r["ttft_mean"] for r in
                                                        json.loads(path.read_text())["runs"] if r["config"] == name]))
        assert change["server"]["mean"] == pytest.approx(server.mean)
        assert change["inside"] == (server.low <= change["sim"] <= server.high)
    # On the server Penelope cut LRU's TTFT by 75% in both rounds (an interval of -75% alone); less simulated.
    assert rows["sglang-lru"]["penelope_ttft_change"]["server"]["high"] == pytest.approx(-0.75)
    assert rows["sglang-lru"]["penelope_ttft_change"]["inside"] is False
    out = capsys.readouterr().out
    assert "Calibration: test calibration" in out
    # The server's recomputed tokens (1,000 [950, 1,050]) print with thousands separators, as the sim's.
    assert "| 1,000 [950, 1,050] |" in out


def test_recomputed_within_five_percent_follows_the_figures(tmp_path):
    path, calibration = fixture(tmp_path)
    _, result = run(tmp_path, "--ab", str(path), "--calibration", str(calibration))
    simulated = result["rows"][1]["sim"]["recomputed"]
    # The pool of 4.5K forces eviction: something to compare.
    assert simulated > 0
    for factor, verdict in ((1.04, True), (0.96, True), (1.06, False), (0.94, False)):
        path, calibration = fixture(tmp_path, recomputed=simulated * factor)
        _, result = run(tmp_path, "--ab", str(path), "--calibration", str(calibration))
        assert result["rows"][1]["recomputed_within_5pct"] is verdict, factor


def test_a_poor_calibration_is_labelled(tmp_path, capsys):
    path, calibration = fixture(tmp_path, source="penelope calibrate --from-points p.json; poor fit: prefill R^2 0.8")
    code, result = run(tmp_path, "--ab", str(path), "--calibration", str(calibration))
    assert code == 0 and result["poor_fit"] is True
    assert "POOR FIT" in capsys.readouterr().out


def broken(tmp_path, change):
    path, calibration = fixture(tmp_path)
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    return path, calibration


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("setup"), "ab.json has no setup"),
    (lambda d: d["setup"].pop("pool"), "ab.json has no setup.pool"),
    (lambda d: d["workload"].pop("scale"), "ab.json has no workload.scale"),
    (lambda d: d["load"].pop("prime"), "ab.json has no load.prime"),
    (lambda d: d["workload"].update(scale=0), "`scale` must be a number of at least 1"),
    (lambda d: d["setup"].pop("tlru"), "ab.json has no setup.tlru"),
])
def test_bad_input_is_one_line(tmp_path, capsys, change, message):
    path, calibration = broken(tmp_path, change)
    assert script.main(["--ab", str(path), "--calibration", str(calibration)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_an_ab_json_nested_too_deeply_is_one_line(tmp_path, capsys):
    path, calibration = fixture(tmp_path)
    path.write_text("[" * 100000)
    assert script.main(["--ab", str(path), "--calibration", str(calibration)]) == 2
    err = capsys.readouterr().err.strip()
    assert "not JSON" in err and len(err.splitlines()) == 1


def test_a_missing_ab_json_or_calibration_is_one_line(tmp_path, capsys):
    path, calibration = fixture(tmp_path)
    assert script.main(["--ab", str(tmp_path / "none.json"), "--calibration", str(calibration)]) == 2
    assert script.main(["--ab", str(path), "--calibration", str(tmp_path / "none.json")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and "no such ab.json" in lines[0] and "calibration file not found" in lines[1]


@pytest.mark.parametrize("change, message", [
    (lambda d: d["setup"].update(pool="big"), "ab.json's setup.pool is 'big'"),
    (lambda d: d["setup"].update(chunk=None), "ab.json's setup.chunk is None"),
    (lambda d: d["setup"].update(page=True), "ab.json's setup.page is True"),
    (lambda d: d["load"].update(sessions=2.5), "ab.json's load.sessions is 2.5"),
    (lambda d: d["load"].update(prime="yes"), "ab.json's load.prime is 'yes'"),
    (lambda d: d.update(configs="x"), "ab.json's configs"),
    (lambda d: d.update(configs=[{"nm": 1}]), "ab.json's configs[0]"),
    (lambda d: d.update(runs=[{"x": 1}]), "ab.json's runs[0]"),
    (lambda d: d.update(runs="x"), "ab.json's runs"),
    (lambda d: d["estimates"]["penelope"].pop("ttft_mean"), "ab.json has no estimates.penelope.ttft_mean"),
    (lambda d: d["estimates"]["penelope"].update(cached_fraction=0.9), "ab.json's estimates.penelope.cached_fraction"),
    (lambda d: d.update(estimates=[]), "ab.json's estimates"),
    (lambda d: d["setup"].update(tlru={}), "ab.json has no setup.tlru.threshold"),
    (lambda d: d["setup"].update(tlru={"threshold": "x", "next_prompt_estimate": 4}), "ab.json's setup.tlru.threshold"),
    (lambda d: (d["setup"].update(slru_protected="x"), d["configs"].append({"name": "sglang-slru"}),
                d["estimates"].update({"sglang-slru": d["estimates"]["sglang-lru"]})),
     "ab.json's setup.slru_protected"),
    (lambda d: d["workload"].update(turns="eight"), "ab.json's workload.turns is 'eight'"),
    (lambda d: d["workload"].update(limit_sessions=-1), "ab.json's workload.limit_sessions is -1"),
    (lambda d: d["workload"].update(time_scale="x"), "`time_scale` must be a positive number"),
    (lambda d: d.update(estimates={}), "nothing to compare"),
    (lambda d: d["estimates"]["penelope"]["ttft_mean"].update(low="a"), "ab.json's estimates.penelope.ttft_mean"),
    (lambda d: d["workload"].update(loader="weka", trace=7), "the trace of ab.json (7) is not here"),
    (lambda d: d["workload"].update(turns=0), "ab.json's workload.turns is 0"),
    (lambda d: d["workload"].update(requests=5), "the trace gives 12 requests, the servers got 5"),
    (lambda d: d["configs"].append({"name": "penelope"}), "repeats the configuration 'penelope'"),
    (lambda d: d["runs"][0].update(ttft_mean=0), "ab.json's runs[0] is not a run"),
])
def test_a_malformed_ab_json_is_one_line(tmp_path, capsys, change, message):
    path, calibration = broken(tmp_path, change)
    assert script.main(["--ab", str(path), "--calibration", str(calibration)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_a_bad_json_path_is_one_line_before_the_run(tmp_path, capsys, monkeypatch):
    path, calibration = fixture(tmp_path)
    before = path.read_text()
    # The check comes before any replay: a replay here would fail the test.
    monkeypatch.setattr(script, "compare", lambda *a: pytest.fail("replayed before checking --json"))
    for out, message in ((tmp_path / "none" / "x.json", "does not exist"), (tmp_path, "is a folder"),
                         (path, "is the input --ab"), (calibration, "is the input --calibration")):
        assert script.main(["--ab", str(path), "--calibration", str(calibration), "--json", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    assert path.read_text() == before


def test_the_trace_and_model_it_reads_are_never_written(tmp_path, capsys, monkeypatch):
    """The trace files and the model, given or named by ab.json, are inputs: --json refuses them."""
    path, calibration = fixture(tmp_path)
    monkeypatch.setattr(script, "compare", lambda *a: pytest.fail("replayed before checking --json"))
    trace = tmp_path / "trace_0008.json"
    trace.write_text((WEKA_TRACES / "trace_0008.json").read_text())
    model_config = tmp_path / "tinymodel" / "config.json"
    before = {p: p.read_text() for p in (trace, model_config)}
    data = json.loads(path.read_text())
    data["workload"]["loader"]["sources"] = [str(trace)]
    path.write_text(json.dumps(data))
    for extra, out, message in (
            (["--trace", str(trace)], trace, "is the input --trace"),
            ([], trace, "is the input ab.json's trace (1 of 1)"),
            ([], model_config, "is the input --model"),
            (["--model", str(model_config.parent)], model_config, "is the input --model")):
        argv = ["--ab", str(path), "--calibration", str(calibration), *extra, "--json", str(out)]
        assert script.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    assert {p: p.read_text() for p in before} == before


def test_a_pool_no_request_fits_is_one_line(tmp_path, capsys):
    path, calibration = broken(tmp_path, lambda d: d["setup"].update(pool=16))
    assert script.main(["--ab", str(path), "--calibration", str(calibration)]) == 2
    err = capsys.readouterr().err.strip()
    assert "no request of the workload fits ab.json's setup.pool of 16 tokens" in err and len(err.splitlines()) == 1


def test_ctrl_c_is_one_line(tmp_path, capsys, monkeypatch):
    path, calibration = fixture(tmp_path)

    def stop(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(script, "compare", stop)
    assert script.main(["--ab", str(path), "--calibration", str(calibration)]) == 130
    assert capsys.readouterr().err.strip() == "sim_vs_server: interrupted"


def test_the_servers_page_is_the_simulators_block_and_page(tmp_path, monkeypatch):
    path, calibration = fixture(tmp_path)
    configs = []
    real = sim_run.run_policy

    def record(workload, policy, config, *args):
        configs.append(config)
        return real(workload, policy, config, *args)

    # The script imports run_policy from penelope.sim.run when it runs.
    monkeypatch.setattr(sim_run, "run_policy", record)
    code, _ = run(tmp_path, "--ab", str(path), "--calibration", str(calibration))
    assert code == 0 and configs
    # SGLang caches and charges its budgets in pages of 16 here: so does the simulator.
    assert {(c.block_size, c.page_size, c.chunk_size) for c in configs} == {(16, 16, 256)}



def test_a_generated_model_gone_from_disk_is_rebuilt_from_its_spec(tmp_path):
    """The table's ab.json names a scale model in a folder of the machine that ran it: its
    config.json is rebuilt from setup.model_spec, in a folder of the same name (the calibration's)."""
    from penelope.engine.scale_model import scale_model_config

    here = tmp_path / "model"
    here.mkdir()
    (here / "config.json").write_text(json.dumps(CONFIG))
    assert script.model_of({"model": str(here), "model_spec": "scale:7"}) == str(here)
    rebuilt = Path(script.model_of({"model": str(tmp_path / "gone" / "model"), "model_spec": "scale:7"}))
    assert rebuilt.name == "model" and rebuilt != here
    assert json.loads((rebuilt / "config.json").read_text()) == scale_model_config(7).to_hf()
    for setup in ({"model": str(tmp_path / "gone")}, {"model": str(tmp_path / "gone"), "model_spec": "Qwen/Qwen3-8B"}):
        with pytest.raises(script.UsageError, match="give --model"):
            script.model_of(setup)


def test_trace_files_moved_away_are_found_in_the_shared_traces(tmp_path, monkeypatch):
    monkeypatch.setattr(script, "SHARED_TRACES", WEKA_TRACES)
    workload = {"trace": str(tmp_path / "gone"),
                "loader": {"sources": [str(tmp_path / "gone" / "trace_0008.json")]}}
    assert script.trace_of(workload, None) == [str(WEKA_TRACES / "trace_0008.json")]
    workload["loader"]["sources"].append(str(tmp_path / "gone" / "trace_9999.json"))
    with pytest.raises(script.UsageError, match="give --trace"):
        script.trace_of(workload, None)


def test_a_bad_option_is_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        script.main(["--calibrate", "x"])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and err.startswith("sim_vs_server: ") and len(err.splitlines()) == 1, err
