"""Which turns a real-server replay sends (`--from-context`, `--turns`) and priming turns
(`--prime`): the window against the workload it cuts, priming against the stand-in server."""
import dataclasses
import json

import pytest
from loadgen_stub import StubServer

from penelope.cli import main
from penelope.errors import UsageError
from penelope.loadgen.runner import LoadConfig, run_load
from penelope.loadgen.summary import summarize
from penelope.loadgen.target import probe_server
from penelope.loadgen.tokens import TokenSpace
from penelope.sim.workloads.load import load_workload
from penelope.sim.workloads.synthetic import SyntheticConfig, generate
from penelope.sim.workloads.turns import select_turns
from penelope.sim.workloads.types import ThinkTime

SMALL = SyntheticConfig(sessions=3, requests_per_session=6, requests_spread=0.0, prefix_tokens=640, max_context=8192,
                        first_prompt_median=300, tool_result_median=80, human_prompt_median=50, output_median=12,
                        summary_median=1000)


def workload(waits=1.0):
    return ThinkTime(cap=waits).apply(generate(SMALL))


def test_from_context_starts_each_session_at_its_first_long_enough_prompt():
    whole = workload()
    threshold = sorted(r.input_tokens for s in whole.sessions for r in s.requests)[len(whole.sessions) * 3]
    cut = select_turns(whole, from_context=threshold)
    kept = {s.id: s for s in cut.sessions}
    for session in whole.sessions:
        start = next((i for i, r in enumerate(session.requests) if r.input_tokens >= threshold), None)
        if start is None:
            assert session.id not in kept
            continue
        got = kept[session.id].requests
        assert len(got) == len(session.requests) - start
        assert got[0].think_time == 0.0 and got[0].input_tokens >= threshold
        assert got[0].keys is session.requests[start].keys
        assert [r.think_time for r in got[1:]] == [r.think_time for r in session.requests[start + 1:]]
        assert all(r.input_tokens < threshold for r in session.requests[:start])
    assert cut.num_requests < whole.num_requests


def test_turns_keeps_the_first_n_of_the_window():
    whole = workload()
    assert select_turns(whole) is whole
    cut = select_turns(whole, turns=2)
    assert [len(s.requests) for s in cut.sessions] == [2] * len(whole.sessions)
    threshold = min(s.requests[1].input_tokens for s in whole.sessions)
    both = select_turns(whole, from_context=threshold, turns=3)
    assert all(1 <= len(s.requests) <= 3 and s.requests[0].input_tokens >= threshold for s in both.sessions)


def test_a_threshold_no_session_reaches_is_one_line():
    whole = workload()
    longest = max(r.input_tokens for s in whole.sessions for r in s.requests)
    with pytest.raises(UsageError, match=f"no session reaches it .the longest prompt has {longest:,} tokens"):
        select_turns(whole, from_context=longest + 1)
    with pytest.raises(UsageError, match="`turns` must be at least 1"):
        select_turns(whole, turns=0)


@pytest.mark.parametrize("argv, message", [
    (["--from-context", "lots"], "--from-context: cannot read 'lots'"),
    (["--from-context", "0"], "--from-context must be positive"),
    (["--turns", "0"], "--turns must be at least 1"),
    (["--from-context", "1M"], "no session reaches it"),
])
def test_load_refuses_bad_windows_in_one_line(argv, message, capsys):
    with StubServer() as stub:
        assert main(["load", "--url", stub.url, "--vocab", "1000", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "Traceback" not in err and len(err.splitlines()) == 1


def replay(stub, work, **config):
    target = probe_server(stub.url, "generate", vocab=1000)
    return run_load(target, work, TokenSpace(vocab=1000, seed=5), LoadConfig(**config))[0]


def test_priming_turns_are_served_carried_on_and_left_out_of_the_figures():
    work = workload(waits=0.0)
    with StubServer() as stub:
        # One session's first turn is slow: the others' second turns must wait for it.
        stub.slow_delay = 0.02
        stub.modes = {f"{work.sessions[0].id}#0/0": "slow"}
        primed = replay(stub, work, sessions=3, prime=True)
    assert len(primed.records) == work.num_requests and all(r.ok for r in primed.records)
    first = [r for r in primed.records if r.turn == 0]
    assert len(first) == 3 and not any(r.measured for r in first)
    assert all(r.measured for r in primed.records if r.turn > 0)
    # Every session at once: no second turn goes before every first turn has ended.
    first_done = max(r.sent_at + r.e2e for r in first)
    assert min(r.sent_at for r in primed.records if r.turn == 1) >= first_done
    summary = summarize(primed)
    assert summary.finished == work.num_requests
    measured = [r for r in primed.records if r.turn > 0]
    assert summary.ttft_mean == pytest.approx(sum(r.ttft for r in measured) / len(measured))
    assert summary.cached_fraction == pytest.approx(sum(r.cached_tokens for r in measured)
                                                    / sum(r.prompt_tokens for r in measured))
    # The prompts are the ones an unprimed run sends: the first turns' replies carried on.
    with StubServer() as stub:
        plain = replay(stub, work, sessions=3)
    assert sorted((r.rid, r.prompt_tokens) for r in plain.records) == \
        sorted((r.rid, r.prompt_tokens) for r in primed.records)
    assert all(r.measured for r in plain.records)
    assert summarize(plain).ttft_mean != summary.ttft_mean


def test_a_session_that_fails_its_first_turn_does_not_hold_the_others():
    work = workload(waits=0.0)
    with StubServer() as stub:
        stub.modes = {f"{work.sessions[0].id}#0/0": "http500"}
        result = replay(stub, work, sessions=3, prime=True)
    failed = [r for r in result.records if not r.ok]
    assert len(failed) == 1 and failed[0].turn == 0
    assert len(result.records) == work.num_requests - (len(work.sessions[0].requests) - 1)


def test_more_sessions_than_run_at_once_prime_without_waiting():
    work = dataclasses.replace(workload(waits=0.0))
    with StubServer() as stub:
        result = replay(stub, work, sessions=2, prime=True)
    assert all(r.ok for r in result.records) and len(result.records) == work.num_requests
    assert sum(not r.measured for r in result.records) == 3


def test_jct_and_throughput_leave_the_priming_turns_out():
    work = workload(waits=0.0)
    with StubServer() as stub:
        stub.slow_delay = 0.02
        stub.modes = {f"{work.sessions[0].id}#0/0": "slow"}
        result = replay(stub, work, sessions=3, prime=True)
    summary = summarize(result)
    by_session = {}
    for record in result.records:
        by_session.setdefault(record.session, []).append(record)
    expected = []
    for records in by_session.values():
        measured = [r for r in records if r.measured]
        expected.append(max(r.sent_at + r.e2e for r in measured) - min(r.sent_at for r in measured))
    assert summary.jct_mean == pytest.approx(sum(expected) / len(expected))
    first = min(r.sent_at for r in result.records if r.measured)
    assert summary.throughput == pytest.approx((work.num_requests - 3) / (result.wall - first))
    # The slow priming turn is not in them: every measured turn starts after it.
    assert first >= max(r.sent_at + r.e2e for r in result.records if not r.measured)


@pytest.mark.parametrize("argv, message", [
    (["--prime", "--turns", "1"], "every session has one request"),
    (["--prime", "--max-requests", "2", "--sessions", "2"], "--max-requests 2 is spent on the 2 sessions' first"),
])
def test_priming_that_leaves_nothing_to_measure_is_refused(argv, message, capsys):
    with StubServer() as stub:
        assert main(["load", "--url", stub.url, "--vocab", "1000", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_priming_an_open_loop_workload_is_refused(tmp_path, capsys):
    trace = tmp_path / "mooncake.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": 600, "output_length": 8,
                                         "hash_ids": [1, 2]}) + "\n" for i in range(4)))
    with StubServer() as stub:
        assert main(["load", "--url", stub.url, "--vocab", "1000", "--no-progress", "--trace", str(trace),
                     "--prime"]) == 2
    assert "--prime needs a closed-loop workload" in capsys.readouterr().err


def test_the_sessions_from_context_leaves_out_are_named(capsys):
    """--from-context applies before --limit-sessions: 3 sessions that reach it are replayed."""
    whole = load_workload("synthetic", None, max_context=128 * 1024, seed=0)
    longest = sorted(max(r.input_tokens for r in s.requests) for s in whole.sessions)
    threshold = longest[len(longest) // 2]
    below = sum(top < threshold for top in longest)
    with StubServer(max_input=10**7) as stub:
        assert main(["load", "--url", stub.url, "--vocab", "1000", "--no-progress", "--limit-sessions", "3",
                     "--max-context", "128K", "--turns", "2", "--scale", "16", "--think-time", "cap:0",
                     "--from-context", str(threshold)]) == 0
    printed = capsys.readouterr().out
    assert f"--from-context {threshold:,}: left out {below} sessions that never reach it" in printed
    assert "3 sessions" in printed
