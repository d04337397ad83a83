"""Helpers shared by the reference engine's tests: the tiny configs, a private fp32 attention
reference, NaN-filled pools, full prefills, and transformers' Qwen3 on the same weights.

`reference_attend` is a per-query fp32 reference, so the engine tests do not depend on the kernel
package; it is batch-invariant (each query's result depends only on its own keys), which the
deterministic-mode tests rely on.
"""
import torch

from penelope.engine.attention import AttentionBackend, torch_store_kv
from penelope.engine.decoder import EngineBatch
from penelope.engine.decoder_config import BUILTIN_ENGINE_CONFIGS
from penelope.engine.kvpool import KVPool
from penelope.engine.weights import to_state_dict

TINY = BUILTIN_ENGINE_CONFIGS["tiny"]
UNTIED = BUILTIN_ENGINE_CONFIGS["tiny-untied"]
NUM_TOKENS = 300


def reference_attend(q, k_buffer, v_buffer, req_to_token, segments, sm_scale=None):
    """fp32 ragged attention, one query at a time: the query at position p of request r attends
    to the keys at `req_to_token[r, 0..p]`. Rows of no segment stay NaN."""
    group = q.shape[1] // k_buffer.shape[1]
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    out = torch.full_like(q, float("nan"))
    for req_row, q_start, pos_start, length in segments.tolist():
        for i in range(length):
            slots = req_to_token[req_row, : pos_start + i + 1].long()
            keys = k_buffer[slots].float().repeat_interleave(group, dim=1)
            values = v_buffer[slots].float().repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,khd->hk", q[q_start + i].float(), keys) * scale
            out[q_start + i] = torch.einsum("hk,khd->hd", scores.softmax(-1), values).to(q.dtype)
    return out


REFERENCE = AttentionBackend("reference", torch_store_kv, reference_attend)


def random_tokens(config, n, seed=0):
    return torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def nan_pool(config, capacity=1024):
    """A pool whose every row is NaN, so reading a row nobody wrote poisons the output."""
    pool = KVPool(config, capacity)
    pool.fill_(float("nan"))
    return pool


def full_prefill(model, tokens, slots=None):
    """Logits `[T, V]` of one request prefilled from position 0, and the pool it wrote."""
    pool = nan_pool(model.config)
    slots = torch.arange(len(tokens)) if slots is None else slots
    return model(EngineBatch.single_segment(tokens, slots), pool), pool


def phantom_setup(model, tokens, hole, cached_end):
    """Pool state after evicting `hole` from a cached prefix of `cached_end` tokens.

    Positions outside the hole keep their slots (KV from a full prefill); the hole's old slots are
    poisoned and the hole gets fresh slots, still NaN: only the phantom can fill them."""
    pool = nan_pool(model.config)
    model(EngineBatch.single_segment(tokens[:cached_end], torch.arange(cached_end)), pool)
    pool.fill_(float("nan"), torch.arange(*hole))
    slots = torch.arange(len(tokens), dtype=torch.int32)
    slots[hole[0] : hole[1]] = torch.arange(600, 600 + hole[1] - hole[0], dtype=torch.int32)
    return pool, slots


def hf_model(config, weights):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(Qwen3Config(**config.to_hf(), attn_implementation="eager")).eval()
    missing, unexpected = model.load_state_dict(to_state_dict(config, weights), strict=False)
    assert not unexpected
    assert missing == (["lm_head.weight"] if config.tie_word_embeddings else [])
    return model


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens[None]).logits[0]
