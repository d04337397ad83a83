"""Simulator test set-up: requests, workloads, jobs, a simple time model and the cost model of the replay tests."""

import dataclasses

import numpy as np

from penelope.costmodel.recompute import CostModel
from penelope.costmodel.shapes import get_model
from penelope.sim.scheduler import Job
from penelope.sim.timemodel import TimeModel
from penelope.sim.workloads.types import HUMAN, TOOL, Request, Session, Workload, WorkloadSummary, request_tokens


def sim_request(keys, input_tokens: int, output_tokens: int = 1, *, tail_key: int, source: str,
                output_blocks=None) -> Request:
    """A human turn whose prompt is blocks `keys` then unique tail tokens (`tail_key`) up to
    `input_tokens`, and `output_blocks` naming its reply's blocks, if given."""
    return Request(keys=np.asarray(keys, dtype=np.int64), input_tokens=input_tokens, output_tokens=output_tokens,
                   think_time=0.0, arrival=None, kind=HUMAN, tail_key=tail_key, source=source,
                   output_blocks=None if output_blocks is None else np.asarray(output_blocks, dtype=np.int64))


COST = CostModel(get_model("qwen3-8b"))  # every layer full attention: pairs(a, b) = sum of positions a..b-1


def simple_time_model(**changes) -> TimeModel:
    """Prefill: 10 ms + 1 ms per token + 1 us per attention pair. Decode: 11 ms a step (no KV read)."""
    base = TimeModel.estimate("qwen3-8b")
    values = dict(
        c_lin=1.0,
        sec_per_linear_unit=PER_TOKEN,
        sec_per_attention_pair=PER_PAIR,
        batch_overhead=OVERHEAD,
        decode_overhead=OVERHEAD,
        weight_bytes=1e9,
        embedding_row_bytes=0.0,
        hbm_bandwidth=1e12,
        kv_bytes_per_token=0.0,
    )
    values.update(changes)
    return dataclasses.replace(base, **values)


def request(keys, input_tokens, output_tokens, think=0.0, arrival=None, tail=0):
    return Request(
        keys=np.asarray(keys, dtype=np.int64),
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        think_time=think,
        arrival=arrival,
        kind=TOOL if think else HUMAN,
        tail_key=10**9 + tail,
        source=f"tail {tail}",
    )


def workload(sessions, closed_loop=True):
    sessions = tuple(Session(f"s{i}", tuple(reqs)) for i, reqs in enumerate(sessions))
    summary = WorkloadSummary(format="test", sessions=len(sessions))
    return Workload(sessions=sessions, block_size=B, closed_loop=closed_loop, summary=summary)


B = 64


def make_job(keys, input_tokens, output_tokens=1, send_time=0.0, session="s", index=0, tail=10**6):
    """A job whose prompt is blocks `keys` then `input_tokens - len(keys)*B` unique tail tokens."""
    request = sim_request(keys, input_tokens, output_tokens, tail_key=tail + index + 1000 * len(session),
                          source=f"{session}[{index}]")
    return Job(session, index, request, send_time, request_tokens(request, B))


OVERHEAD, PER_TOKEN, PER_PAIR, DECODE_STEP = 0.01, 1e-3, 1e-6, 0.011


