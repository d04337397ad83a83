"""`penelope simulate` and `penelope analyze`: every loader through the CLI on real files, the
JSON schema, sweeps, the ablation grid, and one-line errors with exit code 2."""

import json

import pytest
from trace_paths import WEKA_TRACES

from penelope.cli import main

TRACES = WEKA_TRACES
REQUIRED = ("ttft_mean", "ttft_p50", "ttft_p90", "jct_mean", "hit_rate", "recomputed_tokens", "requests")
SIX = ["leaf-tail-node", "leaf-tail-block", "leaf-head-node", "leaf-head-block", "private-head-node",
       "private-head-block"]


def simulate(tmp_path, *args):
    out = tmp_path / "sim.json"
    assert main(["simulate", "--no-progress", "--json", str(out), *args]) == 0
    return json.loads(out.read_text())


def check_results(results, requests):
    for name, result in results.items():
        for key in REQUIRED:
            assert isinstance(result[key], (int, float)), (name, key)
        assert result["requests"] + result["skipped_requests"] == requests
        assert 0 <= result["hit_rate"] <= 1
        assert result["ttft_p50"] <= result["ttft_p90"]
        assert result["recomputed_tokens"] >= 0 and result["swap_loads"] == 0


def test_weka_folder_json_schema_and_table(tmp_path, capsys):
    payload = simulate(tmp_path, "--trace", str(TRACES), "--overflow", "skip", "--limit-sessions", "5",
                       "--gpu-cache", "160K", "--think-time", "tool,cap:30")
    assert set(payload) == {"config", "results"}
    config = payload["config"]
    assert config["workload"]["format"] == "weka" and config["workload"]["sessions"] == 5
    assert config["workload"]["loader"]["sessions_skipped"] == {"over_max_context": 8}
    assert config["workload"]["think_time"] == {"mode": "tool", "scale": 1.0, "cap": 30.0}
    assert config["gpu_cache"] == 160 * 1024 and config["model"] == "qwen3-8b"
    assert list(payload["results"]) == ["sglang", "penelope"]
    check_results(payload["results"], config["workload"]["requests"])
    sglang = payload["results"]["sglang"]
    assert sglang["policy"] == "leaf-tail-node" and sglang["vs_sglang"]["ttft_mean"] == 0
    penelope = payload["results"]["penelope"]
    assert penelope["vs_sglang"]["ttft_mean"] == pytest.approx(penelope["ttft_mean"] / sglang["ttft_mean"] - 1)
    out = capsys.readouterr()
    assert "pressure = SGLang hit rate" in out.out and "TTFT vs sglang" in out.out
    # Not a terminal: no progress bar.
    assert out.err == ""


def test_weka_single_file(tmp_path):
    payload = simulate(tmp_path, "--trace", str(TRACES / "trace_0008.json"), "--policies", "penelope")
    # The baseline is added when missing.
    assert list(payload["results"]) == ["sglang", "penelope"]
    check_results(payload["results"], payload["config"]["workload"]["requests"])


def test_mooncake_jsonl(tmp_path):
    lines = [
        {"timestamp": 0, "input_length": 1500, "output_length": 20, "hash_ids": [1, 2, 3], "session_id": "a"},
        {"timestamp": 500, "input_length": 900, "output_length": 5, "hash_ids": [7, 8]},
        {"timestamp": 4000, "input_length": 2100, "output_length": 9, "hash_ids": [1, 2, 3, 4, 5],
         "session_id": "a"},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    payload = simulate(tmp_path, "--trace", str(path), "--gpu-cache", "16K")
    assert payload["config"]["workload"]["format"] == "mooncake"
    check_results(payload["results"], 3)
    # The third request starts with the first one's 1,500 tokens, of which the cache kept the 23
    # whole 64-token blocks: 1,472 of the 4,500 input tokens are reused.
    assert payload["results"]["sglang"]["hit_rate"] == pytest.approx(1472 / 4500)


def test_synthetic_ablation_grid_and_sweep(tmp_path, capsys):
    payload = simulate(tmp_path, "--format", "synthetic", "--limit-sessions", "2", "--policies", "ablation",
                       "--gpu-cache", "128K,160K", "--scheduler", "fcfs", "--plot", str(tmp_path / "p.png"))
    assert set(payload) == {"config", "sweep"}
    assert payload["config"]["policies"] == SIX and payload["config"]["scheduler"] == "fcfs"
    assert [entry["gpu_cache"] for entry in payload["sweep"]] == [128 * 1024, 160 * 1024]
    for entry in payload["sweep"]:
        assert list(entry["results"]) == SIX
        check_results(entry["results"], payload["config"]["workload"]["requests"])
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert capsys.readouterr().out.count("pressure = SGLang hit rate") == 2


def test_sliding_window_model(tmp_path):
    payload = simulate(tmp_path, "--limit-sessions", "2", "--model", "gemma-3-27b", "--gpu-cache", "128K")
    assert payload["config"]["model"] == "gemma-3-27b"
    assert payload["config"]["time_model"]["sliding_window"] > 0
    check_results(payload["results"], payload["config"]["workload"]["requests"])


def test_analyze_weka_folder(tmp_path, capsys):
    out = tmp_path / "analyze.json"
    assert main(["analyze", str(TRACES), "--overflow", "skip", "--limit-sessions", "6", "--no-progress",
                 "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["lengths"]["sessions"] == 6
    assert 10_000 < payload["shared_prefix"]["all_sessions"] < 30_000
    assert 0.5 < payload["unbounded"]["hit_rate"] < 1
    # A cache can only lose hits against the unbounded one.
    for result in payload["estimate"].values():
        assert result["hit_rate"] <= payload["unbounded"]["hit_rate"]
    assert payload["reuse_distance"]["reuses"] == payload["lengths"]["requests"] - 6
    text = capsys.readouterr().out
    assert "unbounded cache" in text and "estimated gain" in text


@pytest.mark.parametrize(
    "args, message",
    [
        (["simulate", "--policies", "lru"], "unknown eviction policy"),
        (["simulate", "--cpu-cache", "32"], "--cpu-cache 32 is below one block"),
        (["simulate", "--cpu-cache", "64K", "--swap-buffer", "32"], "--swap-buffer 32 is smaller than one block"),
        (["simulate", "--gpu-cache", "lots"], "--gpu-cache"),
        (["simulate", "--gpu-cache", "32"], "below one block"),
        (["simulate", "--scheduler", "random"], "unknown scheduler"),
        (["simulate", "--sessions", "0"], "--sessions"),
        (["simulate", "--model", "nope"], "known models"),
        (["simulate", "--gpu", "a100"], "unknown GPU"),
        (["simulate", "--think-time", "sometimes"], "--think-time"),
        (["simulate", "--trace", "/no/such/folder"], "no such trace"),
        (["simulate", "--trace", str(TRACES / "LICENSE")], "cannot tell the format"),
        (["simulate", "--format", "csv"], "unknown workload format"),
        (["simulate", "--limit-sessions", "0"], "--limit-sessions"),
        (["simulate", "--trace", str(TRACES), "--overflow", "wrap"], "overflow"),
        (["simulate", "--band", "0.1"], "--band applies to the runs of an ensemble: give --repeat N"),
        (["simulate", "--jobs", "0"], "--jobs must be at least 1"),
        (["simulate", "--repeat", "0"], "--repeat must be at least 1"),
        (["simulate", "--repeat", "2", "--band", "1.5"], "--band must be in [0, 1)"),
        (["simulate", "--repeat", "2", "--jitter", "-0.1"], "--jitter must be in [0, 1)"),
        (["simulate", "--repeat", "2", "--jobs", "0"], "--jobs must be at least 1"),
        (["simulate", "--phantom-kernel", "cuda"], "unknown phantom kernel 'cuda'"),
        (["simulate", "--cpu-cache", "128K", "--policies", "sglang-tlru,penelope"], "run them without --cpu-cache"),
        (["analyze"], "needs a trace"),
        (["analyze", str(TRACES), "--gpu-cache", "64K,128K"], "one capacity"),
    ],
)
def test_errors_are_one_line_with_exit_code_2(args, message, capsys):
    assert main([*args, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("penelope: error: ") and err.count("\n") == 1
    assert message in err


def test_malformed_trace_names_the_file(tmp_path, capsys):
    bad = tmp_path / "broken.json"
    bad.write_text('{"block_size": 64, "requests": [{"in": 5}]}')
    assert main(["simulate", "--trace", str(bad), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "broken.json" in err and err.count("\n") == 1


def test_policy_lists_and_think_time_options():
    from penelope.sim.run import parse_policies
    from penelope.sim.workloads.load import parse_think_time
    from penelope.sim.workloads.types import ThinkTime

    assert parse_policies("ablation") == SIX
    # Aliases of one policy count once; the baseline is added in front when missing.
    assert parse_policies("sglang,leaf-tail-node,penelope,private-head-block") == ["sglang", "penelope"]
    assert parse_policies("leaf-head-block") == ["sglang", "leaf-head-block"]
    assert parse_policies("penelope,ablation")[:2] == ["penelope", "leaf-tail-node"]
    assert parse_think_time("recorded") == ThinkTime()
    assert parse_think_time("tool,scale:0.5,cap:60") == ThinkTime("tool", 0.5, 60.0)
    assert parse_think_time("cap:0") == ThinkTime("recorded", 1.0, 0.0)


def test_calibration_file_drives_the_time_model(tmp_path):
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"model": "qwen3-8b", "batch_overhead": 1.0, "source": "test"}))
    payload = simulate(tmp_path, "--limit-sessions", "1", "--calibration", str(calibration), "--gpu", "h200")
    assert payload["config"]["time_model"]["batch_overhead"] == 1.0 and payload["config"]["gpu"] == "h200"
    # Every first token comes out of at least one prefill batch, which now takes over a second.
    for result in payload["results"].values():
        assert result["ttft_p50"] >= 1.0 and result["ttft_mean"] >= 1.0


def without_wall_time(results):
    return {name: {k: v for k, v in r.items() if k != "wall_time"} for name, r in results.items()}


def test_repeat_one_is_the_single_unperturbed_replay(tmp_path):
    args = ("--limit-sessions", "2", "--gpu-cache", "64K")
    plain = simulate(tmp_path, *args)
    once = simulate(tmp_path, *args, "--repeat", "1")
    assert without_wall_time(once["results"]) == without_wall_time(plain["results"])
    assert "ensemble" not in once["config"]


def test_repeat_reports_means_intervals_and_paired_verdicts(tmp_path, capsys):
    # A 64K chunk holds these sessions' holes (up to 41K tokens) beside their new tokens, so they
    # ride as phantoms; an 8K chunk would refill them hole-first, without the ragged kernel.
    payload = simulate(tmp_path, "--limit-sessions", "2", "--gpu-cache", "64K,96K", "--repeat", "3", "--jobs", "1",
                       "--band", "0.05", "--jitter", "0.1", "--perturb-seed", "4", "--phantom-kernel", "triton",
                       "--chunk-size", "64K", "--plot", str(tmp_path / "e.png"))
    ensemble = payload["config"]["ensemble"]
    assert (ensemble["repeat"], ensemble["band"], ensemble["jitter"], ensemble["seed"]) == (3, 0.05, 0.1, 4)
    assert payload["config"]["time_model"]["phantom_kernel"] == "triton"
    for entry in payload["sweep"]:
        sglang, penelope = entry["results"]["sglang"], entry["results"]["penelope"]
        assert sglang["policy"] == "leaf-tail-node" and len(penelope["runs"]) == 3
        ttft = penelope["metrics"]["ttft_mean"]
        runs = [run["ttft_mean"] for run in penelope["runs"]]
        assert ttft["mean"] == pytest.approx(sum(runs) / 3) and ttft["low"] < ttft["mean"] < ttft["high"]
        change = penelope["vs_sglang"]["ttft_mean"]
        per_run = [run["vs_sglang"]["ttft_mean"] for run in penelope["runs"]]
        assert change["mean"] == pytest.approx(sum(per_run) / 3)
        significant = change["high"] < 0 or change["low"] > 0
        assert (change["verdict"] != "no significant difference") == significant
        assert sglang["vs_sglang"]["ttft_mean"] == {"mean": 0.0, "low": 0.0, "high": 0.0, "n": 3,
                                                    "confidence": 0.95, "verdict": "no significant difference"}
        # Penelope's phantom batches ran on the Triton kernel; SGLang never refills a hole.
        assert all(run["phantom_batches"] > 0 for run in penelope["runs"])
        assert all(run["phantom_batches"] == 0 for run in sglang["runs"])
    out = capsys.readouterr().out
    assert out.count("changes against sglang, paired run by run") == 2 and "3 runs (" in out
    assert "batches refilling holes on the Triton ragged kernel at 1.5x" in out
    assert (tmp_path / "e.png").read_bytes()[:4] == b"\x89PNG"


BEYOND = ["ttl", "flop-recency", "penelope-agent", "oracle"]


def test_all_policies_with_the_oracle_bracket(tmp_path, capsys):
    assert parse_policies_all() == SIX + BEYOND
    payload = simulate(tmp_path, "--limit-sessions", "3", "--gpu-cache", "64K", "--policies", "all",
                       "--plot", str(tmp_path / "a.png"))
    results = payload["results"]
    assert list(results) == SIX + BEYOND
    oracle = results["oracle"]
    # The bracket: the bound is below what the oracle paid; every distance is against its run.
    assert 0 < oracle["recompute_bound"] <= oracle["recompute_cost"]
    assert oracle["vs_oracle"]["recompute_cost"] == 0.0
    for name, result in results.items():
        assert "recompute_bound" not in result or name == "oracle"
        assert result["vs_oracle"]["recompute_cost"] == pytest.approx(
            result["recompute_cost"] / oracle["recompute_cost"] - 1)
        assert result["vs_oracle"]["jct_mean"] == pytest.approx(result["jct_mean"] / oracle["jct_mean"] - 1)
    out = capsys.readouterr().out
    assert "oracle bracket: the optimal recompute cost lies in [" in out and "TTFT vs oracle" in out
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"


def test_repeat_with_the_oracle_reports_the_bracket_per_run(tmp_path, capsys):
    payload = simulate(tmp_path, "--limit-sessions", "2", "--gpu-cache", "64K", "--repeat", "2", "--jobs", "1",
                       "--policies", "penelope-agent,oracle", "--plot", str(tmp_path / "o.png"))
    agent, oracle = payload["results"]["penelope-agent"], payload["results"]["oracle"]
    runs = [run["vs_oracle"]["ttft_mean"] for run in agent["runs"]]
    assert agent["vs_oracle"]["ttft_mean"]["mean"] == pytest.approx(sum(runs) / 2)
    assert all(0 < run["recompute_bound"] <= run["recompute_cost"] for run in oracle["runs"])
    assert "oracle bracket" in capsys.readouterr().out
    assert (tmp_path / "o.png").read_bytes()[:4] == b"\x89PNG"


def parse_policies_all():
    from penelope.sim.run import parse_policies

    return parse_policies("all")


@pytest.mark.parametrize("argv, given", [
    (["simulate"], set()),
    (["simulate", "--sessions", "2", "--no-shared-prefix"], {"sessions"}),
    (["analyze", "--format", "synthetic", "--think-time", "tool"], {"think_time"}),
])
def test_options_checked_twice_give_the_same_answer(argv, given):
    """The defaults filled on the first check are not taken for given options on a second one
    (a caller that prepares a run from options it parsed once, as `reproduce` does)."""
    from penelope.cli import build_parser
    from penelope.commands.workload_options import check_workload_options, fill_scoped_defaults
    from penelope.errors import UsageError

    args = build_parser().parse_args(argv)
    path = getattr(args, "trace", getattr(args, "path", None))
    first = fill_scoped_defaults(args)
    if "--no-shared-prefix" in argv:
        given = given | {"no_shared_prefix"}
        with pytest.raises(UsageError, match="--no-shared-prefix applies to WEKA traces only"):
            check_workload_options(args, path, first)
    else:
        assert check_workload_options(args, path, first) == "synthetic"
        assert check_workload_options(args, path, fill_scoped_defaults(args)) == "synthetic"
    assert first == given and fill_scoped_defaults(args) == given
    assert args.sessions == (2 if "--sessions" in argv else 4)
