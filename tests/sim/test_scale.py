"""`simulate --scale` and `--prime`: the scaled workload is the load generator's prompts (lengths
and sharing, against `SessionPrompts` itself and against the table's recorded prompt tokens), and
priming turns run but are left out of the figures, behind the same barrier as the load generator's."""
import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest
from sim_env import simple_time_model
from trace_paths import WEKA_TRACES

from penelope.cache.manager import KVCache
from penelope.cli import main
from penelope.commands.workload_options import load_from_args
from penelope.costmodel.recompute import CostModel
from penelope.costmodel.shapes import get_model
from penelope.errors import UsageError
from penelope.loadgen.tokens import MAX_VOCAB, SessionPrompts, TokenSpace
from penelope.sim.metrics import summarize
from penelope.sim.replay import Replay
from penelope.sim.workloads.scale import scale_workload
from penelope.sim.workloads.synthetic import SyntheticConfig, generate
from penelope.sim.workloads.types import common_prefix
from penelope.sim.workloads.weka import load_weka

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "docs" / "ab-table" / "ab.json"
COST = CostModel(get_model("qwen3-8b"))


def load_generator_prompts(workload, scale):
    """Every prompt the load generator sends for `workload` at `scale`, replies of the length asked
    (the server stops there), ids from the largest vocabulary (no two streams equal by chance)."""
    space = TokenSpace(vocab=MAX_VOCAB, seed=5, scale=scale)
    prompts = []
    for index, session in enumerate(workload.sessions):
        builder = SessionPrompts(space, workload.block_size, index, session, reuse_replies=workload.closed_loop)
        turns = []
        for turn, request in enumerate(session.requests):
            turns.append(list(builder.next_prompt()))
            builder.add_reply(space.stand_in_reply(index, turn, space.count(request.output_tokens)))
        prompts.append(turns)
    return prompts


def assert_same_prompts(workload, scale):
    scaled = scale_workload(workload, scale)
    sent = load_generator_prompts(workload, scale)
    space = TokenSpace(vocab=2, scale=scale)
    assert scaled.block_size == 1
    for session, original, prompts in zip(scaled.sessions, workload.sessions, sent, strict=True):
        for request, before, ids in zip(session.requests, original.requests, prompts, strict=True):
            assert request.input_tokens == len(ids) == request.keys.size
            assert request.output_tokens == space.count(before.output_tokens)
            np.testing.assert_array_equal(scaled.tokens(request), request.keys)
        # What a turn shares with the one before is what the load generator's prompts share.
        for i in range(1, len(prompts)):
            ours = common_prefix(session.requests[i - 1].keys, session.requests[i].keys)
            theirs = common_prefix(np.array(prompts[i - 1]), np.array(prompts[i]))
            assert ours == theirs, (session.id, i)
    # And across sessions: the first prompts share the tools+system prefix, no more.
    firsts = [s.requests[0].keys for s in scaled.sessions]
    for a in range(len(firsts)):
        for b in range(a + 1, len(firsts)):
            assert common_prefix(firsts[a], firsts[b]) == common_prefix(np.array(sent[a][0]), np.array(sent[b][0]))
    return scaled


@pytest.mark.parametrize("scale", [1, 7, 16.5])
def test_weka_prompts_are_the_load_generators_token_for_token(scale):
    workload = load_weka([WEKA_TRACES / "trace_0008.json", WEKA_TRACES / "trace_0011.json"])
    workload = workload.__class__(sessions=tuple(s.__class__(s.id, s.requests[:12]) for s in workload.sessions),
                                  block_size=workload.block_size, closed_loop=True, summary=workload.summary)
    scaled = assert_same_prompts(workload, scale)
    # Counts are divided: a 64-token block becomes round(64 / S) tokens of each key.
    first = scaled.sessions[0].requests[0]
    assert first.input_tokens == max(1, round(workload.sessions[0].requests[0].input_tokens / scale))


def test_synthetic_prompts_with_compactions_are_the_load_generators():
    workload = generate(SyntheticConfig(sessions=3, requests_per_session=30, seed=2))
    assert_same_prompts(workload, 8)


def test_the_tables_workload_has_the_prompt_tokens_the_servers_got():
    """docs/ab-table: every run sent 524,931 prompt tokens in 32 requests (ab.json's runs); the
    simulator's scaled workload, loaded as penelope ab loaded it, holds exactly those."""
    ab = json.loads(TABLE.read_text())
    work = ab["workload"]
    args = argparse.Namespace(format="weka", max_context=str(work["max_context"]), seed=0, limit_sessions=None,
                              think_time="scale:0.05,cap:1", from_context=str(work["from_context"]),
                              turns=work["turns"], no_shared_prefix=False, subagents="skip", overflow="truncate")
    sources = [str(WEKA_TRACES / Path(s).name) for s in work["loader"]["sources"]]
    workload, _ = load_from_args(args, sources)
    scaled = scale_workload(workload, work["scale"])
    sent = {run["prompt_tokens"] for run in ab["runs"]}
    assert sent == {524_931}
    assert sum(r.input_tokens for _, _, r in scaled.requests()) == 524_931
    assert scaled.num_requests == work["requests"] == 32


@pytest.mark.parametrize("scale", [0, -1, 0.5, math.nan, math.inf, True])
def test_a_bad_scale_is_refused(scale):
    workload = generate(SyntheticConfig(sessions=1, requests_per_session=2))
    with pytest.raises(UsageError, match="`scale` must be a number of at least 1"):
        scale_workload(workload, scale)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_a_bad_scale_on_the_command_line_is_one_line(value, capsys):
    code = main(["simulate", "--no-progress", "--scale", value, "--limit-sessions", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--scale must be a number of at least 1" in err and len(err.splitlines()) == 1


def primed_replay(sessions: int, at_once: int, prime: bool):
    workload = generate(SyntheticConfig(sessions=sessions, requests_per_session=4, seed=1))
    workload = scale_workload(workload, 16)
    cache = KVCache(1 << 20, 16, "penelope", cost_model=COST)
    return workload, Replay(workload, cache, simple_time_model(), COST, sessions=at_once, prime=prime).run()


def test_priming_turns_run_but_are_left_out_of_every_figure():
    workload, result = primed_replay(3, 3, prime=True)
    records = result.records
    assert len(records) == workload.num_requests
    assert {r.index for r in records if not r.measured} == {0} and sum(not r.measured for r in records) == 3
    measured = [r for r in records if r.index > 0]
    summary = summarize(records)
    assert summary.requests == len(measured) == workload.num_requests - 3
    assert summary.ttft_mean == pytest.approx(np.mean([r.ttft for r in measured]))
    assert summary.input_tokens == sum(r.input_tokens for r in measured)
    assert summary.reused_tokens == sum(r.reused_tokens for r in measured)
    # JCT from each session's first measured send to its last reply.
    jcts = [max(r.finish_time for r in measured if r.session == s.id)
            - min(r.send_time for r in measured if r.session == s.id) for s in workload.sessions]
    assert summary.jct_mean == pytest.approx(np.mean(jcts))
    # The first turns start cold: without --prime they are in the figures.
    _, plain = primed_replay(3, 3, prime=False)
    assert summarize(plain.records).requests == workload.num_requests


def test_with_every_session_at_once_no_second_turn_goes_before_every_first_has_ended():
    workload, result = primed_replay(3, 3, prime=True)
    barrier = max(r.finish_time for r in result.records if r.index == 0)
    for session in workload.sessions:
        second = next(r for r in result.records if r.session == session.id and r.index == 1)
        assert second.send_time == pytest.approx(barrier + session.requests[1].think_time)
    # More sessions than run at once: no barrier (as the load generator), first turns still left out.
    _, queued = primed_replay(3, 2, prime=True)
    firsts = {r.session: r.finish_time for r in queued.records if r.index == 0}
    seconds = {r.session: r.send_time for r in queued.records if r.index == 1}
    assert min(seconds.values()) < max(firsts.values())
    assert sum(not r.measured for r in queued.records) == 3


def test_simulate_prime_and_scale_through_the_command(tmp_path, capsys):
    out = tmp_path / "sim.json"
    argv = ["simulate", "--no-progress", "--trace", str(WEKA_TRACES / "trace_0008.json"), "--turns", "6",
            "--scale", "8", "--prime", "--sessions", "1", "--json", str(out)]
    assert main(argv) == 0
    payload = json.loads(out.read_text())
    assert payload["config"]["workload"]["scale"] == 8 and payload["config"]["workload"]["prime"] is True
    assert {r["requests"] for r in payload["results"].values()} == {5}
    assert "token counts / 8" in capsys.readouterr().out


def test_a_scaled_replay_caches_in_the_servers_pages(tmp_path):
    """A scaled replay names every token: its cache keeps --page-size pages, so each turn reuses
    the previous prompt and reply (64-token blocks of single-token keys would cache nothing)."""
    out = tmp_path / "sim.json"
    argv = ["simulate", "--no-progress", "--trace", str(WEKA_TRACES / "trace_0008.json"), "--turns", "4",
            "--scale", "64", "--page-size", "16", "--chunk-size", "1024", "--sessions", "1", "--policies", "sglang",
            "--json", str(out)]
    assert main(argv) == 0
    payload = json.loads(out.read_text())
    assert payload["config"]["block_size"] == 16
    [result] = payload["results"].values()
    assert result["hit_rate"] > 0.3, result


def test_replies_are_named_where_the_load_generators_next_prompt_holds_them():
    workload = generate(SyntheticConfig(sessions=3, requests_per_session=12, seed=2))
    scale = 8
    scaled = scale_workload(workload, scale)
    space = TokenSpace(vocab=MAX_VOCAB, seed=5, scale=scale)
    sent = load_generator_prompts(workload, scale)
    held = 0
    for index, (session, prompts) in enumerate(zip(scaled.sessions, sent, strict=True)):
        for turn, request in enumerate(session.requests):
            reply = scaled.reply_tokens(request)
            assert reply is not None and len(reply) == request.output_tokens
            if turn + 1 == len(session.requests):
                continue
            # The load generator's next prompt holds this reply right after this prompt exactly
            # where the scaled next prompt holds the named reply tokens.
            theirs = space.stand_in_reply(index, turn, request.output_tokens)
            n, end = request.input_tokens, request.input_tokens + request.output_tokens
            following = session.requests[turn + 1].keys
            theirs_held = list(prompts[turn + 1][n:end]) == list(theirs)
            ours_held = np.array_equal(following[n:end], reply)
            assert theirs_held == ours_held, (session.id, turn)
            held += ours_held
    assert held >= 20


def test_the_next_turn_reuses_the_cached_reply():
    workload = scale_workload(generate(SyntheticConfig(sessions=2, requests_per_session=6, seed=1)), 16)
    cache = KVCache(1 << 20, 1, "penelope", cost_model=COST)
    records = Replay(workload, cache, simple_time_model(), COST, sessions=2).run().records
    by_turn = {(r.session, r.index): r for r in records}
    extended = 0
    for session in workload.sessions:
        for turn in range(1, len(session.requests)):
            before, request = session.requests[turn - 1], session.requests[turn]
            history = before.input_tokens + before.output_tokens
            if request.input_tokens > history and np.array_equal(
                    request.keys[:history], np.concatenate([before.keys, workload.reply_tokens(before)])):
                # Prompt and reply cached but the reply's last token, whose KV no step computed.
                assert by_turn[(session.id, turn)].reused_tokens == history - 1
                extended += 1
    assert extended >= 4
