"""The prefix-aware CPU attention backend in SGLang 0.5.23's REAL Engine on CPU: the same
agent-like traffic as ``test_sglang_engine`` (4 sessions sharing a system prompt, growing
histories, a 2048-token pool that evicts, two probes) served with ``--attention-backend
torch_native`` and with ``torch_native_prefix`` on the same cache gives identical greedy tokens and
log-probabilities within 1e-4, on SGLang's default radix cache (chunked prefill: every chunk after
the first has a cached prefix) and on Penelope's (holes refilled by phantoms in the request's
batch). SGLang's strict memory checks run at every step (``engine_env``)."""
from __future__ import annotations

from dataclasses import replace

import pytest
from sglang_engine_env import TRAFFIC, engine_env

from penelope.integration.sglang.cpu_attention import BACKEND_NAME
from penelope.integration.sglang.engine_check import EngineSetup
from penelope.integration.sglang.verify import compare, run_engine, tiny_model

ATOL = 1e-4


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(tiny_model(tmp_path_factory.mktemp("tiny-qwen3")))


@pytest.mark.parametrize(("cache", "chunk"), [("default", 256), ("penelope", 2048)])
def test_same_outputs_as_torch_native(model, cache, chunk):
    setup = EngineSetup(pool_tokens=2048, chunk=chunk, cache=cache)
    theirs = run_engine(model, TRAFFIC, setup, engine_env())
    ours = run_engine(model, TRAFFIC, replace(setup, extra={"attention_backend": BACKEND_NAME}), engine_env())
    result = compare(ours, theirs, ATOL)
    assert result["requests"] == TRAFFIC.sessions * TRAFFIC.turns + 2 and result["unfinished"] == 0
    assert result["identical_tokens"], result["different"]
    assert result["max_logprob_diff"] <= ATOL, (result["max_logprob_diff"], result["max_logprob_diff_at"])
    # Every turn after the first reused cached KV, and the pool evicted.
    assert sum(r["cached_tokens"] > 0 for r in ours["requests"]) >= TRAFFIC.sessions * (TRAFFIC.turns - 1)
    if cache == "penelope":
        assert ours["counters"]["phantom_tokens"] > 0 and ours["counters"]["evicted_tokens"] > 0
