"""Conversations of a Mooncake-format trace recovered from its prefixes, and the session router
keeping each on one replica."""

import json

import pytest

from penelope.cli import main
from penelope.costmodel.recompute import CostModel
from penelope.costmodel.shapes import get_model
from penelope.errors import UsageError
from penelope.sim.run import SimConfig, run_policy
from penelope.sim.timemodel import TimeModel
from penelope.sim.workloads.conversations import apply, by_prefix
from penelope.sim.workloads.mooncake import load_mooncake
from penelope.sim.workloads.mooncake_like import MooncakeLikeConfig, write_jsonl

B = 512


def trace(tmp_path, rows):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return load_mooncake(path)


def row(ms, ids, tokens):
    return {"timestamp": ms, "input_length": tokens, "output_length": 10, "hash_ids": ids}


def test_a_turn_continues_the_conversation_whose_whole_blocks_it_starts_with(tmp_path):
    work = trace(tmp_path, [
        row(0, [0, 1, 2, 3], 3 * B + 100),       # whole blocks 0, 1, 2
        row(1000, [0, 9], B + 5),                # shares only block 0: a new conversation
        row(2000, [0, 1, 2, 4, 5], 4 * B + 7),   # starts with the first's whole blocks
        row(3000, [0, 1, 2, 4, 6], 4 * B + 9),   # the third's whole blocks are 0, 1, 2, 4
        row(4000, [0, 1, 7], 2 * B + 1),         # two blocks of the first, not all: new
    ])
    grouped = by_prefix(work)
    members = [[r.arrival for r in s.requests] for s in grouped.sessions]
    assert members == [[0.0, 2.0, 3.0], [1.0], [4.0]]
    assert grouped.summary.sessions == 3 and grouped.num_requests == 5
    assert apply(work, "none") is work


def test_conversations_need_an_open_loop_trace_without_sessions(tmp_path):
    named = trace(tmp_path, [dict(row(0, [0, 1], 2 * B), session_id="a"), dict(row(5, [0, 1, 2], 3 * B),
                                                                              session_id="a")])
    with pytest.raises(UsageError, match="names its sessions already"):
        by_prefix(named)
    with pytest.raises(UsageError, match="unknown `conversations` mode 'turns'"):
        apply(named, "turns")


def test_the_session_router_keeps_a_conversation_on_one_replica(tmp_path):
    path = tmp_path / "like.jsonl"
    write_jsonl(path, MooncakeLikeConfig(duration=200.0, rate=2.0, seed=4))
    out = tmp_path / "out.json"
    assert main(["simulate", "--trace", str(path), "--gpu-cache", "128K", "--replicas", "4", "--router", "session",
                 "--conversations", "prefix", "--policies", "sglang", "--no-progress", "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    workload = payload["config"]["workload"]
    assert workload["conversations"] == "prefix" and workload["sessions"] < workload["requests"]
    assert payload["results"]["sglang"]["sessions"] == workload["sessions"]
    # Every request of a conversation went to one replica; least-load alone would spread them.
    work = by_prefix(load_mooncake(path))
    model = TimeModel.estimate("qwen3-8b")
    for router, spread in (("session", False), ("least-load", True)):
        config = SimConfig(gpu_cache=128 * 1024, replicas=4, router=router)
        records = run_policy(work, "sglang", config, model, CostModel(get_model("qwen3-8b"))).replay.records
        replicas = {}
        for record in records:
            replicas.setdefault(record.session, set()).add(record.replica)
        assert any(len(r) > 1 for r in replicas.values()) is spread
