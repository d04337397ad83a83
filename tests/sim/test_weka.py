"""WEKA trace loader (`penelope.sim.workloads.weka`): the real Claude Code traces in shared/ (requests,
think times, kinds, keys and the shared prefix, context limits, sub-agents) and small traces by
hand, malformed input and bad arguments."""
import json

import numpy as np
import pytest
from trace_paths import WEKA_TRACES
from workload_helpers import CONTEXT_128K, common_prefix

from penelope.errors import UsageError
from penelope.sim.workloads.types import HUMAN, SESSION_KEY_STRIDE, TOOL, WorkloadError, session_key_base
from penelope.sim.workloads.weka import load_weka

TRACES = WEKA_TRACES


def raw_traces():
    """{file stem: parsed JSON} of the shared WEKA traces, in file order."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(TRACES.glob("*.json"))}


def parent_requests(trace):
    return [r for r in trace["requests"] if r["type"] != "subagent"]


@pytest.fixture(scope="module")
def raw():
    return raw_traces()


@pytest.fixture(scope="module")
def weka():
    return load_weka(TRACES)


def test_weka_loads_every_parent_request_and_counts_subagents(raw, weka):
    parents = sum(len(parent_requests(t)) for t in raw.values())
    nested = sum(len(r["requests"]) for t in raw.values() for r in t["requests"] if r["type"] == "subagent")
    assert len(weka.sessions) == len(raw) == 32
    # The README's count: 2,872 parent requests; the 3 sub-agents' requests are skipped by default.
    assert weka.num_requests == parents == 2872
    assert weka.summary.requests == 2872
    assert weka.summary.subagents == 3 and weka.summary.subagents_replayed == 0
    assert weka.summary.dropped == {"subagent": nested} and nested == 48
    assert weka.closed_loop and weka.block_size == 64
    for session, trace in zip(weka.sessions, raw.values(), strict=True):
        requests = parent_requests(trace)
        assert [r.input_tokens for r in session.requests] == [r["in"] for r in requests]
        assert [r.output_tokens for r in session.requests] == [r["out"] for r in requests]
        assert [r.n_blocks for r in session.requests] == [len(r["hash_ids"]) for r in requests]


def test_weka_think_times_and_kinds_follow_the_trace(raw, weka):
    derived = 0
    for session, trace in zip(weka.sessions, raw.values(), strict=True):
        requests = parent_requests(trace)
        assert session.requests[0].think_time == 0.0
        for i in range(1, len(requests)):
            recorded = requests[i].get("think_time")
            if recorded is None:
                derived += 1
                expected = requests[i]["t"] - requests[i - 1]["t"] - requests[i - 1].get("api_time", 0.0)
                assert session.requests[i].think_time == pytest.approx(max(0.0, expected))
            else:
                assert session.requests[i].think_time == recorded
        kinds = [TOOL if "tool_result" in r["input_types"] else HUMAN for r in requests]
        assert [r.kind for r in session.requests] == kinds
        assert all(r.arrival is None for r in session.requests)
    assert derived == weka.summary.think_time_derived == 1


def test_weka_keys_keep_each_sessions_prefix_structure(raw, weka):
    # Mapping ids to keys must neither merge nor split blocks inside a session.
    for session, trace in zip(weka.sessions, raw.values(), strict=True):
        requests = parent_requests(trace)
        for i in range(1, len(requests)):
            a, b = session.requests[i - 1].keys, session.requests[i].keys
            assert common_prefix(a, b) == common_prefix(requests[i - 1]["hash_ids"], requests[i]["hash_ids"])


def test_weka_shared_prefix_is_one_id_space_across_sessions(raw, weka):
    prefix_blocks = {}
    for index, (session, (name, trace)) in enumerate(zip(weka.sessions, raw.items(), strict=True)):
        blocks = (trace["tool_tokens"] + trace["system_tokens"]) // 64
        first = parent_requests(trace)[0]["hash_ids"][:blocks]
        # Block k of the session's prefix -> shared key k, wherever its id occurs.
        prefix_ids = {h: k for k, h in reversed(list(enumerate(first)))}
        prefix_blocks[name] = blocks
        for request, raw_request in zip(session.requests, parent_requests(trace), strict=True):
            expected = [prefix_ids.get(h, session_key_base(index) + h) for h in raw_request["hash_ids"]]
            assert request.keys.tolist() == expected
    # First requests of two sessions share exactly their common prefix length.
    names = list(raw)
    for a, b in [(0, 1), (3, 12), (13, 31)]:
        keys_a, keys_b = weka.sessions[a].requests[0].keys, weka.sessions[b].requests[0].keys
        assert common_prefix(keys_a, keys_b) == min(prefix_blocks[names[a]], prefix_blocks[names[b]])
    # Keys outside the shared space never collide across sessions.
    private = [
        np.unique(np.concatenate([r.keys[r.keys >= SESSION_KEY_STRIDE] for r in s.requests]))
        for s in weka.sessions
    ]
    everything = np.concatenate(private)
    assert np.unique(everything).size == everything.size


def test_weka_without_shared_prefix_shares_nothing(raw):
    workload = load_weka(TRACES, shared_prefix=False)
    for index, session in enumerate(workload.sessions):
        base = session_key_base(index)
        for request in session.requests:
            assert request.keys.min(initial=base) >= base and request.keys.max(initial=base) < base + (
                1 << 31
            )
    a, b = workload.sessions[0].requests[0].keys, workload.sessions[1].requests[0].keys
    assert common_prefix(a, b) == 0
    first_raw = parent_requests(raw["trace_0008"])[0]["hash_ids"]
    assert np.array_equal(workload.sessions[0].requests[0].keys, np.asarray(first_raw) + session_key_base(0))


def test_weka_max_context_skip_keeps_the_24_sessions_that_fit(raw):
    workload = load_weka(TRACES, max_context=CONTEXT_128K, overflow="skip")
    fits = [name for name, t in raw.items() if max(r["in"] for r in parent_requests(t)) <= CONTEXT_128K]
    assert [s.id for s in workload.sessions] == fits and len(fits) == 24
    assert workload.summary.sessions_skipped == {"over_max_context": 8}
    over = sum(len(parent_requests(t)) for name, t in raw.items() if name not in fits)
    assert workload.summary.dropped["session_over_max_context"] == over
    assert workload.num_requests + over == 2872


def test_weka_max_context_truncate_cuts_before_the_first_overlong_request(raw):
    workload = load_weka(TRACES, max_context=CONTEXT_128K)
    full = load_weka(TRACES)
    assert len(workload.sessions) == 32 and workload.summary.sessions_truncated == 8
    cut = 0
    for short, whole in zip(workload.sessions, full.sessions, strict=True):
        inputs = [r.input_tokens for r in whole.requests]
        over = [i for i, n in enumerate(inputs) if n > CONTEXT_128K]
        end = over[0] if over else len(inputs)
        assert [r.source for r in short.requests] == [r.source for r in whole.requests[:end]]
        cut += len(inputs) - end
    assert workload.summary.dropped["after_max_context"] == cut > 0


def test_weka_max_context_drop_leaves_out_only_overlong_requests(raw):
    workload = load_weka(TRACES, max_context=CONTEXT_128K, overflow="drop")
    over = sum(r["in"] > CONTEXT_128K for t in raw.values() for r in parent_requests(t))
    assert workload.summary.dropped["over_max_context"] == over
    assert workload.num_requests == 2872 - over
    assert all(r.input_tokens <= CONTEXT_128K for _, _, r in workload.requests())
    assert all(s.requests[0].think_time == 0.0 for s in workload.sessions)


def test_weka_subagents_replayed_as_sessions_in_the_parents_key_range(raw):
    workload = load_weka(TRACES, subagents="replay")
    subs = [s for s in workload.sessions if s.parent is not None]
    assert [s.id for s in subs] == ["trace_0274/agent_001", "trace_0274/agent_002", "trace_0274/agent_003"]
    assert workload.summary.subagents_replayed == 3 and "subagent" not in workload.summary.dropped
    assert workload.num_requests == 2872 + 48
    index = list(raw).index("trace_0274")
    base = session_key_base(index)
    nested = [r for r in raw["trace_0274"]["requests"] if r["type"] == "subagent"]
    for session, entry in zip(subs, nested, strict=True):
        assert session.parent == "trace_0274"
        for request, raw_request in zip(session.requests, entry["requests"], strict=True):
            # Sub-agents keep the parent's id space, without the shared-prefix mapping.
            assert np.array_equal(request.keys, np.asarray(raw_request["hash_ids"]) + base)
    # Siblings share their common prompt blocks.
    assert common_prefix(subs[0].requests[0].keys, subs[1].requests[0].keys) > 100
    tails = [r.tail_key for _, _, r in workload.requests()]
    assert len(set(tails)) == len(tails)


def write_trace(path, requests, **fields):
    trace = {"id": path.stem, "block_size": 64, "tool_tokens": 100, "system_tokens": 28, "requests": requests}
    trace.update(fields)
    path.write_text(json.dumps(trace))
    return path


def weka_request(n_in, ids, t=0.0, think=0.0, kind="tool_result"):
    return {
        "t": t,
        "type": "n",
        "in": n_in,
        "out": 10,
        "hash_ids": ids,
        "input_types": [kind],
        "api_time": 1.0,
        "think_time": think,
    }


def test_weka_small_trace_keys_by_hand(tmp_path):
    # Prefix = floor(128 / 64) = 2 blocks: ids 1, 2 become shared keys 0, 1.
    path = write_trace(
        tmp_path / "a.json",
        [
            weka_request(200, [1, 2, 3], kind="text"),
            weka_request(300, [1, 2, 3, 4], t=5.0, think=3.0),
            {"t": 9.0, "type": "n", "in": 130, "out": 5, "hash_ids": [1, 2], "input_types": ["text"]},
        ],
    )
    workload = load_weka(path)
    base = session_key_base(0)
    keys = [r.keys.tolist() for r in workload.sessions[0].requests]
    assert keys == [[0, 1, base + 3], [0, 1, base + 3, base + 4], [0, 1]]
    assert [r.think_time for r in workload.sessions[0].requests] == [0.0, 3.0, 9.0 - 5.0 - 1.0]
    assert [r.kind for r in workload.sessions[0].requests] == [HUMAN, TOOL, HUMAN]
    assert workload.summary.think_time_derived == 1
    assert not workload.sessions[0].requests[0].keys.flags.writeable


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "a.json: not valid JSON"),
        (json.dumps({"block_size": 64}), "'requests' list"),
        (
            json.dumps(
                {
                    "block_size": 64,
                    "tool_tokens": 0,
                    "system_tokens": 0,
                    "requests": [weka_request(200, [1, 2, 3]), weka_request(200, [1, 2])],
                }
            ),
            "a.json requests[1]: 2 hash_ids for an input of 200 tokens",
        ),
        (
            json.dumps(
                {
                    "block_size": 64,
                    "tool_tokens": 0,
                    "system_tokens": 0,
                    "requests": [weka_request(128, [1, "x"])],
                }
            ),
            "a.json requests[0]: hash ids must be integers",
        ),
        (
            json.dumps(
                {
                    "block_size": 64,
                    "tool_tokens": 0,
                    "system_tokens": 0,
                    "requests": [weka_request(128, [1, 2.5])],
                }
            ),
            "hash ids must be integers",
        ),
        (
            json.dumps(
                {
                    "block_size": 64,
                    "tool_tokens": 0,
                    "system_tokens": 0,
                    "requests": [weka_request(64, [1 << 31])],
                }
            ),
            "hash ids must be in",
        ),
        (
            json.dumps(
                {"block_size": 64, "tool_tokens": 0, "system_tokens": 0, "requests": [weka_request(-64, [])]}
            ),
            "'in' must be at least 0",
        ),
        (
            json.dumps(
                {
                    "block_size": 64,
                    "tool_tokens": 0,
                    "system_tokens": 0,
                    "requests": [weka_request(64, [1]), dict(weka_request(64, [1]), think_time=-1)],
                }
            ),
            "a.json requests[1]: 'think_time' must be a non-negative number",
        ),
        (
            json.dumps(
                {
                    "block_size": 64,
                    "tool_tokens": 0,
                    "system_tokens": 0,
                    "requests": [
                        weka_request(64, [1]),
                        {"type": "n", "in": 64, "out": 1, "hash_ids": [1], "input_types": []},
                    ],
                }
            ),
            "no 'think_time'",
        ),
        (
            json.dumps(
                {
                    "block_size": 64,
                    "tool_tokens": 0,
                    "system_tokens": 0,
                    "requests": [weka_request(64, [1]), {"type": "subagent"}],
                }
            ),
            "requests[1]: a sub-agent needs a 'requests' list",
        ),
        (
            json.dumps({"block_size": 64, "tool_tokens": 0, "system_tokens": 0, "requests": [[1, 2]]}),
            "requests[0]: expected a JSON object",
        ),
        (
            json.dumps({"block_size": 64, "requests": [weka_request(64, [1])]}),
            "'tool_tokens' must be an integer",
        ),
        (json.dumps({"block_size": 0, "requests": []}), "'block_size' must be at least 1"),
    ],
)
def test_weka_malformed_input_names_file_and_request(tmp_path, content, message):
    path = tmp_path / "a.json"
    path.write_text(content)
    with pytest.raises(
        WorkloadError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
    ):
        load_weka(path)


def test_weka_errors_are_usage_errors_and_value_errors(tmp_path):
    path = tmp_path / "a.json"
    path.write_text("[]")
    with pytest.raises(UsageError):
        load_weka(path)
    with pytest.raises(ValueError):
        load_weka(path)


def test_weka_bad_arguments_and_paths(tmp_path):
    write_trace(tmp_path / "a.json", [weka_request(64, [1])])
    write_trace(tmp_path / "b.json", [weka_request(64, [1])], block_size=16)
    with pytest.raises(WorkloadError, match="b.json: block_size 16 differs from 64 in a.json"):
        load_weka(tmp_path)
    with pytest.raises(UsageError, match="no such trace file or folder"):
        load_weka(tmp_path / "missing.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no \\*.json trace files"):
        load_weka(tmp_path / "empty")
    with pytest.raises(UsageError, match="unknown sub-agent mode"):
        load_weka(tmp_path / "a.json", subagents="inline")
    with pytest.raises(UsageError, match="unknown overflow mode"):
        load_weka(tmp_path / "a.json", overflow="wrap")
    with pytest.raises(UsageError, match="max_context must be positive"):
        load_weka(tmp_path / "a.json", max_context=0)


def test_weka_session_whose_first_request_is_too_long_is_counted(tmp_path):
    path = write_trace(
        tmp_path / "a.json", [weka_request(640, list(range(1, 11))), weka_request(64, [1], t=1)]
    )
    workload = load_weka(path, max_context=100)
    assert workload.sessions == ()
    assert workload.summary.sessions_skipped == {"over_max_context": 1}
    assert workload.summary.dropped == {"after_max_context": 2}
    dropped = load_weka(path, max_context=100, overflow="drop")
    assert dropped.num_requests == 1 and dropped.sessions[0].requests[0].think_time == 0.0
