"""The serving loop waits for tier copies layer by layer: before layer l of a forward touches the
pool, every copy of layer l issued before that forward is done (the recorded stream model orders it
first); copies of later layers are not waited for yet, so on a GPU the prefill's first layers
overlap the rest of the load. Results stay those of full recomputation."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from penelope.cache.manager import KVCache  # noqa: E402
from penelope.cache.tiers import TwoTierCache  # noqa: E402
from penelope.engine.attention import AttentionBackend, get_attention_backend  # noqa: E402
from penelope.engine.decoder import Qwen3Decoder  # noqa: E402
from penelope.engine.decoder_config import BUILTIN_ENGINE_CONFIGS  # noqa: E402
from penelope.engine.kvpool import KVPool  # noqa: E402
from penelope.engine.session import AgentWorkload, Server, turn_order  # noqa: E402
from penelope.engine.weights import random_weights  # noqa: E402
from penelope.kernels.kv_swap import RecordingStreams  # noqa: E402

TINY = BUILTIN_ENGINE_CONFIGS["tiny"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_forward_layers_wait_only_for_their_own_copies():
    streams = RecordingStreams()
    naive = get_attention_backend("naive")
    stores = []

    def store(k_buffer, v_buffer, slots, k, v, **kwargs):
        # Layer l's first touch of the pool, as compute on the current stream.
        stores.append((len(stores) % TINY.num_layers, streams.compute("store")))
        naive.store_kv(k_buffer, v_buffer, slots, k, v, **kwargs)

    recorded = AttentionBackend("recorded", store, naive.attend)
    model = Qwen3Decoder(TINY, random_weights(TINY, seed=5), attention=recorded, deterministic=True)
    reference = Qwen3Decoder(TINY, model.weights, attention="naive", deterministic=True)
    pool = KVPool(TINY, 192)
    cache = TwoTierCache(192, 32, block_size=16, policy="penelope", swap_buffer=16)
    server = Server(model, cache, pool, host_pool=pool.host_mirror(cache.host_rows), copy="triton")
    server.executor.streams = streams
    workload = AgentWorkload(sessions=2, turns=3, system_tokens=32, message_tokens=40, reply_tokens=2,
                             vocab_size=TINY.vocab_size, seed=1)
    histories = [workload.system_prompt() for _ in range(workload.sessions)]
    # A cache large enough never to evict: the reference tokens.
    never_evicting = Server(reference, KVCache(1024, block_size=16), KVPool(TINY, 1024))
    for session, turn in turn_order(workload):
        prompt = np.concatenate([histories[session], workload.message(session, turn)])
        result = server.serve(prompt, 2)
        assert result.generated == never_evicting.serve(prompt, 2).generated
        histories[session] = np.concatenate([prompt, result.generated])
    assert cache.counters.loaded_tokens > 0 and cache.counters.demotions > 0

    before = streams.happens_before()
    copies = [(i, op.copy) for i, op in enumerate(streams.ops) if op.kind == "copy"]
    overlapped = 0
    for layer, at in stores:
        for i, copy in copies:
            if i > at:
                continue
            if copy.layer <= layer:
                # Issued before this store, of this layer or an earlier one: done before it.
                assert before[i, at], (copy, layer)
            elif not before[i, at]:
                overlapped += 1
    # Some copies of later layers were still free to run while an earlier layer computed.
    assert overlapped > 0
