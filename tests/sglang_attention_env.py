"""The SGLang attention backend tests' set-up: layer shapes, a backend on a served pool, a phantom batch."""

from types import SimpleNamespace

from sglang.srt.layers.radix_attention import AttentionType
from sglang_env import Serving, blocks

from penelope.integration.sglang.attention import PenelopeTritonAttnBackend


def layer(**changes):
    fields = dict(layer_id=0, tp_q_head_num=HEADS, qk_head_dim=DIM, v_head_dim=DIM, scaling=DIM**-0.5,
                  is_cross_attention=False, attn_type=AttentionType.DECODER, k_scale=None, v_scale=None,
                  logit_cap=0.0, sliding_window_size=-1, xai_temperature_len=-1)
    return SimpleNamespace(**{**fields, **changes})


def backend(serving, pool):
    """The subclass without a model runner: only what its extend path reads."""
    attn = object.__new__(PenelopeTritonAttnBackend)
    attn.token_to_kv_pool, attn.req_to_token_pool = pool, serving.req_pool
    attn.use_mla, attn.dcp_size, attn.dllm_attention = False, 1, None
    attn.forward_metadata = SimpleNamespace(swa_out_cache_loc=None, custom_mask=None)
    return attn


def phantom_batch():
    """Session A (2 shared + 6 private blocks, page 1) lost 2 blocks at the front of its private
    history; its next request is batched with its phantom and with an unrelated request."""
    serving = Serving(size=64 * 40, page_size=1, max_context=1024)
    system, a = serving.lose_front()
    reqs = serving.admit([a + blocks(9000, 1)[:40], system + [3, 4, 5]])
    batch = serving.build_batch(reqs)
    return serving, batch


HEADS, KV_HEADS, DIM = 4, 2, 16


