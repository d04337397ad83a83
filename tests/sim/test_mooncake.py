"""Mooncake JSONL loader (`penelope.sim.workloads.mooncake`): open-loop sessions and keys, arrival order,
overlong requests, malformed lines and empty or missing files."""
import numpy as np
import pytest
from workload_helpers import write_jsonl

from penelope.errors import UsageError
from penelope.sim.workloads.mooncake import load_mooncake
from penelope.sim.workloads.types import WorkloadError


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
