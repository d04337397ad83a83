"""Hostile input through the CLI: every example is one line naming the input
with exit code 2, checked before any work, and nothing is written."""
import json
import os

import pytest

from penelope.cli import main

QWEN = {"hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 12288}


def one_error(capsys, *message):
    """The command wrote exactly one line to stderr, `penelope: error: ...` containing `message`."""
    err = capsys.readouterr().err
    assert err.startswith("penelope: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for part in message:
        assert part in err, err
    return err


def write_config(tmp_path, text: str | bytes, name="config.json"):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


@pytest.mark.parametrize("fields, message", [
    ({"num_hidden_layers": 1e9}, "'num_hidden_layers' must be in [1, 4096], got 1000000000"),
    ({"num_hidden_layers": 36.7}, "'num_hidden_layers' must be an integer, got 36.7"),
    ({"num_key_value_heads": 0}, "'num_key_value_heads' must be in [1,"),
    ({"num_attention_heads": 0}, "'num_attention_heads' must be in [1,"),
    ({"hidden_size": "4096"}, "'hidden_size' must be an integer, got '4096'"),
    ({"hidden_size": None}, "'hidden_size' is null; it is required"),
    ({"intermediate_size": -1}, "'intermediate_size' must be in [0,"),
    ({"sliding_window": 1024, "sliding_window_pattern": "six"}, "'sliding_window_pattern' must be an integer"),
    ({"sliding_window": 1024, "sliding_window_pattern": 0}, "'sliding_window_pattern' must be in [1,"),
    ({"layer_types": "full_attention"}, "'layer_types' must be a list"),
    ({"num_experts": 8, "num_experts_per_tok": 9, "moe_intermediate_size": 64}, "9 experts per token exceed the 8"),
    ({"num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": "0"}, "'mlp_only_layers' must be a list"),
])
def test_bad_model_config_fields(tmp_path, capsys, fields, message):
    path = write_config(tmp_path, json.dumps({**QWEN, **fields}))
    assert main(["cost", "--model", path]) == 2
    one_error(capsys, path, message)


@pytest.mark.parametrize("text, message", [
    ('{"hidden_size": Infinity, "num_hidden_layers": 36, "num_attention_heads": 32}', "got inf"),
    (b'{"hidden_size": 4096, "name": "\xff\xfe"}', "not UTF-8 text"),
    ("[1, 2]", "must be a JSON object"),
    ("[" * 5000, "JSON nested too deeply"),
    ('{"hidden_size": 1' + "0" * 5000 + "}", "not valid JSON"),
    ("", "not valid JSON"),
])
def test_bad_model_config_files(tmp_path, capsys, text, message):
    path = write_config(tmp_path, text)
    assert main(["cost", "--model", path]) == 2
    one_error(capsys, message)


def test_a_config_with_36_0_layers_is_36_layers(tmp_path):
    # A JSON float that is a whole number is that number: nothing is truncated.
    from penelope.costmodel.shapes import get_model

    path = write_config(tmp_path, json.dumps({**QWEN, "num_hidden_layers": 36.0}))
    assert get_model(path).num_layers == 36


@pytest.mark.parametrize("args, message", [
    (["cost", "--contexts", "1e300"], "--contexts: '1e300' is beyond the largest size"),
    (["cost", "--contexts", "nan"], "--contexts: 'nan' is not a number"),
    (["cost", "--append", "inf"], "--append: 'inf' is beyond the largest size"),
    (["simulate", "--gpu-cache", "inf"], "--gpu-cache: 'inf' is beyond"),
    (["simulate", "--gpu-cache", "nan"], "--gpu-cache: 'nan' is not a number"),
    (["simulate", "--gpu-cache", "100"], "--gpu-cache 100: no request of the workload fits"),
    # 20,608 + 275 tokens fit 24K, the second turn's 26,876 + 586 do not: --prime would leave 0 requests.
    (["simulate", "--limit-sessions", "1", "--turns", "2", "--prime", "--gpu-cache", "24K"],
     "--gpu-cache 24K: no request --prime measures fits in it (the smallest needs 27,462 tokens"),
    (["simulate", "--seed", "-1"], "--seed must be in [0, 2**63), got -1"),
    (["simulate", "--seed", "x"], "argument --seed: invalid int value: 'x'"),
    (["simulate", "--max-context", "1G"], "a synthetic workload of 24 sessions"),
    (["simulate", "--think-time", "scale:1e17"], "think times add up to"),
    (["simulate", "--limit-sessions", "-3"], "--limit-sessions must be at least 1"),
    (["simulate", "--cpu-cache", "1K", "--swap-buffer", "2G-1"], "--swap-buffer: cannot read '2G-1'"),
    (["simulate", "--cpu-cache", "1K", "--swap-buffer", "1M"], "--swap-buffer 1048576 is larger than the CPU tier"),
    (["simulate", "--repeat", "1000000000"], "--repeat must be at most 10,000"),
    (["simulate", "--repeat", "2", "--jobs", "100000"], "--jobs must be at most 256"),
    (["simulate", "--repeat", "2", "--perturb-seed", str(2**64)], "--perturb-seed must be below 2**63"),
    (["verify", "--engine", "sglang", "--engine-arg", "x=" + "[" * 5000], "--engine-arg x: JSON nested too deeply"),
    (["verify", "--device", "tpu9"], "--device tpu9: not a device"),
    (["verify", "--sessions", "5000"], "--sessions must be at most 4096, got 5000"),
    (["cost", "--evict-frac", "2"], "--evict-frac must be in (0, 1), got 2.0"),
    (["verify", "--cache-tokens", "2000000000"], "K/V pools of"),
    (["verify", "--engine", "sglang", "--atol", "nan"], "--atol must be a finite"),
    (["nonsense"], "argument COMMAND: invalid choice: 'nonsense'"),
    (["simulate", "--trace", ""], "--trace: empty value"),
    (["simulate", "--overflow", "explode"], "argument --overflow: invalid choice: 'explode'"),
    (["simulate", "--subagents", "maybe"], "argument --subagents: invalid choice: 'maybe'"),
    (["simulate", "--swap-buffer", "2K"], "--swap-buffer applies to the two tiers: give --cpu-cache too"),
    (["simulate", "--think-time", "tool,tool,recorded"], "'tool' contradicts or repeats an earlier item"),
    (["simulate", "--think-time", "scale:1,scale:2"], "'scale:2' contradicts or repeats an earlier item"),
    (["simulate", "--think-time", "cap:1e400"], "think-time cap must be a finite non-negative"),
    (["simulate", "--sessions", "99999999999999999999"], "--sessions must be in [1, 1,048,576]"),
    (["simulate", "--calibration", " "], "--calibration: empty value"),
    (["cost", "--model", ""], "--model: empty value"),
    (["analyze", ""], "PATH: empty value"),
    (["simulate", "--format", "mooncake"], "--format mooncake needs a --trace (a JSONL file)"),
    # Options of some workloads only, given for another: refused before the trace is read.
    (["simulate", "--overflow", "drop"], "--overflow applies to WEKA traces only, not to the synthetic workload"),
    (["simulate", "--no-shared-prefix"], "--no-shared-prefix applies to WEKA traces only"),
    (["simulate", "--trace", "/dev/zero", "--format", "mooncake", "--sessions", "2"],
     "--sessions applies to closed-loop workloads (WEKA, synthetic) only: a Mooncake trace is replayed open loop"),
    (["simulate", "--trace", "/dev/zero", "--format", "mooncake", "--think-time", "tool"],
     "--think-time applies to closed-loop workloads"),
    # The option is out of place: said before its value is read.
    (["simulate", "--trace", "/dev/zero", "--format", "mooncake", "--think-time", "bogus"],
     "--think-time applies to closed-loop workloads"),
    (["analyze", "/dev/zero", "--format", "synthetic"], "--format synthetic takes no PATH\n"),
    (["analyze", "--format", "synthetic", "--subagents", "replay"],
     "--subagents applies to WEKA traces only, not to the synthetic workload"),
    (["analyze", "/dev/zero", "--format", "mooncake", "--sessions", "4"],
     "--sessions applies to closed-loop workloads"),
    (["simulate", "--per-replica"], "--per-replica applies to --replicas N > 1"),
    (["analyze", "--format", "synthetic", "--router", "session"],
     "--router applies to replicas behind a router: this closed-loop workload is replayed on one server"),
    (["analyze", "--format", "synthetic", "--cache-threshold", "0.3"], "--cache-threshold applies to replicas"),
    (["analyze", " "], "PATH: empty value"),
    (["reproduce", "--out", ""], "--out: empty value"),
    (["verify", "--engine", "sglang", "--engine-arg", ""], "--engine-arg: empty value"),
    (["verify", "--engine", "sglang", "--attention", "triton"], "--attention applies to --engine reference only"),
    (["verify", "--engine", "sglang", "--swap-buffer", "64"], "--swap-buffer applies to --engine reference only"),
    (["verify", "--chunk", "256"], "--chunk applies to --engine sglang only"),
    (["verify", "--engine-arg", "x=1"], "--engine-arg applies to --engine sglang only"),
    (["verify", "--engine", "sglang", "--chunk", "100"], "--chunk 100 is not a multiple of --page-size 64"),
    (["verify", "--engine", "sglang", "--device", "cuda:1"], "--device cuda:1: --engine sglang runs on cpu or"),
    (["verify", "--engine", "sglang", "--cache-tokens", "500"], "--cache-tokens 500 cannot hold the longest"),
    (["verify", "--engine", "sglang", "--cpu-cache", "100"], "--cpu-cache 100 is not a multiple of --page-size"),
    (["verify", "--engine", "sglang", "--model", "/no/such/model"], "--model /no/such/model: not a checkpoint"),
    (["verify", "--engine", "sglang", "--engine-arg", "page_size=16"], "--engine-arg page_size: the check sets it;"),
    (["verify", "--engine", "sglang", "--engine-arg", "no_such_arg=1"], "--engine-arg no_such_arg: not an argument"),
    (["verify", "--engine", "sglang", "--engine-arg", "tp_size=NaN"], "--engine-arg tp_size: expected int, got NaN"),
    (["verify", "--engine", "sglang", "--engine-arg", "mem_fraction_static=\"x\""],
     "--engine-arg mem_fraction_static: expected float or null"),
    (["verify", "--engine", "sglang", "--engine-arg", "enable_deterministic_inference=1"],
     "--engine-arg enable_deterministic_inference: expected bool, got 1"),
    (["verify", "--engine", "sglang", "--cpu-cache", "-64"], "--cpu-cache must be a non-negative number"),
])
def test_bad_numbers_and_names(args, message, capsys):
    assert main([*args, "--no-progress"] if args[0] == "simulate" else args) == 2
    one_error(capsys, message)


def test_calibration_out_of_range_or_not_a_file(tmp_path, capsys):
    calibration = tmp_path / "cal.json"
    calibration.write_text(json.dumps({"batch_overhead": 1e308}))
    assert main(["simulate", "--calibration", str(calibration), "--no-progress"]) == 2
    one_error(capsys, str(calibration), "batch_overhead must be in [0, 60], got 1e+308")
    assert main(["simulate", "--calibration", str(tmp_path), "--no-progress"]) == 2
    one_error(capsys, "is a folder, not a file")
    binary = tmp_path / "cal.bin"
    binary.write_bytes(bytes(range(256)))
    assert main(["simulate", "--calibration", str(binary), "--no-progress"]) == 2
    one_error(capsys, "not UTF-8 text")


def write_lines(path, lines):
    path.write_bytes(b"\n".join(line if isinstance(line, bytes) else json.dumps(line).encode() for line in lines))
    return str(path)


def line(timestamp=0, hash_ids=(1,), **extra):
    return {"timestamp": timestamp, "input_length": 64 * len(hash_ids), "output_length": 4,
            "hash_ids": list(hash_ids), **extra}


@pytest.mark.parametrize("lines, message", [
    ([line(session_id=1), line(100, session_id="1")], "session_id '1' appears both as a string and as an integer"),
    ([line(hash_ids=[[1], [2, 3]])], "m.jsonl:1: hash ids must be a flat list of integers"),
    ([line(hash_ids=[1.5])], "m.jsonl:1: hash ids must be integers"),
    ([line(), b'{"timestamp": 5, "note": "\xff"}'], "m.jsonl:2: not UTF-8 text"),
    ([line(1_700_000_000_000_000_000)], "'timestamp' 1700000000000000000 ms is beyond 2**32 s"),
])
def test_bad_mooncake_traces(tmp_path, capsys, lines, message):
    path = write_lines(tmp_path / "m.jsonl", lines)
    assert main(["simulate", "--trace", path, "--gpu-cache", "16K", "--no-progress"]) == 2
    one_error(capsys, message)


def weka_trace(requests, **fields):
    return {"block_size": 64, "tool_tokens": 64, "system_tokens": 0, "requests": requests, **fields}


def weka_request(hash_ids=(1, 2), think_time=1.0):
    return {"t": 0, "in": 64 * len(hash_ids), "out": 4, "hash_ids": list(hash_ids), "input_types": ["text"],
            "think_time": think_time}


def nested_subagents_text(depth):
    """A WEKA trace with sub-agents nested `depth` deep, as JSON text (json.dumps would recurse)."""
    head = '{"type": "subagent", "agent_id": "a", "requests": ['
    inner = head * depth + json.dumps(weka_request()) + "]}" * depth
    return json.dumps(weka_trace(["PLACEHOLDER"])).replace('"PLACEHOLDER"', f"{json.dumps(weka_request())}, {inner}")


def nested_subagents(depth):
    inner = [weka_request()]
    for level in range(depth):
        inner = [{"type": "subagent", "agent_id": f"a{level}", "requests": inner}]
    return [weka_request(), *inner]


@pytest.mark.parametrize("trace, message", [
    (weka_trace([weka_request(), weka_request([[1], [2, 3]])]), "requests[1]: hash ids must be a flat list"),
    (weka_trace([weka_request(), weka_request([1, [2, 3]])]), "requests[1]: hash ids must be a flat list"),
    (weka_trace([weka_request(), weka_request(["x", 2.5])]), "requests[1]: hash ids must be integers"),
    (nested_subagents_text(5000), "JSON nested too deeply"),
    (weka_trace([weka_request(), weka_request(think_time=1e17)]), "think times add up to 1e+17 s"),
])
def test_bad_weka_traces(tmp_path, capsys, trace, message):
    path = tmp_path / "t.json"
    path.write_text(trace if isinstance(trace, str) else json.dumps(trace))
    assert main(["simulate", "--trace", str(path), "--gpu-cache", "16K", "--no-progress"]) == 2
    one_error(capsys, message)


def test_deep_but_parsable_subagents_are_counted_without_recursion(tmp_path):
    from penelope.sim.workloads.weka import _count_entries, load_weka

    path = tmp_path / "t.json"
    path.write_text(nested_subagents_text(300))
    workload = load_weka(path)
    assert workload.summary.subagents == 300 and workload.summary.dropped == {"subagent": 1}
    # Deeper than the recursion limit: counted by a loop.
    assert _count_entries(nested_subagents(5000)[1:]) == (1, 5000)


def test_think_times_just_below_the_clock_range_keep_ttft(tmp_path):
    # 1e9 s waits stay within 2**32 s: TTFT keeps its milliseconds (it was 0.000 at 1e17 s).
    path = tmp_path / "t.json"
    path.write_text(json.dumps(weka_trace([weka_request(), weka_request(think_time=1e9)])))
    out = tmp_path / "o.json"
    assert main(["simulate", "--trace", str(path), "--gpu-cache", "16K", "--no-progress", "--json", str(out)]) == 0
    result = json.loads(out.read_text())["results"]["sglang"]
    assert 0.001 < result["ttft_p50"] < 1 and result["requests"] == 2


def test_epoch_millisecond_mooncake_timestamps_keep_ttft(tmp_path):
    epoch_ms = 1_700_000_000_000
    path = write_lines(tmp_path / "m.jsonl", [line(epoch_ms, session_id="a"), line(epoch_ms + 5, session_id="a")])
    out = tmp_path / "o.json"
    assert main(["simulate", "--trace", path, "--gpu-cache", "16K", "--no-progress", "--json", str(out)]) == 0
    result = json.loads(out.read_text())["results"]["sglang"]
    assert result["ttft_p50"] > 0.003


def test_arguments_errors_are_one_line(capsys):
    assert main(["simulate", "--sessions", "many"]) == 2
    one_error(capsys, "argument --sessions: invalid int value: 'many'", "(see penelope simulate --help)")


def test_help_still_exits_0(capsys):
    assert main(["cost", "--help"]) == 0
    assert "--contexts" in capsys.readouterr().out


def test_runtime_fault_is_one_line_with_exit_code_1(monkeypatch, capsys):
    from penelope.commands import cost
    from penelope.errors import CacheFullError

    def fail(*args, **kwargs):
        raise CacheFullError("need 64 slots: 0 free")

    monkeypatch.setattr(cost, "predict_speedup", fail)
    assert main(["cost"]) == 1
    err = capsys.readouterr().err
    assert err == "penelope: error: CacheFullError: need 64 slots: 0 free\n"


def test_ctrl_c_is_one_line_with_exit_code_130(monkeypatch, capsys):
    from penelope.commands import cost

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cost, "predict_speedup", interrupt)
    assert main(["cost"]) == 130
    assert capsys.readouterr().err == "penelope: interrupted\n"


def test_file_names_with_a_nul_byte(capsys):
    # Not from a shell, but main() takes any string.
    assert main(["cost", "--json", "a\0b"]) == 2
    one_error(capsys, "a file name cannot hold a NUL byte")
    assert main(["simulate", "--calibration", "a\0b"]) == 2
    one_error(capsys, "a file name cannot hold a NUL byte")


def test_a_message_with_a_line_break_stays_one_line(tmp_path, capsys):
    folder = tmp_path / "two\nlines"
    folder.mkdir()
    assert main(["cost", "--json", str(folder / "x" / "y.json")]) == 2
    one_error(capsys, "two\\nlines")


def test_gpu_cache_of_a_gigatoken_starts_at_once(tmp_path):
    # The slot pool grows with use: 1G slots used to allocate 17 GB before the first request.
    import tracemalloc

    from penelope.cache.manager import KVCache

    tracemalloc.start()
    cache = KVCache(1 << 30)
    cache.insert(*(lambda slots: (list(range(128)), slots))(cache.alloc(128)))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    cache.check_invariants()
    assert cache.free_size() == (1 << 30) - 128 and peak < 10 * 2**20


def test_os_error_is_one_line(tmp_path, monkeypatch, capsys):
    from penelope.commands import cost

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device", str(tmp_path / "c.json"))

    monkeypatch.setattr(cost, "write_text", full)
    assert main(["cost", "--json", str(tmp_path / "c.json")]) == 1
    assert capsys.readouterr().err == f"penelope: error: {tmp_path / 'c.json'}: No space left on device\n"
    assert not os.path.exists(tmp_path / "c.json")


def test_replays_are_checked_against_memory_before_they_start(monkeypatch, capsys):
    # The caches allocate as they fill; what the largest may reach, in every worker, must fit.
    from penelope import memory

    monkeypatch.setattr(memory, "available_bytes", lambda: 200 * 2**20)
    assert main(["simulate", "--gpu-cache", "1G", "--limit-sessions", "4", "--repeat", "2", "--jobs", "2",
                 "--no-progress"]) == 2
    one_error(capsys, "replaying", "requests in a cache of 1G tokens in 2 processes", "needed, more than the 200.0 MiB")
    assert main(["simulate", "--gpu-cache", "64K", "--limit-sessions", "1", "--no-progress"]) == 0


@pytest.mark.parametrize("args", [["--think-time", "sometimes"], ["--seed", "-1"], ["--limit-sessions", "0"],
                                  ["--gpu-cache", "nan"], ["--max-context", "0"], ["--sessions", "0"],
                                  ["--repeat", "2", "--band", "2"], ["--policies", "lru"]])
def test_option_errors_are_found_before_the_workload_is_loaded(args, monkeypatch, capsys):
    from penelope.sim.workloads import load as options

    def loaded(*args, **kwargs):
        raise AssertionError("the workload was loaded before the options were checked")

    monkeypatch.setattr(options, "load_workload", loaded)
    assert main(["simulate", *args, "--no-progress"]) == 2
    one_error(capsys)


def test_a_named_pipe_nobody_reads_is_refused_before_the_run(tmp_path, capsys):
    """Writing would block forever after the whole run."""
    pipe = tmp_path / "out.json"
    os.mkfifo(pipe)
    assert main(["cost", "--json", str(pipe)]) == 2
    one_error(capsys, f"--json {pipe} is a named pipe that no process reads")


def test_a_full_device_names_the_file(capsys):
    assert main(["cost", "--json", "/dev/full"]) == 1
    err = capsys.readouterr().err
    assert err == "penelope: error: /dev/full: No space left on device\n", err


def test_verify_on_cpu_without_sglangs_cpu_kernels_says_so_before_any_engine(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sgl_kernel" else real(name, *a))
    assert main(["verify", "--engine", "sglang"]) == 2
    one_error(capsys, "needs SGLang's CPU kernel package sgl_kernel")


def test_no_command_is_a_usage_error_on_stderr(capsys):
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: penelope")


def test_an_output_folder_name_too_long_is_a_usage_error(tmp_path, capsys):
    assert main(["reproduce", "--out", str(tmp_path / ("x" * 300))]) == 2
    one_error(capsys, "--out", "cannot create this folder")


def test_a_json_beside_a_model_folder_is_not_called_a_trace(tmp_path, monkeypatch, capsys):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    main(["verify", "--engine", "sglang", "--model", ".", "--json", "w.json"])
    assert "trace folder" not in capsys.readouterr().err


def test_a_mooncake_trace_of_requests_over_the_window_says_so(tmp_path, capsys):
    trace = tmp_path / "huge.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 300_000, "output_length": 1,
                                 "hash_ids": list(range(586))}) + "\n")
    assert main(["simulate", "--trace", str(trace), "--no-progress"]) == 2
    one_error(capsys, "all 1 requests are longer than --max-context 131,072")
    assert main(["simulate", "--trace", "/dev/zero", "--format", "mooncake", "--no-progress"]) == 2
    one_error(capsys, "/dev/zero: not a regular file")


def test_a_host_tier_beyond_the_slots_is_refused_before_any_output(capsys):
    """Found before any work starts: nothing on stdout (the header was printed first before)."""
    assert main(["simulate", "--gpu-cache", "2147483000", "--cpu-cache", "2147483000", "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert "--cpu-cache 2147483000 + --swap-buffer 1024 is beyond the 2**31 host slots" in captured.err
