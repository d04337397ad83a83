"""`penelope load` against a stand-in server: the report, bad input as one line (exit 2), and
Ctrl-C or SIGTERM keeping the records of the requests that ended."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from loadgen_stub import StubServer

from penelope.cli import main
from penelope.loadgen.records import read_records

QUICK = ["--vocab", "1000", "--scale", "32", "--limit-sessions", "2", "--turns", "3", "--think-time", "cap:0",
         "--no-progress"]


def test_a_run_prints_the_table_the_overhead_and_writes_its_files(tmp_path, capsys):
    records, report = tmp_path / "records.jsonl", tmp_path / "load.json"
    with StubServer() as stub:
        code = main(["load", "--url", stub.url, *QUICK, "--repeat", "2", "--records", str(records),
                     "--json", str(report), "--plot", str(tmp_path / "load.png")])
    out = capsys.readouterr().out
    assert code == 0
    for label in ("TTFT mean", "TTFT p99", "ITL mean", "E2E mean", "JCT mean", "throughput", "cached fraction",
                  "errors", "client overhead mean"):
        assert label in out
    assert "mean ±95% over runs" in out and "client overhead per request: mean" in out
    assert "12 requests sent over 2 runs, 12 finished" in out
    kept = read_records(str(records))
    assert len(kept) == 12 and {r.repeat for r in kept} == {0, 1} and all(r.ok for r in kept)
    payload = json.loads(report.read_text())
    assert len(payload["runs"]) == 2 and payload["estimates"]["ttft_mean"]["n"] == 2
    assert payload["server"]["vocab"] == 1000 and (tmp_path / "load.png").stat().st_size > 0


def _bad_jsonl(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10}\n')
    return ["--trace", str(path)]


@pytest.mark.parametrize(("args", "message"), [
    (lambda url, tmp: ["--url", "http://127.0.0.1:9", "--vocab", "10"], "cannot reach the server at"),
    (lambda url, tmp: ["--url", url, "--api", "openai", "--vocab", "10"], "a one-token request failed: HTTP 404"),
    (lambda url, tmp: ["--url", url, "--api", "openai", "--vocab", "10"], "(no /v1/completions there: another --api?)"),
    (lambda url, tmp: ["--url", url, "--vocab", "1000", *_bad_jsonl(tmp)], "bad.jsonl:1: 'output_length'"),
    (lambda url, tmp: ["--url", url, "--vocab", "1000", "--max-context", "128K"], "do not fit the server's context"),
    (lambda url, tmp: ["--url", url, "--vocab", "1000", "--max-context", "128K"],
     "at --scale 1); scale the workload down (--scale), or leave the longest requests out (--max-context, --turns)"),
    (lambda url, tmp: ["--url", url, "--vocab", "1000", "--scale", "0.5"], "--scale must be a number of at least 1"),
    (lambda url, tmp: ["--url", url, "--vocab", "1000", "--sessions", "0"], "--sessions must be at least 1"),
    (lambda url, tmp: ["--url", url, "--vocab", "1000", "--repeat", "0"], "--repeat must be in [1, 1000]"),
    (lambda url, tmp: ["--url", url + "/generate", "--vocab", "10"], "/generate: give the server's address without "
     "a path (the API path is added)"),
    (lambda url, tmp: ["--url", url], "does not say its vocabulary size (its model folder is not readable here); "
     "give --vocab N (ids at or above it crash the server)"),
    # The workload's options are checked before the server is contacted.
    (lambda url, tmp: ["--url", "http://127.0.0.1:9", "--trace", "/no/such/trace"], "/no/such/trace: no such trace"),
    (lambda url, tmp: ["--url", "http://127.0.0.1:9", "--think-time", "sometimes"], "--think-time: cannot read"),
    (lambda url, tmp: ["--url", "http://127.0.0.1:9", "--limit-sessions", "0"], "--limit-sessions must be at least"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    with StubServer(apis=("generate",), max_input=2000) as stub:
        code = main(["load", *args(stub.url, tmp_path), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("penelope: error: ") and message in err, err


@pytest.mark.parametrize("argv, message", [
    (["--url", "ftp://127.0.0.1:9"], "--url ftp://127.0.0.1:9: expected http://HOST:PORT"),
    (["--url", "http://127.0.0.1:99999"], "--url http://127.0.0.1:99999: the port is not a number in [0, 65535]"),
    (["--url", "http://127.0.0.1:9/v1"], "--url http://127.0.0.1:9/v1: give the server's address without a path "
     "(the API path is added)"),
    (["--vocab", str(2**31 + 1)], "--vocab must be an integer in [2, 2**31], got 2147483649"),
    (["--seed", "-1"], "--seed must be an integer in [0, 2**63), got -1"),
    (["--scale", "nan"], "--scale must be a number of at least 1 (it divides token counts), got nan"),
    (["--sessions", "0"], "--sessions must be at least 1, got 0"),
    (["--max-requests", "0"], "--max-requests must be at least 1, got 0"),
    (["--duration", "-1"], "--duration must be a positive number of seconds, got -1.0"),
    (["--read-timeout", "0"], "--read-timeout must be a positive number of seconds, got 0.0"),
    (["--temperature", "-1"], "--temperature must be a non-negative number, got -1.0"),
])
def test_the_librarys_fields_are_shown_as_the_flags_typed(capsys, argv, message):
    """The load generator's errors name its fields (`url`, `max_requests`); `penelope load` names
    the flags, before any server is contacted."""
    assert main(["load", "--url", "http://127.0.0.1:9", "--no-progress", *argv]) == 2
    assert capsys.readouterr().err == f"penelope: error: {message}\n"


def test_a_prompt_longer_than_the_servers_context_is_named(capsys):
    """The server takes prompts below 2,000 tokens; the first synthetic prompt at scale 4 is 5,152."""
    with StubServer(max_input=2000) as stub:
        code = main(["load", "--url", stub.url, "--vocab", "1000", "--scale", "4", "--max-context", "128K"])
    err = capsys.readouterr().err
    assert code == 2 and "synthetic session 0 request 0: a prompt of 5,152 tokens" in err
    assert "prompts up to 1,999" in err


@pytest.mark.parametrize(("signum", "code", "word"), [(signal.SIGINT, 130, "interrupted"),
                                                       (signal.SIGTERM, 143, "terminated")])
def test_ctrl_c_and_sigterm_keep_the_requests_that_ended(tmp_path, signum, code, word):
    records = tmp_path / "records.jsonl"
    with StubServer() as stub:
        stub.mode, stub.slow_delay = "slow", 0.05
        process = subprocess.Popen(
            [sys.executable, "-m", "penelope.cli", "load", "--url", stub.url, "--vocab", "1000", "--scale", "64",
             "--think-time", "cap:0", "--sessions", "3", "--records", str(records), "--no-progress"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and (not records.exists() or records.read_text().count("\n") < 4):
                time.sleep(0.1)
            process.send_signal(signum)
            out, err = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
    assert process.returncode == code, err
    kept = read_records(str(records))
    ended = [r for r in kept if r.ok]
    assert len(ended) >= 4 and {r.status for r in kept} <= {"ok", "cut"}
    assert err.strip().splitlines() == [f"penelope: {word}; wrote the {len(kept)} requests that ended to {records}"]
    assert "Traceback" not in err and os.path.getsize(records) > 0


def _trace(tmp_path, name, text):
    path = tmp_path / name
    if name.endswith("/"):
        path.mkdir()
    else:
        path.write_text(text)
    return str(path)


MOONCAKE = "".join(json.dumps({"timestamp": 1000 * i, "input_length": 600, "output_length": 8, "hash_ids": [1, 2]})
                   + "\n" for i in range(4))


@pytest.mark.parametrize(("name", "text", "extra", "message"), [
    ("bad.jsonl", '{"timestamp": 0, "input_length": 10}\n', [], "bad.jsonl:1: 'output_length'"),
    ("garbage.jsonl", "garbage\n", [], "garbage.jsonl:1: not valid JSON"),
    ("empty.jsonl", "", [], "empty.jsonl: no requests"),
    ("empty/", None, [], "no *.json trace files in this folder"),
    ("weka.json", "{}", [], "expected a JSON object with a 'requests' list"),
    ("short.jsonl", MOONCAKE, ["--from-context", "1K"], "--from-context 1,024: no session reaches it"),
    # Read whole, with the context bound given.
    ("garbage.jsonl", "garbage\n", ["--max-context", "64K"], "garbage.jsonl:1: not valid JSON"),
])
def test_a_trace_that_does_not_parse_is_named_before_the_server_is_contacted(tmp_path, capsys, name, text, extra,
                                                                            message):
    """An unreachable server and a bad trace: the trace is named (not the server); a reachable
    one is sent nothing."""
    trace = _trace(tmp_path, name, text)
    assert main(["load", "--url", "http://127.0.0.1:9", "--vocab", "1000", "--trace", trace, *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("penelope: error: ") and message in err, err
    with StubServer() as stub:
        assert main(["load", "--url", stub.url, "--vocab", "1000", "--trace", trace, *extra]) == 2
        assert stub.requests == []
    assert message in capsys.readouterr().err


def test_an_absurd_scale_is_named_as_the_scale(tmp_path, capsys):
    """--scale 1e9 and a server of 99,999 tokens: the context it sets, --max-context, would be beyond
    any size; the error names --scale. With a trace, a scale that leaves every prompt 1 token is
    refused before the server is contacted."""
    with StubServer() as stub:
        assert main(["load", "--url", stub.url, "--vocab", "1000", "--scale", "1e9", "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("penelope: error: --scale 1e+09: the server's longest prompt, 99,999 tokens, is "
                              "99,999,000,000,000 trace tokens") and err.count("\n") == 1, err
        assert "--max-context" in err.split(";")[-1]
    with StubServer() as stub:
        assert main(["load", "--url", stub.url, "--vocab", "1000", "--scale", "1e9", "--max-context", "128K",
                     "--no-progress"]) == 2
        assert capsys.readouterr().err.startswith("penelope: error: --scale 1e+09 makes every prompt of the "
                                                  "workload 1 token (its longest has 131,072)")
        assert stub.requests == []
    trace = _trace(tmp_path, "m.jsonl", MOONCAKE)
    assert main(["load", "--url", "http://127.0.0.1:9", "--vocab", "1000", "--trace", trace, "--scale", "1000"]) == 2
    assert capsys.readouterr().err == ("penelope: error: --scale 1000 makes every prompt of the workload 1 token "
                                       "(its longest has 600): no history left to cache; give a --scale of at most "
                                       "400\n")


@pytest.mark.parametrize(("trace", "option", "message"), [
    (True, ["--sessions", "2"], "--sessions applies to closed-loop workloads (WEKA, synthetic) only: a Mooncake "
     "trace is replayed open loop"),
    (True, ["--sessions", "4"], "--sessions applies to closed-loop workloads"),
    (True, ["--think-time", "tool"], "--think-time applies to closed-loop workloads"),
    (True, ["--overflow", "drop"], "--overflow applies to WEKA traces only, not to a Mooncake trace"),
    (True, ["--no-shared-prefix"], "--no-shared-prefix applies to WEKA traces only"),
    (False, ["--subagents", "replay"], "--subagents applies to WEKA traces only, not to the synthetic workload"),
    (False, ["--overflow", "skip"], "--overflow applies to WEKA traces only, not to the synthetic workload"),
])
def test_options_that_do_not_apply_to_the_workload_are_refused(tmp_path, capsys, trace, option, message):
    """Not ignored: refused with one line before the server is contacted."""
    given = ["--trace", _trace(tmp_path, "m.jsonl", MOONCAKE)] if trace else []
    assert main(["load", "--url", "http://127.0.0.1:9", "--vocab", "1000", *given, *option]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"penelope: error: {message}"), err


def test_options_that_apply_are_taken(tmp_path, capsys):
    """The defaults of the options refused elsewhere still apply; a Mooncake trace runs without them."""
    trace = _trace(tmp_path, "m.jsonl", MOONCAKE)
    with StubServer() as stub:
        assert main(["load", "--url", stub.url, "--vocab", "1000", "--trace", trace, "--time-scale", "0.001",
                     "--no-progress"]) == 0
        assert "open loop at the recorded arrival times" in capsys.readouterr().out
        assert main(["load", "--url", stub.url, *QUICK, "--sessions", "4", "--think-time", "tool,cap:0"]) == 0
        assert "4 sessions at once" in capsys.readouterr().out
