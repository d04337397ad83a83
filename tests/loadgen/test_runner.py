"""Replays against a stand-in server (`tests/loadgen_stub.py`): what the server is sent, turn by
turn; think times, bounds, open loop, sessions closed, the cache flushed between runs."""
import dataclasses
import json
import time

import numpy as np
import pytest
from loadgen_stub import StubServer

from penelope.errors import UsageError
from penelope.loadgen.apis import GENERATE, OPENAI
from penelope.loadgen.client import Sampling
from penelope.loadgen.runner import DONE, DURATION, MAX_REQUESTS, LoadConfig, check_fits, run_load
from penelope.loadgen.summary import summarize
from penelope.loadgen.target import Target, probe_server
from penelope.loadgen.tokens import TokenSpace
from penelope.sim.workloads.load import parse_think_time
from penelope.sim.workloads.mooncake import load_mooncake
from penelope.sim.workloads.synthetic import SyntheticConfig, generate
from penelope.sim.workloads.types import (
    HUMAN,
    TOOL,
    Request,
    Session,
    ThinkTime,
    Workload,
    WorkloadSummary,
    frozen_keys,
)

SMALL = SyntheticConfig(sessions=3, requests_per_session=4, requests_spread=0.0, prefix_tokens=640, max_context=8192,
                        first_prompt_median=300, tool_result_median=80, human_prompt_median=50, output_median=12,
                        summary_median=1000)


def small_workload(**changes) -> Workload:
    return ThinkTime(cap=0.0).apply(generate(dataclasses.replace(SMALL, **changes)))


def run(stub, workload, api=GENERATE, repeats=1, scale=1.0, **config):
    target = probe_server(stub.url, api, vocab=1000)
    space = TokenSpace(vocab=1000, seed=5, scale=scale)
    check_fits(workload, space, target)
    return run_load(target, workload, space, LoadConfig(**config), repeats=repeats)


def sent_by_session(stub):
    """{session id: [request JSON by turn]} of the requests the stub got (the probe left out)."""
    sessions = {}
    for body in stub.requests:
        if body.get("session_id"):
            sessions.setdefault(body["session_id"], []).append(body)
    return {sid: sorted(bodies, key=lambda b: int(b["rid"].rsplit("/", 1)[1])) for sid, bodies in sessions.items()}


@pytest.mark.parametrize("config, message", [
    (dict(sessions=0), "`sessions` must be at least 1, got 0"),
    (dict(max_requests=0), "`max_requests` must be at least 1, got 0"),
    (dict(duration=0.0), "`duration` must be a positive number of seconds, got 0.0"),
    (dict(read_timeout=float("inf")), "`read_timeout` must be a positive number of seconds, got inf"),
    (dict(sampling=Sampling(temperature=-1.0)), "`temperature` must be a non-negative number, got -1.0"),
])
def test_a_bad_config_names_the_field(config, message):
    """The library names its own fields (`penelope load` shows them as --sessions, --max-requests...)."""
    with pytest.raises(UsageError) as err:
        LoadConfig(**config)
    assert str(err.value) == message


def test_a_request_too_long_for_the_server_names_the_fields_that_shorten_it():
    target = Target(url="http://127.0.0.1:9", api=GENERATE, vocab=1000, max_prompt=100)
    workload, space = small_workload(), TokenSpace(vocab=1000, scale=2)
    with pytest.raises(UsageError) as err:
        check_fits(workload, space, target)
    assert str(err.value).endswith("(prompts up to 100, at `scale` 2); scale the workload down (`scale`), or leave "
                                   "the longest requests out (`max_context`, `turns`)")
    with pytest.raises(UsageError, match="^`repeats` must be at least 1, got 0$"):
        run_load(target, workload, space, LoadConfig(), repeats=0)


@pytest.mark.parametrize("api", [GENERATE, OPENAI])
def test_each_turn_carries_the_previous_prompt_and_the_servers_reply(api):
    key, limit = ("input_ids", "max_new_tokens") if api == GENERATE else ("prompt", "max_tokens")
    with StubServer() as stub:
        [result] = run(stub, small_workload(), api=api, sessions=2)
        sent = sent_by_session(stub)
    assert all(r.ok for r in result.records) and len(result.records) == 12 and result.stopped == DONE
    assert len(sent) == 3
    for bodies in sent.values():
        assert len(bodies) == 4
        for before, after in zip(bodies, bodies[1:], strict=False):
            prompt = before[key]
            count = before.get("sampling_params", before)[limit]
            history = prompt + stub.reply(prompt, count)
            assert after[key][: len(history)] == history
    by_rid = {r.rid: r for r in result.records}
    for sid, bodies in sent.items():
        for turn in range(1, 4):
            # The stub reports what a never-evicting radix cache would: the whole previous turn.
            previous = bodies[turn - 1]
            expected = len(previous[key]) + previous.get("sampling_params", previous)[limit]
            assert by_rid[f"{sid}/{turn}"].cached_tokens == expected
    assert all(r.overhead > 0 for r in result.records)


def test_both_apis_and_every_run_send_the_same_prompts():
    """Greedy replies equal, prompts equal: what lets two servers be compared request by request."""
    prompts = {}
    for api in (GENERATE, OPENAI):
        with StubServer() as stub:
            run(stub, small_workload(), api=api, repeats=2)
            key = "input_ids" if api == GENERATE else "prompt"
            assert stub.flushes == 2
            prompts[api] = {b["rid"]: b[key] for bodies in sent_by_session(stub).values() for b in bodies}
    assert prompts[GENERATE] == prompts[OPENAI] and len(prompts[GENERATE]) == 24
    first_run = {rid.replace("#0/", "/"): p for rid, p in prompts[GENERATE].items() if "#0/" in rid}
    second_run = {rid.replace("#1/", "/"): p for rid, p in prompts[GENERATE].items() if "#1/" in rid}
    assert first_run == second_run


def test_a_failed_request_ends_its_session_and_is_counted():
    with StubServer() as stub:
        stub.modes["synthetic-001#0/1"] = "http500"
        [result] = run(stub, small_workload(), sessions=3)
    failed = [r for r in result.records if r.failed]
    assert [(r.rid, r.status, r.http_status) for r in failed] == [("synthetic-001#0/1", "http_error", 500)]
    assert sorted(r.turn for r in result.records if r.session == "synthetic-001#0") == [0, 1]
    summary = summarize(result)
    assert summary.failures == {"http_error": 1} and summary.errors == 1
    assert summary.not_sent == 2 and summary.finished == 9 and summary.sessions_completed == 2


def test_max_requests_stops_sending():
    with StubServer() as stub:
        [result] = run(stub, small_workload(), sessions=2, max_requests=5)
    assert len(result.records) == 5 and result.stopped == MAX_REQUESTS and all(r.ok for r in result.records)


def test_duration_cuts_a_slow_server():
    """Every chunk 0.2 s late, about 12 chunks a reply: the run stops at 0.6 s, the requests in
    flight are recorded as cut and left out of the latencies."""
    with StubServer() as stub:
        stub.mode, stub.slow_delay = "slow", 0.2
        began = time.perf_counter()
        [result] = run(stub, small_workload(), sessions=3, duration=0.6)
        took = time.perf_counter() - began
    assert result.stopped == DURATION and 0.6 <= result.wall < 2.0 and took < 5.0
    assert len(result.records) == 3 and {r.status for r in result.records} == {"cut"}
    assert all(r.ttft is not None for r in result.records)
    summary = summarize(result)
    assert summary.cut == 3 and summary.finished == 0 and np.isnan(summary.ttft_mean)


def test_finished_sessions_are_closed_on_a_session_cache():
    with StubServer(session_cache=True) as stub:
        run(stub, small_workload())
        assert sorted(stub.closed) == ["synthetic-000#0", "synthetic-001#0", "synthetic-002#0"]
    with StubServer() as stub:
        run(stub, small_workload())
        assert stub.closed == []


def test_hints_say_what_the_session_waits_for():
    with StubServer() as stub:
        [result] = run(stub, small_workload(sessions=1), hints=True)
        bodies = sent_by_session(stub)["synthetic-000#0"]
    kinds = [r.kind for r in sorted(result.records, key=lambda r: r.turn)]
    hints = [b["sampling_params"].get("custom_params", {}).get("penelope_waits_for") for b in bodies]
    assert hints == kinds[1:] + [None]


def _waits_workload():
    """One session: a human prompt, a tool turn 0.3 s after, a human turn 0.6 s after that."""
    def request(i, kind, wait):
        return Request(keys=frozen_keys(list(range(i + 1)), "t"), input_tokens=64 * (i + 1), output_tokens=4,
                       think_time=wait, arrival=None, kind=kind, tail_key=10**12 + i, source=f"r{i}")

    session = Session("s", (request(0, HUMAN, 0.0), request(1, TOOL, 0.3), request(2, HUMAN, 0.6)))
    return Workload((session,), 64, True, WorkloadSummary("test"))


@pytest.mark.parametrize(("mode", "waits"), [
    ("recorded", [0.3, 0.6]),
    ("tool", [0.3, 0.3]),
    ("scale:0.5", [0.15, 0.3]),
    ("cap:0.1", [0.1, 0.1]),
])
def test_think_time_modes_as_in_simulate(mode, waits):
    """`--think-time` is parsed and applied as `penelope simulate` does; the client waits that
    long after each reply before the next request."""
    workload = parse_think_time(mode).apply(_waits_workload())
    with StubServer() as stub:
        [result] = run(stub, workload)
    records = sorted(result.records, key=lambda r: r.turn)
    for before, after, wait in zip(records[:-1], records[1:], waits, strict=True):
        gap = after.sent_at - (before.sent_at + before.e2e)
        assert after.think_time == pytest.approx(wait)
        assert wait <= gap < wait + 0.25


def test_open_loop_sends_at_the_recorded_times(tmp_path):
    """Mooncake JSONL at 0, 0.4 and 0.8 s, time-scaled by 0.5: sent at 0, 0.2, 0.4 s whatever the
    replies; equal hash ids are equal prompt ids."""
    from penelope.sim.workloads.time_scale import scale_time

    rows = [{"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2]},
            {"timestamp": 400, "input_length": 1024, "output_length": 8, "hash_ids": [1, 3]},
            {"timestamp": 800, "input_length": 1536, "output_length": 8, "hash_ids": [1, 2, 4]}]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    workload = scale_time(load_mooncake(path), 0.5)
    with StubServer() as stub:
        stub.mode, stub.slow_delay = "slow", 0.2
        [result] = run(stub, workload, scale=4.0)
        prompts = [b["input_ids"] for b in stub.requests[1:]]
    records = sorted(result.records, key=lambda r: r.scheduled_at)
    assert [r.scheduled_at for r in records] == pytest.approx([0.0, 0.2, 0.4])
    for r in records:
        assert r.scheduled_at <= r.sent_at < r.scheduled_at + 0.1
    # Replies take 0.4 s or more (2 chunks of 0.2 s), twice the 0.2 s between sends, while each send
    # is under 0.1 s late: the requests overlapped (a reply as long as the spacing left a loaded
    # machine no margin).
    assert records[0].sent_at + records[0].e2e > records[1].sent_at
    # Blocks of 512 tokens, scaled by 4: 128 ids a block.
    assert prompts[0][:128] == prompts[1][:128] == prompts[2][:128] and prompts[0][128:256] != prompts[1][128:256]
    assert prompts[2][:256] == prompts[0][:256]
