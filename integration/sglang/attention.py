"""SGLang's Triton attention backend, with extend batches that hold phantoms run by Penelope's
ragged-position kernel.

``hooks.py`` attaches ``penelope_segments`` (one segment per request: row, first query, first
absolute position, length) to every ForwardBatch that holds phantom requests. For those batches
and eligible layers this backend stores the batch's K/V with SGLang's own store, then runs
``penelope.kernels.ragged_prefill_attention`` over all segments in one launch, attending by
absolute position through ``req_to_token``; the kernel's per-batch work (checks of segments and
slots, query tiles) is planned by the batch's first such layer and reused by the others. Every
other batch or layer (decode, no phantoms, MLA, sliding window, logit cap, sinks, custom masks,
quantized or paged-layout KV, context parallelism) goes to ``TritonAttnBackend`` unchanged.
Phantoms are correct with the stock path too; the ragged kernel saves the work that causality
makes unnecessary. Under a prefill CUDA graph (SGLang's default on CUDA) attention runs eagerly
between the captured segments against the batch the graph runner rebuilt; the hooks keep the
segments on it, so phantom batches take this path there too.

No layer waits for the GPU: the segments should be a HOST tensor (int32 ``[N, 4]`` on the CPU,
what ``hooks.extend_segments(..., device="cpu")`` builds), so planning reads them without a sync;
a device tensor still works, at the cost of one copy back per batch. The plan's check of the
slots runs on the GPU; its result is read without blocking when the next batch is planned
(``RaggedPlan.poll``), which raises there if a slot was outside the pool (that batch's rows were
NaN, never read past the pool). The backend compiles the kernels when it is created
(``warm_up``), with the pinned tile sizes of this GPU: no request waits for a compile, and every
tensor-parallel rank runs the same configuration.
"""
from __future__ import annotations

import logging

import torch
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from penelope.kernels.ragged_attention import plan_ragged_prefill, ragged_prefill_attention, warm_up_ragged_attention

from .hooks import COUNTERS, SEGMENTS

logger = logging.getLogger(__name__)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The ragged kernel's largest head dim (its pinned tile tables stop there).
_MAX_HEAD_DIM = 256


def create_penelope_triton_backend(runner):
    """Attention-backend factory registered as ``triton`` by the plugin."""
    if runner.model_config.is_encoder_decoder:
        raise ValueError("Cross attention is not supported in the triton attention backend. "
                         "Please use `--attention-backend flashinfer`.")
    if getattr(getattr(runner, "server_args", None), "radix_cache_backend", None) != "penelope":
        # Another radix cache: no phantom batch ever comes, SGLang's own backend as it is.
        return TritonAttnBackend(runner)
    backend = PenelopeTritonAttnBackend(runner)
    backend.warm_up()
    return backend


class PenelopeTritonAttnBackend(TritonAttnBackend):
    """``TritonAttnBackend`` whose extend path runs phantom batches through the ragged kernel."""

    # The ragged kernel's plan of the latest phantom batch, shared by that batch's layers.
    ragged_plan = None

    def warm_up(self):
        """Compile the ragged kernel for this rank's heads and pools (no launch), so that the first
        phantom batch does not wait for a compile. Returns the pinned tile sizes (None when the
        kernels are interpreted or the pools are not a plain per-token K/V layout)."""
        if self.use_mla or getattr(self, "dcp_size", 1) > 1:
            return None
        pool = self.token_to_kv_pool
        try:
            k_buffer = pool.get_key_buffer(getattr(pool, "start_layer", 0) or 0)
        except (AttributeError, IndexError, KeyError, NotImplementedError):
            return None
        if (not isinstance(k_buffer, torch.Tensor) or k_buffer.dim() != 3 or k_buffer.dtype not in _DTYPES
                or k_buffer.shape[2] > _MAX_HEAD_DIM):
            return None
        blocks = warm_up_ragged_attention(k_buffer, self.req_to_token_pool.req_to_token, self.num_head)
        if blocks is not None:
            logger.info("penelope: ragged attention compiled for %d q heads, tiles %s", self.num_head, blocks.label)
        return blocks

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None,
                       score_mod=None, aux_tensors=None):
        segments = getattr(forward_batch, SEGMENTS, None)
        if segments is None or not self.ragged_eligible(q, k, v, layer, forward_batch, save_kv_cache,
                                                        sinks, score_mod, aux_tensors):
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache,
                                          sinks=sinks, score_mod=score_mod, aux_tensors=aux_tensors)
        loc = KVWriteLoc.for_batch(forward_batch, swa_loc=self.forward_metadata.swa_out_cache_loc)
        self._set_kv_buffer(forward_batch, layer, loc, k, v)
        heads, head_dim = layer.tp_q_head_num, layer.qk_head_dim
        out = getattr(forward_batch, "_attn_output", None)
        out = torch.empty_like(q) if out is None else out
        queries = q.view(-1, heads, head_dim)
        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        req_to_token = self.req_to_token_pool.req_to_token
        plan = self.ragged_plan
        # The hooks attach a new segments tensor to every ForwardBatch, so a plan made for another
        # tensor belongs to an earlier batch. Planning here rather than in init_forward_metadata:
        # only batches with an eligible layer pay for it, and the layer gives the shapes.
        if plan is None or plan.segments is not segments or plan.req_to_token is not req_to_token:
            if plan is not None:
                # The previous batch's slot check, if it has finished (never blocks): raises if a slot
                # was outside the pool (that batch attended nothing and produced NaN).
                plan.poll()
            COUNTERS["ragged_batches"] += 1
            plan = self.ragged_plan = plan_ragged_prefill(
                req_to_token, segments, num_tokens=queries.shape[0], num_slots=k_buffer.shape[0],
                num_q_heads=heads, num_kv_heads=k_buffer.shape[1], head_dim=head_dim, dtype=q.dtype,
            )
        ragged_prefill_attention(
            queries,
            k_buffer,
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            req_to_token,
            segments,
            sm_scale=layer.scaling,
            out=out.view(-1, heads, head_dim),
            plan=plan,
        )
        return out

    def ragged_eligible(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None,
                        score_mod=None, aux_tensors=None) -> bool:
        """Whether plain causal MHA/GQA over a token-indexed pool of q's dtype covers this layer,
        i.e. whether the ragged kernel computes exactly what SGLang's path would."""
        if k is None or v is None or not save_kv_cache:
            return False
        if sinks is not None or score_mod is not None or aux_tensors is not None:
            return False
        if self.use_mla or self.dcp_size > 1 or getattr(self, "dllm_attention", None) is not None:
            return False
        if getattr(forward_batch, "mha_one_shot", False) or self.forward_metadata.custom_mask is not None:
            return False
        if (layer.is_cross_attention or layer.attn_type != AttentionType.DECODER
                or layer.qk_head_dim != layer.v_head_dim or layer.qk_head_dim > _MAX_HEAD_DIM
                or layer.k_scale is not None
                or (layer.logit_cap or 0) > 0 or (layer.sliding_window_size or -1) > -1
                or (getattr(layer, "xai_temperature_len", -1) or -1) > 0):
            return False
        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        return q.dtype in _DTYPES and k_buffer.dtype == q.dtype and k_buffer.dim() == 3
