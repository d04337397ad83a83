"""`penelope simulate --replicas N --router ...` and `penelope analyze` on Mooncake-format traces:
router sweeps, fleet tables, the saturation warning, --time-scale, and one-line errors."""

import json

import pytest

from penelope.cli import main
from penelope.sim.workloads.mooncake import load_mooncake
from penelope.sim.workloads.mooncake_like import MooncakeLikeConfig, write_jsonl


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """A heavy trace (about 4.3 servers' worth of work at 128K) and a light one (0.4)."""
    folder = tmp_path_factory.mktemp("mooncake")
    heavy, light = folder / "heavy.jsonl", folder / "light.jsonl"
    write_jsonl(heavy, MooncakeLikeConfig(duration=150.0, rate=3.4, seed=5))
    write_jsonl(light, MooncakeLikeConfig(duration=150.0, rate=0.3, seed=5))
    return {"heavy": heavy, "light": light}


def run_json(tmp_path, *args):
    out = tmp_path / "out.json"
    assert main([*args, "--no-progress", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_router_sweep_over_replicas_prints_fleet_tables_and_writes_each_setting(traces, tmp_path, capsys):
    payload = run_json(tmp_path, "simulate", "--trace", str(traces["heavy"]), "--gpu-cache", "128K",
                       "--replicas", "8", "--router", "round-robin,cache-aware", "--per-replica", "--jobs", "2")
    config = payload["config"]
    assert config["replicas"] == 8 and config["routers"] == ["round-robin", "cache-aware"]
    assert config["routing"]["cache_threshold"] == 0.3 and config["routing"]["balance_abs_threshold"] == 64
    assert 4 < config["offered_load"]["load"] < 5 and config["offered_load"]["replicas_needed"] == 5
    assert [(e["gpu_cache"], e["router"]) for e in payload["sweep"]] == [(131072, "round-robin"),
                                                                        (131072, "cache-aware")]
    for entry in payload["sweep"]:
        for result in entry["results"].values():
            fleet = result["fleet"]
            assert fleet["router"] == entry["router"] and fleet["replicas"] == 8
            assert sum(r["summary"]["requests"] for r in fleet["per_replica"]) == result["requests"]
            assert fleet["saturation"]["saturated"] == []
    round_robin = payload["sweep"][0]["results"]["sglang"]["fleet"]
    assert round_robin["request_imbalance"] < 1.01 and round_robin["routing"] == {}
    routing = payload["sweep"][1]["results"]["sglang"]["fleet"]["routing"]
    assert sum(routing.values()) == payload["sweep"][1]["results"]["sglang"]["requests"]
    out = capsys.readouterr()
    assert out.out.count("fleet: 8 replicas") == 2 and "x 8 replicas, cache-aware router: pressure" in out.out
    assert "sglang, per replica:" in out.out and "late wait s" in out.out
    assert "offered load:" in out.out and out.err == ""


def test_an_ensemble_of_fleet_replays_reports_the_fleet_of_every_run(traces, tmp_path, capsys):
    payload = run_json(tmp_path, "simulate", "--trace", str(traces["light"]), "--gpu-cache", "128K",
                       "--replicas", "2", "--router", "session", "--repeat", "2", "--jobs", "1")
    assert payload["config"]["ensemble"]["repeat"] == 2 and payload["config"]["replicas"] == 2
    for result in payload["results"].values():
        assert len(result["runs"]) == 2
        for run in result["runs"]:
            assert run["fleet"]["router"] == "session" and len(run["fleet"]["per_replica"]) == 2
            assert sum(r["summary"]["requests"] for r in run["fleet"]["per_replica"]) == run["requests"]
    out = capsys.readouterr().out
    assert "x 2 replicas, session router: pressure = SGLang hit rate" in out and "2 runs (" in out
    assert "fleet: 2 replicas, session router" in out


def test_an_overloaded_server_is_reported_and_time_scale_relieves_it(traces, tmp_path, capsys):
    args = ["simulate", "--trace", str(traces["heavy"]), "--gpu-cache", "128K", "--policies", "sglang"]
    payload = run_json(tmp_path, *args)
    assert payload["results"]["sglang"]["fleet"]["saturation"]["saturated"] == [0]
    out = capsys.readouterr()
    assert "SATURATED, expect a queue growing without bound" in out.out
    assert out.err.count("warning:") == 1 and "SATURATED: the server could not keep up" in out.err
    # Eight times slower: an eighth of the load, one server keeps up.
    payload = run_json(tmp_path, *args, "--time-scale", "8")
    assert payload["config"]["workload"]["time_scale"] == 8.0
    assert payload["config"]["offered_load"]["load"] < 0.6
    assert payload["results"]["sglang"]["fleet"]["saturation"]["saturated"] == []
    out = capsys.readouterr()
    assert "time scale x8" in out.out and out.err == ""


def test_a_light_trace_is_not_saturated(traces, tmp_path, capsys):
    payload = run_json(tmp_path, "simulate", "--trace", str(traces["light"]), "--gpu-cache", "128K")
    for result in payload["results"].values():
        assert result["fleet"]["saturation"]["saturated"] == []
    out = capsys.readouterr()
    assert out.err == ""
    # An open-loop trace: arrival times, not a number of sessions at once, drive the replay.
    assert "open loop: requests sent at their recorded arrival times" in out.out
    assert "sessions at once" not in out.out


def test_analyze_says_how_many_replicas_the_trace_needs(traces, tmp_path, capsys):
    payload = run_json(tmp_path, "analyze", str(traces["heavy"]), "--gpu-cache", "128K")
    load = payload["offered_load"]
    assert load["replicas_needed"] == int(load["load"]) + 1
    # Replayed on the count the estimate gives at 80% utilization, without saturating.
    assert payload["replicas"] >= load["replicas_needed"]
    assert payload["estimate"]["sglang"]["fleet"]["saturation"]["saturated"] == []
    text = capsys.readouterr().out
    assert f"stays below saturation from {load['replicas_needed']} replicas" in text
    assert "saturation: none" in text and "estimated gain at 128K x" in text
    # No tool waits in an open-loop trace: nothing reads "nan s".
    assert "open loop: requests sent at their recorded arrival times" in text and "nan" not in text
    assert "reuse distance: none to measure, no session sends a second request" in text
    payload = run_json(tmp_path, "analyze", str(traces["heavy"]), "--gpu-cache", "128K", "--replicas", "1")
    assert payload["replicas"] == 1
    assert payload["estimate"]["sglang"]["fleet"]["saturation"]["saturated"] == [0]


@pytest.mark.parametrize("args, message", [
    (["simulate", "--replicas", "2", "--router", "random"], "--router 'random' is not a router; choose from"),
    (["simulate", "--replicas", "0"], "--replicas must be a positive integer"),
    (["simulate", "--time-scale", "0"], "--time-scale must be a positive number"),
    (["simulate", "--replicas", "2", "--cache-threshold", "2"], "--cache-threshold must be in [0, 1]"),
    (["simulate", "--replicas", "2", "--balance-rel-threshold", "0.5"], "--balance-rel-threshold must be at least 1"),
    (["simulate", "--router", ","], "--router: empty list"),
    (["simulate", "--replicas", "2", "--policies", "all"], "the oracle policy and its lower bound need one server"),
    (["analyze", "--format", "synthetic", "--router", "round-robin,session"], "--router: give one router here"),
])
def test_fleet_option_errors_are_one_line(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_ctrl_c_in_a_router_sweep_keeps_the_finished_settings(traces, tmp_path, capsys, monkeypatch):
    from penelope.sim import ensemble

    real = ensemble._Replayer.run
    calls = [0]

    def interrupting(self, task):
        # Two policies per setting: the third replay is the second setting's first.
        calls[0] += 1
        if calls[0] > 2:
            raise KeyboardInterrupt
        return real(self, task)

    monkeypatch.setattr(ensemble._Replayer, "run", interrupting)
    out = tmp_path / "out.json"
    assert main(["simulate", "--trace", str(traces["light"]), "--gpu-cache", "128K", "--replicas", "2",
                 "--router", "round-robin,session", "--jobs", "1", "--no-progress", "--json", str(out)]) == 130
    err = capsys.readouterr().err
    assert err == f"penelope: interrupted; wrote the 1 of 2 settings that finished (128K round-robin) to {out}\n"
    payload = json.loads(out.read_text())
    assert [(e["gpu_cache"], e["router"]) for e in payload["sweep"]] == [(131072, "round-robin")]
    assert payload["interrupted"] == {"finished": [[131072, "round-robin"]], "not_run": [[131072, "session"]]}


def test_analyze_checks_the_memory_of_the_replicas_it_chooses(traces, monkeypatch, capsys):
    from penelope import memory
    from penelope.sim.replay import replay_memory

    # Room for one replica's cache but not for the five or six the heavy trace needs.
    one = replay_memory(load_mooncake(traces["heavy"]), 128 * 1024, 64)
    monkeypatch.setattr(memory, "available_bytes", lambda: 2 * one)
    assert main(["analyze", str(traces["heavy"]), "--gpu-cache", "128K", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "in a cache of 128K tokens on each of" in err and "more than the" in err and err.count("\n") == 1


@pytest.mark.parametrize(("args", "message"), [
    (["simulate", "--router", "session"], "--router applies to --replicas N > 1"),
    (["simulate", "--replicas", "2", "--router", "round-robin", "--cache-threshold", "0.9"],
     "--cache-threshold applies to the cache-aware router"),
    (["simulate", "--balance-abs-threshold", "3"], "--balance-abs-threshold applies to the cache-aware router"),
    (["simulate", "--replicas", "2", "--time-scale", "1e-9"], "--time-scale must be in [0.0001, 10000], got 1e-09"),
    (["simulate", "--time-scale", "1e308"], "--time-scale must be in [0.0001, 10000]"),
    (["analyze", "--format", "synthetic", "--replicas", "0"], "--replicas must be at least 1, got 0"),
])
def test_options_the_replay_would_ignore_are_refused(args, message, capsys):
    assert main([*args, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("penelope: error: ") and err.count("\n") == 1 and message in err, err


def test_offered_load_leaves_out_requests_that_never_fit(tmp_path, capsys):
    """Requests too long for the cache are skipped by the replay: the estimate says so and does
    not count their work."""
    path = tmp_path / "mixed.jsonl"
    lines = [{"timestamp": 1000 * i, "input_length": 512 * 4, "output_length": 8,
              "hash_ids": [10 * i + k for k in range(4)]} for i in range(5)]
    lines += [{"timestamp": 1000 * i + 500, "input_length": 512 * 40, "output_length": 8,
               "hash_ids": [1000 + 100 * i + k for k in range(40)]} for i in range(5)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["analyze", str(path), "--gpu-cache", "8K", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "5 requests counted, 5 that can never fit the cache left out" in out


def test_analyze_explains_an_overload_estimate_the_replay_did_not_confirm(traces, tmp_path, capsys, monkeypatch):
    """The estimate says one server is overloaded; with a saturation floor the replay's backlog
    never reaches (a short trace), the verdict says why the two differ."""
    from penelope.sim.fleet import saturation

    monkeypatch.setattr(saturation, "MIN_SATURATED_WAIT", 1e9)
    payload = run_json(tmp_path, "analyze", str(traces["heavy"]), "--gpu-cache", "128K", "--replicas", "1")
    assert payload["estimate"]["sglang"]["fleet"]["saturation"]["saturated"] == []
    text = capsys.readouterr().out
    assert "saturation: none" in text and "the offered-load estimate says overloaded" in text
    assert "SATURATED: the server" not in text and "sent to replica" not in text
