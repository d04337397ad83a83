"""PenelopeTritonAttnBackend plans the ragged kernel once per ForwardBatch: the layers of one batch
share the plan (same results as unplanned calls, bit for bit), and a new batch gets a new plan."""
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang_attention_env import DIM, HEADS, KV_HEADS, backend, layer, phantom_batch
from sglang_env import sglang_config

from penelope.integration.sglang import attention, hooks
from penelope.kernels.ragged_attention import ragged_prefill_attention

LAYERS = 3


@pytest.fixture(autouse=True)
def _config():
    with sglang_config():
        yield


def test_layers_of_a_batch_share_one_plan(monkeypatch):
    plans, plan_ragged_prefill = [], attention.plan_ragged_prefill

    def counted_plan(*args, **kwargs):
        plans.append(plan_ragged_prefill(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(attention, "plan_ragged_prefill", counted_plan)
    serving, batch = phantom_batch()
    pool = MHATokenToKVPool(size=64 * 40, page_size=1, dtype=torch.float32, head_num=KV_HEADS, head_dim=DIM,
                            layer_num=LAYERS, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    gen = torch.Generator().manual_seed(1)
    for buffer in (*pool.k_buffer, *pool.v_buffer):
        buffer.copy_(torch.randn(buffer.shape, generator=gen))
    tokens = sum(batch.extend_lens)
    attn = backend(serving, pool)
    table = serving.req_pool.req_to_token

    for batch_index in range(2):
        # Every ForwardBatch gets its own segments tensor from the hooks.
        segments = hooks.extend_segments(batch.reqs, batch.prefix_lens, batch.extend_lens, "cpu")
        forward_batch = SimpleNamespace(out_cache_loc=batch.out_cache_loc, out_cache_loc_is_physical=False,
                                        positions=None, mha_one_shot=False, **{hooks.SEGMENTS: segments})
        for layer_id in range(LAYERS):
            q = torch.randn(tokens, HEADS * DIM, generator=gen)
            k = torch.randn(tokens, KV_HEADS, DIM, generator=gen)
            v = torch.randn(tokens, KV_HEADS, DIM, generator=gen)
            out = attn.forward_extend(q, k, v, layer(layer_id=layer_id), forward_batch)
            unplanned = ragged_prefill_attention(q.view(-1, HEADS, DIM), pool.k_buffer[layer_id],
                                                 pool.v_buffer[layer_id], table, segments, sm_scale=DIM**-0.5)
            assert torch.equal(out.view(-1, HEADS, DIM), unplanned)
        assert len(plans) == batch_index + 1
        assert plans[-1].segments is segments and plans[-1].num_tokens == tokens
