"""SGLang's ``torch_native`` CPU attention backend, with an extend path that reads cached K/V
instead of recomputing attention over it.

``TorchNativeAttnBackend.forward_extend`` runs, per request, causal attention of the WHOLE
sequence (its query padded to the sequence length) and keeps the rows of the new tokens, so a
prefill costs the same whether or not a prefix is cached. This subclass attends each request's
new queries to its cached prefix (every position before its extend in its ``req_to_token`` row,
no mask) and to its own new tokens (causally), and merges the two by log-sum-exp: the query-key
pairs a GPU backend computes, ``prefix * new + new * (new + 1) / 2`` per request, so cached tokens
cost their reads only and an evicted span costs what its positions cost.

Like the parent it stores the batch's K/V before any request reads, and reads every key and value
through ``req_to_token``, so a request reads K/V that a phantom or another request of the same
batch wrote in the same layer, and a phantom (a prefill-only request refilling a hole) is served
exactly as the parent serves it. Decode, and every extend the subclass does not cover (encoder or
cross attention, sliding windows, logit caps, value heads of another width than the query and key
heads, a sliding-window pool, speculative and dLLM modes, extra arguments) go to the parent
unchanged.

Selected with ``--attention-backend torch_native_prefix`` (``register`` adds the name to SGLang's
choices); the radix cache is any, SGLang's own or Penelope's.
"""
from __future__ import annotations

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from penelope.errors import UsageError

BACKEND_NAME = "torch_native_prefix"
# Modes whose extend is plain causal prefill; the parent keeps the others (verify, dLLM, split).
_PLAIN_EXTEND = (ForwardMode.EXTEND, ForwardMode.MIXED)


def register() -> None:
    """Make ``--attention-backend torch_native_prefix`` a choice of SGLang's command line and
    Engine (the plugin runs this before SGLang parses its arguments) and build this backend for
    it. Safe to call more than once."""
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    register_attention_backend(BACKEND_NAME)(create_prefix_attention_backend)


def create_prefix_attention_backend(runner):
    """Attention-backend factory for ``torch_native_prefix`` (a ModelRunner -> the backend)."""
    if torch.device(runner.device).type != "cpu":
        raise UsageError(f"penelope: --attention-backend {BACKEND_NAME} runs on CPU only, not on "
                         f"{runner.device}")
    return PrefixTorchNativeAttnBackend(runner)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of query [Hq, m, D] over key/value [Hkv, n, D] (Hq a multiple of Hkv,
    query head h reading K/V head h // (Hq / Hkv)); `causal` (m == n): query i sees keys 0..i.

    Returns (output [Hq, m, D] in the query's dtype, log-sum-exp of the scaled scores [Hq, m],
    fp32). PyTorch's CPU flash-attention kernel: tiled, never materialises the m x n scores and,
    causally, skips the tiles above the diagonal."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0), 0.0, causal, scale=scale)
    return out.squeeze(0), lse.squeeze(0)


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from each set's output [H, m, D] and
    log-sum-exp [H, m]: the outputs weighted by their share of the softmax mass (fp32)."""
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = torch.exp(lse_a - lse).unsqueeze(-1)
    weight_b = torch.exp(lse_b - lse).unsqueeze(-1)
    return (out_a.float() * weight_a + out_b.float() * weight_b).to(out_a.dtype)


class PrefixTorchNativeAttnBackend(TorchNativeAttnBackend):
    """``TorchNativeAttnBackend`` whose extend attends new tokens to the cached prefix and to
    themselves only (module docstring)."""

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if kwargs or not self.prefix_eligible(layer, forward_batch):
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        out = torch.empty_like(q)
        # Store before any request reads: a request may read K/V another request of this batch
        # (its phantom) writes in this layer.
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc),
                                                k, v)
        heads, head_dim = layer.tp_q_head_num, layer.qk_head_dim
        queries = q.view(-1, heads, head_dim)
        outputs = out.view(-1, heads, head_dim)
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        req_to_token = self.req_to_token_pool.req_to_token
        start = 0
        for row, prefix, new in zip(forward_batch.req_pool_indices.tolist(), forward_batch.extend_prefix_lens.tolist(),
                                    forward_batch.extend_seq_lens.tolist(), strict=True):
            if new == 0:
                continue
            # [H, new, D]
            query = queries[start:start + new].movedim(0, 1)
            slots = req_to_token[row, :prefix + new]
            keys = k_cache[slots].movedim(0, 1).to(q.dtype)
            values = v_cache[slots].movedim(0, 1).to(q.dtype)
            own, own_lse = attend(query, keys[:, prefix:], values[:, prefix:], True, layer.scaling)
            if prefix:
                cached, cached_lse = attend(query, keys[:, :prefix], values[:, :prefix], False, layer.scaling)
                own = merge(own, own_lse, cached, cached_lse)
            outputs[start:start + new] = own.movedim(1, 0)
            start += new
        return out

    def prefix_eligible(self, layer, forward_batch) -> bool:
        """Whether plain causal decoder attention over the request rows covers this extend, i.e.
        whether the prefix-aware path computes what the parent would."""
        if forward_batch.forward_mode not in _PLAIN_EXTEND or forward_batch.encoder_lens is not None:
            return False
        if self.use_sliding_window_kv_pool:
            return False
        return not (layer.is_cross_attention or layer.attn_type != AttentionType.DECODER
                    or layer.qk_head_dim != layer.v_head_dim or (layer.logit_cap or 0) > 0
                    or (layer.sliding_window_size if layer.sliding_window_size is not None else -1) > -1)
