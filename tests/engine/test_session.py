"""The serving loop (`penelope.engine.session`): multi-turn sessions through a small evicting cache
(GPU only, or with a CPU tier whose moves run on the real pools) give the tokens and log-probs of a
plain reference that recomputes every sequence from scratch (no cache, no phantoms, one full
prefill per generated token)."""
import numpy as np
import pytest
import torch

from penelope.cache.baselines.hicache import HiCacheLikeCache
from penelope.cache.manager import KVCache
from penelope.cache.tiers import TwoTierCache
from penelope.engine.decoder import EngineBatch, Qwen3Decoder
from penelope.engine.decoder_config import BUILTIN_ENGINE_CONFIGS
from penelope.engine.kvpool import KVPool
from penelope.engine.session import AgentWorkload, Server, run_workload, turn_order
from penelope.engine.weights import random_weights
from penelope.errors import UsageError

TINY = BUILTIN_ENGINE_CONFIGS["tiny"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return Qwen3Decoder(TINY, random_weights(TINY, seed=5), attention="naive", deterministic=True)


def full_logits(model, tokens):
    pool = KVPool(model.config, len(tokens))
    return model(EngineBatch.single_segment(torch.as_tensor(tokens), torch.arange(len(tokens))), pool)


def reference_turn(model, prompt, new_tokens):
    """Greedy tokens by full recomputation, and the log-softmax rows `[n + new - 1, V]` of the
    final sequence."""
    sequence = list(prompt)
    for _ in range(new_tokens):
        sequence.append(int(torch.argmax(full_logits(model, sequence)[-1])))
    logits = full_logits(model, sequence[:-1])
    rows = torch.cat([torch.log_softmax(logits[i : i + 1], dim=-1) for i in range(logits.shape[0])])
    return sequence[len(prompt) :], rows.numpy()


def server_for(model, kind):
    """A server over a 192-token GPU pool: GPU-only Penelope, the unified two-tier cache (a 32-token
    CPU tier, one-block swap buffer), or the HiCache-like baseline (192-token CPU tier)."""
    pool = KVPool(TINY, 192)
    if kind == "gpu":
        return Server(model, KVCache(192, block_size=16, policy="penelope"), pool)
    if kind == "two-tier":
        cache = TwoTierCache(192, 32, block_size=16, policy="penelope", swap_buffer=16)
    else:
        cache = HiCacheLikeCache(192, 192, block_size=16)
    return Server(model, cache, pool, host_pool=pool.host_mirror(cache.host_rows), copy="naive")


@pytest.mark.parametrize("kind", ["gpu", "two-tier", "hicache"])
def test_multi_turn_sessions_match_full_recomputation(model, kind):
    workload = AgentWorkload(sessions=2, turns=3, system_tokens=32, message_tokens=40, reply_tokens=3,
                             vocab_size=TINY.vocab_size, seed=1)
    server = server_for(model, kind)
    cache = server.cache
    histories = [workload.system_prompt() for _ in range(workload.sessions)]
    phantoms = loaded = swapped = 0
    for session, turn in turn_order(workload):
        prompt = np.concatenate([histories[session], workload.message(session, turn)])
        result = server.serve(prompt, 3, logprobs=True)
        cache.check_invariants()
        generated, rows = reference_turn(model, prompt.tolist(), 3)
        if kind != "gpu":
            assert cache.take_plans() == []  # the server ran every plan the cache queued
        assert result.generated == generated
        assert result.prompt_len == len(prompt)
        # Every computed position: phantom rows, the new prompt rows, and the decode rows.
        computed = [p for start, end in result.holes for p in range(start, end)]
        assert result.positions.tolist()[: len(computed)] == computed
        assert result.positions.tolist()[-2:] == [len(prompt), len(prompt) + 1]
        assert np.array_equal(result.logprobs, rows[result.positions])
        phantoms += result.phantom_tokens
        loaded += result.loaded_tokens
        swapped += result.swapped_tokens
        histories[session] = np.concatenate([prompt, generated])
    assert cache.stats.evicted_tokens > 0
    if kind == "gpu":
        assert phantoms > 0 and loaded == 0
    elif kind == "two-tier":
        # Every kind of move happened: phantoms refilled deleted KV, CPU spans came back, one
        # load went through the swap buffer, and GPU blocks were demoted to make room.
        assert phantoms > 0 and loaded > 0 and swapped > 0
        assert cache.counters.demotions > 0 and cache.counters.swap_loads > 0
        assert server.executor.counters.plans == cache.counters.plans
    else:
        assert loaded > 0 and cache.counters.backed_up_tokens > 0


def test_run_workload_records_histories_replies_and_counters(model):
    workload = AgentWorkload(sessions=2, turns=2, system_tokens=16, message_tokens=24, reply_tokens=2,
                             vocab_size=TINY.vocab_size, seed=2)
    cache = KVCache(1024, block_size=16)
    record = run_workload(Server(model, cache, KVPool(TINY, 1024)), workload)
    assert record.requests == 4 and record.phantom_tokens == 0 and record.holes_refilled == 0
    for session, state in enumerate(record.sessions):
        expected = [workload.system_prompt()]
        for turn in range(2):
            expected += [workload.message(session, turn), np.asarray(state.replies[turn])]
        assert np.array_equal(state.history, np.concatenate(expected))
        # Each position 0 .. n-2 of a history was computed at least once (shared prompt: by session 0).
        assert set(range(16 if session else 0, len(state.history) - 1)) <= set(state.logprobs)
    assert record.hit_tokens == cache.stats.hit_tokens


def test_workload_messages_are_seeded_and_bounded():
    workload = AgentWorkload(message_tokens=100, seed=3)
    assert np.array_equal(workload.message(1, 2), AgentWorkload(message_tokens=100, seed=3).message(1, 2))
    assert not np.array_equal(workload.message(1, 2), workload.message(2, 1))
    lengths = [len(workload.message(s, t)) for s in range(4) for t in range(6)]
    assert 75 <= min(lengths) and max(lengths) <= 125
    assert workload.max_sequence() == 256 + 6 * (125 + 8)
    with pytest.raises(UsageError, match="turns"):
        AgentWorkload(turns=0)


def test_server_errors_release_the_request(model):
    cache = KVCache(64, block_size=16)
    with pytest.raises(UsageError, match="capacity"):
        Server(model, cache, KVPool(TINY, 128))
    server = Server(model, cache, KVPool(TINY, 64))
    with pytest.raises(UsageError, match="max_new_tokens"):
        server.serve([1, 2, 3], 0)
    with pytest.raises(UsageError, match="token ids"):
        server.serve([1, 2, 10_000], 1)
    cache.check_invariants()
    assert cache.free_size() == 64 and cache.protected_size() == 0


def test_server_needs_a_matching_host_pool_for_a_cpu_tier(model):
    tiers = TwoTierCache(64, 32, block_size=16, swap_buffer=16)
    pool = KVPool(TINY, 64)
    with pytest.raises(UsageError, match="needs a host pool of 48 rows"):
        Server(model, tiers, pool)
    with pytest.raises(UsageError, match="host pool has 32 rows"):
        Server(model, tiers, pool, host_pool=pool.host_mirror(32))
    with pytest.raises(UsageError, match="unknown copy function"):
        Server(model, tiers, pool, host_pool=pool.host_mirror(48), copy="memcpy")
    with pytest.raises(UsageError, match="keep_plans=False"):
        Server(model, TwoTierCache(64, 32, block_size=16, swap_buffer=16, keep_plans=False), pool,
               host_pool=pool.host_mirror(48))
    with pytest.raises(UsageError, match="has none"):
        Server(model, KVCache(64, block_size=16), pool, host_pool=pool.host_mirror(48))
    host = pool.host_mirror(48)
    assert host.device.type == "cpu" and host.dtype == pool.dtype and len(host.buffers()) == 2 * TINY.num_layers
    assert host.buffers()[0] is host.k_buffers[0] and host.buffers()[-1] is host.v_buffers[-1]
