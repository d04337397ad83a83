"""`run_engine` leaves no process behind: the Engine's child and whatever it started (SGLang's
scheduler and detokenizer) are stopped on a timeout or on any exception (Ctrl-C, SIGTERM)."""
from __future__ import annotations

import os
import signal
import stat
import time

import pytest

from penelope.integration.sglang import verify
from penelope.integration.sglang.engine_check import AgentTraffic, EngineSetup


@pytest.fixture
def stubborn_child(tmp_path, monkeypatch):
    """An "interpreter" that starts a grandchild and never finishes; its pid file names both."""
    pids = tmp_path / "pids"
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\nsleep 300 &\necho $$ $! > {pids}\nsleep 300\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(verify.sys, "executable", str(script))
    return pids


def wait_for(path):
    deadline = time.monotonic() + 30
    while not (path.exists() and path.read_text().strip()):
        assert time.monotonic() < deadline, "the stand-in child never started"
        time.sleep(0.05)
    return [int(pid) for pid in path.read_text().split()]


def running(pid: int) -> bool:
    """Alive and not a zombie (a killed orphan stays a zombie where nothing reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def assert_gone(pids):
    deadline = time.monotonic() + 10
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(running(pid) for pid in pids), pids


def test_a_timed_out_engine_run_leaves_no_process(stubborn_child):
    setup = EngineSetup(pool_tokens=1024)
    with pytest.raises(RuntimeError, match="timed out"):
        # The wait is timeout + 120 s: two seconds here.
        verify.run_engine("model", AgentTraffic(), setup, timeout=-118)
    assert_gone(wait_for(stubborn_child))


def test_an_interrupted_engine_run_leaves_no_process(stubborn_child):
    class Alarm(Exception):
        pass

    def ring(signum, frame):
        raise Alarm

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, 2.0)
    try:
        with pytest.raises(Alarm):
            verify.run_engine("model", AgentTraffic(), EngineSetup(pool_tokens=1024), timeout=600)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert_gone(wait_for(stubborn_child))


@pytest.mark.parametrize(("evicted", "demoted", "passed"), [(0, 0, False), (64, 0, True), (0, 64, True)])
def test_a_small_pool_that_never_evicted_does_not_pass(monkeypatch, evicted, demoted, passed):
    """The rule on top of the engine runs (which are canned here; the real runs are in
    test_sglang_engine.py): without an eviction or a demotion the check tested nothing."""
    requests = [{"rid": "s0-t0", "output_ids": [5, 6], "finish": "length", "input_logprobs": [-1.0],
                 "output_logprobs": [-2.0, -3.0]},
                {"rid": "probe0", "output_ids": [1], "finish": "length", "input_logprobs": [], "output_logprobs": []},
                {"rid": "probe1", "output_ids": [2], "finish": "length", "input_logprobs": [], "output_logprobs": []}]

    def fake_run(model, traffic, setup, env=None, timeout=900):
        small = setup.pool_tokens == 1024
        counters = {"prefill_tokens": 10, "prefill_positions": 10, "evicted_tokens": evicted if small else 0,
                    "tier_demoted_tokens": demoted if small else 0}
        return {"requests": requests, "counters": counters, "start_s": 0.0, "serve_s": 0.0}

    monkeypatch.setattr(verify, "run_engine", fake_run)
    spec = verify.EngineCheck(AgentTraffic(sessions=1, turns=1), EngineSetup(pool_tokens=1024), with_default=False)
    report = verify.check("no-model", spec)
    assert report["comparison"]["identical_tokens"] and report["evicted_tokens"] == evicted + demoted
    assert report["passed"] is passed


def test_a_failed_engine_is_one_line_and_its_output_is_kept(tmp_path, monkeypatch):
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\necho 'loading'\necho 'Traceback (most recent call last):' >&2\n"
                      "echo '  File \"x.py\", line 1' >&2\necho 'ValueError: invalid attention backend nope' >&2\n"
                      "echo '[2026] scheduler exited' >&2\nexit 1\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(verify.sys, "executable", str(script))
    with pytest.raises(RuntimeError) as error:
        verify.run_engine("model", AgentTraffic(), EngineSetup(pool_tokens=1024), timeout=60)
    message = str(error.value)
    assert "\n" not in message
    assert "failed (exit 1): ValueError: invalid attention backend nope; its whole output: " in message
    log = message.rpartition("its whole output: ")[2]
    assert "scheduler exited" in open(log).read()
    os.unlink(log)


def test_failure_line_picks_the_last_exception():
    assert verify.failure_line("a\nKeyError: 'x'\nb\nRuntimeError: boom\nbye\n") == "RuntimeError: boom"
    assert verify.failure_line("just text\nlast\n") == "last"
    assert verify.failure_line("") == "no output"
