"""Workload loaders: WEKA traces (the real files in shared/), Mooncake JSONL, tokens, think times."""

import json

import numpy as np
import pytest
from trace_paths import WEKA_TRACES

from penelope.errors import UsageError
from penelope.sim.mooncake import load_mooncake
from penelope.sim.weka import load_weka
from penelope.sim.workloads import (
    HUMAN,
    SESSION_KEY_STRIDE,
    TOOL,
    Request,
    Session,
    ThinkTime,
    Workload,
    WorkloadError,
    WorkloadSummary,
    load_workload,
    request_tokens,
    session_key_base,
    workload_stats,
)

TRACES = WEKA_TRACES
CONTEXT_128K = 128 * 1024


def raw_traces():
    """{file stem: parsed JSON} of the shared WEKA traces, in file order."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(TRACES.glob("*.json"))}


def parent_requests(trace):
    return [r for r in trace["requests"] if r["type"] != "subagent"]


def common_prefix(a, b):
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


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


def test_request_tokens_expand_keys_and_keep_tails_unique(weka):
    session = weka.sessions[0]
    a, b = session.requests[3], session.requests[4]
    tokens_a, tokens_b = request_tokens(a, 64), weka.tokens(b)
    assert tokens_a.dtype == np.int64 and tokens_a.shape == (a.input_tokens,)
    full = a.n_blocks * 64
    expected = (a.keys[:, None] * 64 + np.arange(64)).reshape(-1)
    assert np.array_equal(tokens_a[:full], expected)
    assert np.array_equal(tokens_a[full:], a.tail_key * 64 + np.arange(a.input_tokens - full))
    shared_blocks = common_prefix(a.keys, b.keys)
    assert common_prefix(tokens_a, tokens_b) == shared_blocks * 64
    # Tail tokens never occur among another request's tokens.
    others = np.concatenate([weka.tokens(r) for r in session.requests[:10] if r is not a])
    assert not np.isin(tokens_a[full:], others).any()


def test_request_tokens_partial_last_key():
    request = Request(
        keys=np.array([7, 9], dtype=np.int64),
        input_tokens=5,
        output_tokens=1,
        think_time=0.0,
        arrival=0.0,
        kind=HUMAN,
        tail_key=100,
        source="t",
    )
    assert request_tokens(request, 4).tolist() == [28, 29, 30, 31, 36]
    no_keys = Request(
        keys=np.zeros(0, dtype=np.int64),
        input_tokens=3,
        output_tokens=1,
        think_time=0.0,
        arrival=None,
        kind=TOOL,
        tail_key=5,
        source="t",
    )
    assert request_tokens(no_keys, 4).tolist() == [20, 21, 22]


def test_weka_stats_match_the_readme_facts(weka):
    stats = workload_stats(weka)
    # README: previous request's ids a full prefix of the next in 91% of transitions (whole set),
    # tool waits median 8 s / p90 67 s, human waits median 131 s, inputs p50 104K (whole set).
    assert 0.85 < stats["extension_fraction"] < 0.97
    assert 0.005 < stats["compaction_fraction"] < 0.05
    assert 5 <= stats["tool_wait_p50"] <= 10
    assert 40 <= stats["tool_wait_p90"] <= 90
    assert 90 <= stats["human_wait_p50"] <= 200


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


def write_jsonl(path, rows):
    path.write_text("\n".join(row if isinstance(row, str) else json.dumps(row) for row in rows) + "\n")
    return path


def test_mooncake_open_loop_sessions_and_keys(tmp_path):
    path = write_jsonl(
        tmp_path / "m.jsonl",
        [
            {
                "timestamp": 0,
                "input_length": 1000,
                "output_length": 10,
                "hash_ids": [5, 6],
                "session_id": "a",
            },
            {"timestamp": 250, "input_length": 512, "output_length": 3, "hash_ids": [7]},
            "",
            {
                "timestamp": 3000,
                "input_length": 1100,
                "output_length": 4,
                "hash_ids": [5, 6, 8],
                "session_id": "a",
            },
            {"timestamp": 2000, "input_length": 600, "output_length": 4, "hash_ids": [5], "chat_id": 3},
        ],
    )
    workload = load_mooncake(path)
    assert not workload.closed_loop and workload.block_size == 512
    assert [s.id for s in workload.sessions] == ["session_id=a", "line2", "chat_id=3"]
    first = workload.sessions[0]
    assert [r.arrival for r in first.requests] == [0.0, 3.0]
    assert [r.keys.tolist() for r in first.requests] == [[5, 6], [5, 6, 8]]
    assert [r.source for r in first.requests] == ["m.jsonl:1", "m.jsonl:4"]
    assert all(r.think_time == 0.0 for _, _, r in workload.requests())
    # ceil(1000/512) = 2 ids: the second covers a partial block.
    tokens = workload.tokens(first.requests[0])
    assert np.array_equal(tokens, np.concatenate([5 * 512 + np.arange(512), 6 * 512 + np.arange(488)]))
    # floor(600/512) = 1 id: the rest is unique to the request.
    tail = workload.tokens(workload.sessions[2].requests[0])[512:]
    assert tail.size == 88 and tail[0] > 8 * 512
    assert workload.summary.sessions == 3 and workload.summary.requests == 4


def test_mooncake_orders_a_session_by_arrival_and_drops_overlong(tmp_path):
    path = write_jsonl(
        tmp_path / "m.jsonl",
        [
            {"timestamp": 900, "input_length": 64, "output_length": 1, "hash_ids": [2], "session_id": 1},
            {"timestamp": 100, "input_length": 64, "output_length": 1, "hash_ids": [1], "session_id": 1},
            {
                "timestamp": 500,
                "input_length": 5000,
                "output_length": 1,
                "hash_ids": list(range(10)),
                "session_id": 1,
            },
        ],
    )
    workload = load_mooncake(path, max_context=4096)
    assert [r.arrival for r in workload.sessions[0].requests] == [0.1, 0.9]
    assert workload.summary.dropped == {"over_max_context": 1}


@pytest.mark.parametrize(
    "line, message",
    [
        ("{bad", "m.jsonl:2: not valid JSON"),
        ("[1, 2]", "m.jsonl:2: expected a JSON object"),
        ('{"input_length": 64, "output_length": 1, "hash_ids": [1]}', "m.jsonl:2: 'timestamp'"),
        ('{"timestamp": -1, "input_length": 64, "output_length": 1, "hash_ids": [1]}', "'timestamp'"),
        ('{"timestamp": 1, "input_length": 0, "output_length": 1, "hash_ids": []}', "'input_length' must be"),
        (
            '{"timestamp": 1, "input_length": true, "output_length": 1, "hash_ids": [1]}',
            "'input_length' must be",
        ),
        (
            '{"timestamp": 1, "input_length": 64, "output_length": 1.5, "hash_ids": [1]}',
            "'output_length' must",
        ),
        (
            '{"timestamp": 1, "input_length": 1025, "output_length": 1, "hash_ids": [1]}',
            "m.jsonl:2: 1 hash_ids for 1025 input tokens in blocks of 512 \\(expected 2 or 3\\)",
        ),
        (
            '{"timestamp": 1, "input_length": 64, "output_length": 1, "hash_ids": "abc"}',
            "'hash_ids' must be a list",
        ),
        ('{"timestamp": 1, "input_length": 64, "output_length": 1, "hash_ids": [-1]}', "hash ids must be in"),
        (
            '{"timestamp": 1, "input_length": 64, "output_length": 1, "hash_ids": [1], "session_id": [1]}',
            "'session_id' must be a string or an integer",
        ),
    ],
)
def test_mooncake_malformed_lines_name_file_and_line(tmp_path, line, message):
    good = '{"timestamp": 0, "input_length": 64, "output_length": 1, "hash_ids": [1]}'
    path = write_jsonl(tmp_path / "m.jsonl", [good, line])
    with pytest.raises(WorkloadError, match=message):
        load_mooncake(path)


def test_mooncake_empty_or_missing_file(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("\n\n")
    with pytest.raises(WorkloadError, match="no requests"):
        load_mooncake(path)
    with pytest.raises(UsageError, match="no such trace file"):
        load_mooncake(tmp_path / "none.jsonl")


def tiny_workload():
    def request(think, kind):
        return Request(
            keys=np.zeros(0, dtype=np.int64),
            input_tokens=10,
            output_tokens=1,
            think_time=think,
            arrival=None,
            kind=kind,
            tail_key=1,
            source="t",
        )

    sessions = (
        Session("a", (request(0.0, HUMAN), request(2.0, TOOL), request(500.0, HUMAN), request(10.0, TOOL))),
        Session("b", (request(0.0, TOOL), request(4.0, TOOL), request(3000.0, HUMAN))),
    )
    return Workload(sessions=sessions, block_size=64, closed_loop=True, summary=WorkloadSummary("test"))


def test_think_time_modes_by_hand():
    workload = tiny_workload()
    waits = lambda w: [[r.think_time for r in s.requests] for s in w.sessions]  # noqa: E731
    assert ThinkTime().apply(workload) is workload
    # Tool waits after the first request: 2, 10, 4 -> median 4 replaces the human waits.
    assert waits(ThinkTime(mode="tool").apply(workload)) == [[0.0, 2.0, 4.0, 10.0], [0.0, 4.0, 4.0]]
    assert waits(ThinkTime(scale=0.5).apply(workload)) == [[0.0, 1.0, 250.0, 5.0], [0.0, 2.0, 1500.0]]
    assert waits(ThinkTime(scale=2.0, cap=100.0).apply(workload)) == [
        [0.0, 4.0, 100.0, 20.0],
        [0.0, 8.0, 100.0],
    ]
    # The original is unchanged.
    assert waits(workload) == [[0.0, 2.0, 500.0, 10.0], [0.0, 4.0, 3000.0]]
    for bad in ({"mode": "human"}, {"scale": -1.0}, {"cap": -2.0}, {"scale": float("nan")}):
        with pytest.raises(UsageError):
            ThinkTime(**bad)


def test_load_workload_dispatches_by_format(tmp_path):
    weka = load_workload("weka", TRACES / "trace_0008.json", max_context=CONTEXT_128K)
    assert weka.summary.format == "weka" and len(weka.sessions) == 1
    path = write_jsonl(
        tmp_path / "m.jsonl", [{"timestamp": 0, "input_length": 64, "output_length": 1, "hash_ids": [1]}]
    )
    assert load_workload("mooncake", path, block_size=64).num_requests == 1
    synthetic = load_workload("synthetic", seed=3, sessions=2, requests_per_session=5)
    assert len(synthetic.sessions) == 2 and synthetic.summary.sources == ["synthetic(seed=3)"]
    with pytest.raises(UsageError, match="unknown workload format"):
        load_workload("sharegpt", path)
    with pytest.raises(UsageError, match="needs a trace folder"):
        load_workload("weka")
    with pytest.raises(UsageError, match="takes no trace path"):
        load_workload("synthetic", path)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"keys": np.zeros((1, 2), dtype=np.int64)}, "1-D int64"),
        ({"keys": np.zeros(2, dtype=np.int32)}, "1-D int64"),
        ({"input_tokens": -1}, "non-negative"),
        ({"think_time": float("nan")}, "non-negative"),
        ({"kind": "robot"}, "kind must be one of"),
    ],
)
def test_request_rejects_bad_fields(fields, message):
    values = dict(
        keys=np.zeros(0, dtype=np.int64),
        input_tokens=1,
        output_tokens=1,
        think_time=0.0,
        arrival=None,
        kind=TOOL,
        tail_key=1,
        source="here",
    )
    values.update(fields)
    with pytest.raises(UsageError, match=f"here: .*{message}"):
        Request(**values)
