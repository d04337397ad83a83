"""The batches of the ragged-attention benchmarks and every provider that runs them.

A batch is the next request of the paper's cost-curve experiment: a context of n tokens, 30% of it
evicted either as one hole starting at ``evict_start`` (``front``: the phantom hole and the new
tokens, two segments of one request) or from the tail (``tail``: the recomputed tail and the new
tokens, one segment), over a token-indexed KV pool with scattered slots. Providers take a batch and
return a callable that computes its attention: ours (planned once, as every layer runs it), torch's
SDPA on K/V gathered per segment, SGLang's Triton extend kernel, FlashInfer and FA3 when they
import. ``bench_ragged_attention.py`` and the GPU script's attention stage share them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from penelope.kernels.ragged_attention import plan_ragged_prefill, ragged_prefill_attention

EVICT_FRAC, EVICT_START, APPEND, BLOCK_SIZE = 0.3, 2048, 512, 64


class AttentionShape(NamedTuple):
    """Heads of the attention layer, and the experiment's hole start and new tokens."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    evict_start: int = EVICT_START
    append: int = APPEND

    def heads(self) -> dict:
        return dict(num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)


QWEN3_8B = AttentionShape(32, 8, 128)


def cost_curve_segments(context: int, layout: str, shape: AttentionShape = QWEN3_8B) -> list[list[int]]:
    """Segments ``(req_row, q_start, pos_start, length)`` of the next request after eviction."""
    evicted = int(EVICT_FRAC * context) // BLOCK_SIZE * BLOCK_SIZE
    if layout == "front":
        return [[0, 0, shape.evict_start, evicted], [0, evicted, context, shape.append]]
    return [[0, 0, context - evicted, evicted + shape.append]]


def causal_flops(segments, num_q_heads: int, head_dim: int) -> int:
    """``4 * D * Hq * sum(pos + 1)``: QK^T and PV, 2 FLOPs per multiply-add."""
    pairs = sum((start + 1) * length + length * (length - 1) // 2 for _, _, start, length in segments)
    return 4 * head_dim * num_q_heads * pairs


def make_batch(context: int, layout: str, device, dtype=torch.bfloat16, shape: AttentionShape = QWEN3_8B,
               spare_slots: int = 4096) -> dict:
    """A cost-curve batch on ``device``: random q and pool, ``req_to_token`` a random permutation of
    the pool's slots (seeded by the context); segments stay on the host, as SGLang's hooks hand
    them over."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(context)
    segments = cost_curve_segments(context, layout, shape)
    total = context + shape.append
    num_slots = total + spare_slots
    num_tokens = sum(seg[3] for seg in segments)

    def randn(*size):
        return torch.randn(*size, device=device, dtype=dtype, generator=gen)

    return dict(
        q=randn(num_tokens, shape.num_q_heads, shape.head_dim),
        k_buffer=randn(num_slots, shape.num_kv_heads, shape.head_dim),
        v_buffer=randn(num_slots, shape.num_kv_heads, shape.head_dim),
        req_to_token=torch.randperm(num_slots, device=device, generator=gen)[:total].to(torch.int32)[None],
        segments=np.array(segments, dtype=np.int32),
    )


def penelope_plan(batch):
    q = batch["q"]
    return plan_ragged_prefill(batch["req_to_token"], batch["segments"], num_tokens=q.shape[0],
                               num_slots=batch["k_buffer"].shape[0], num_q_heads=q.shape[1],
                               num_kv_heads=batch["k_buffer"].shape[1], head_dim=q.shape[2], dtype=q.dtype,
                               check=True)


def penelope_runner(batch):
    """The layer's call with the batch planned once, as every layer of a model runs it."""
    plan = penelope_plan(batch)
    out = torch.empty_like(batch["q"])

    def run():
        return ragged_prefill_attention(batch["q"], batch["k_buffer"], batch["v_buffer"], batch["req_to_token"],
                                        batch["segments"], out=out, plan=plan)

    return run


def pseudo_requests(batch):
    """The batch as one pseudo-request per segment, the way a stock engine would run it: prefix =
    the row's positions before the segment, extend = the segment."""
    device = batch["q"].device
    slots = batch["req_to_token"][0].long()
    segments = batch["segments"].tolist()
    lengths = torch.tensor([n for *_, n in segments], device=device)
    prefixes = torch.tensor([pos for _, _, pos, _ in segments], device=device)
    return slots, segments, lengths, prefixes


# torch's SDPA backends the providers restrict it to.
SDPA_BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_math": "MATH"}


def sdpa_runner(batch, provider: str, expand_kv: bool = False):
    """torch's SDPA, one call per segment, on the segment's K/V gathered (outside the timed call)
    into contiguous ``[1, Hkv, pos + n, D]`` tensors: the FA-class reference a stock engine would
    run on a contiguous prefill.

    The queries of a segment are the last ``n`` of its ``pos + n`` keys, so their causal mask is
    aligned to the lower right. ``sdpa_flash`` passes ``causal_lower_right`` (torch hands it to the
    flash kernel, whose causal mode is lower-right: masked tiles are skipped); cuDNN and the math
    backend have no lower-right mode in SDPA, so they get an explicit boolean mask and compute every
    score of the rectangle. ``expand_kv``: repeat K/V per q head instead of SDPA's ``enable_gqa``.
    The callable returns the per-segment outputs (``sdpa_output`` joins them)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    backend = getattr(SDPBackend, SDPA_BACKENDS[provider])
    q, k_buffer, v_buffer = batch["q"], batch["k_buffer"], batch["v_buffer"]
    group = q.shape[1] // k_buffer.shape[1]
    scale = q.shape[2] ** -0.5
    slots = batch["req_to_token"][0].long()
    calls = []
    for _, q_start, pos, n in batch["segments"].tolist():
        keys = slots[: pos + n]
        k, v = (buffer[keys].transpose(0, 1).unsqueeze(0) for buffer in (k_buffer, v_buffer))
        if expand_kv:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        queries = q[q_start : q_start + n].transpose(0, 1).unsqueeze(0).contiguous()
        if provider == "sdpa_flash":
            mask = causal_lower_right(n, pos + n)
            _require_flash(queries, k, v, enable_gqa=not expand_kv)
        else:
            positions = torch.arange(pos + n, device=q.device)
            mask = positions[None, :] <= positions[pos:, None]
        calls.append((queries, k.contiguous(), v.contiguous(), mask))

    def run():
        with sdpa_kernel([backend]):
            return [F.scaled_dot_product_attention(queries, k, v, attn_mask=mask, scale=scale, enable_gqa=not expand_kv)
                    for queries, k, v, mask in calls]

    return run


def _require_flash(q, k, v, enable_gqa: bool) -> None:
    """``causal_lower_right`` falls back to other kernels where flash cannot run: refuse instead,
    so that a figure named flash is flash's. (Only CUDA has the check; the CPU runs its own.)"""
    if q.device.type != "cuda":
        return
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    if not can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, False, enable_gqa)):
        raise RuntimeError(f"flash attention cannot run q {tuple(q.shape)}, k {tuple(k.shape)} {q.dtype} "
                           f"(enable_gqa={enable_gqa})")


def sdpa_output(outputs) -> torch.Tensor:
    """The per-segment ``[1, Hq, n, D]`` outputs of ``sdpa_runner`` as the batch's ``[T, Hq, D]``."""
    return torch.cat([out[0].transpose(0, 1) for out in outputs])


def sglang_runner(batch):
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    q, k_buffer, v_buffer = batch["q"], batch["k_buffer"], batch["v_buffer"]
    slots, segments, lengths, prefixes = pseudo_requests(batch)
    ext_slots = torch.cat([slots[pos : pos + n] for _, _, pos, n in segments])
    k_ext, v_ext = k_buffer[ext_slots].contiguous(), v_buffer[ext_slots].contiguous()
    prefix_slots = torch.cat([slots[:pos] for _, _, pos, _ in segments])
    zero = torch.zeros(1, dtype=torch.int64, device=q.device)
    qo_indptr = torch.cat([zero, lengths.cumsum(0)]).to(torch.int32)
    kv_indptr = torch.cat([zero, prefixes.cumsum(0)]).to(torch.int32)
    out = torch.empty_like(q)
    max_len = int(lengths.max())
    scale = q.shape[2] ** -0.5

    def run():
        extend_attention_fwd(q, k_ext, v_ext, out, k_buffer, v_buffer, qo_indptr, kv_indptr, prefix_slots,
                             None, True, None, max_len, 1.0, 1.0, sm_scale=scale)
        return out

    return run


def flashinfer_runner(batch):
    import flashinfer

    q, k_buffer, v_buffer = batch["q"], batch["k_buffer"], batch["v_buffer"]
    slots, segments, lengths, _ = pseudo_requests(batch)
    # Page size 1, so a pseudo-request's pages are the slots of positions 0..end.
    pages = torch.cat([slots[: pos + n] for _, _, pos, n in segments]).to(torch.int32)
    zero = torch.zeros(1, dtype=torch.int64, device=q.device)
    qo_indptr = torch.cat([zero, lengths.cumsum(0)])
    kv_indptr = torch.cat([zero, torch.tensor([p + n for _, _, p, n in segments], device=q.device).cumsum(0)])
    last_page_len = torch.ones(len(segments), dtype=torch.int32, device=q.device)
    workspace = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="NHD")
    wrapper.plan(qo_indptr.to(torch.int32), kv_indptr.to(torch.int32), pages, last_page_len,
                 q.shape[1], k_buffer.shape[1], q.shape[2], 1, causal=True,
                 q_data_type=q.dtype, kv_data_type=k_buffer.dtype)
    cache = (k_buffer.unsqueeze(1), v_buffer.unsqueeze(1))  # [pages, page_size 1, Hkv, D]

    def run():
        return wrapper.run(q, cache)

    return run


def fa3_runner(batch):
    """FlashAttention 3 through SGLang's wrapper (needs sgl_kernel's CUDA build), page size 1."""
    from sglang.kernels.ops.attention.flash_attention import flash_attn_with_kvcache

    q, k_buffer, v_buffer = batch["q"], batch["k_buffer"], batch["v_buffer"]
    slots, segments, lengths, prefixes = pseudo_requests(batch)
    ends = [pos + n for _, _, pos, n in segments]
    page_table = torch.zeros(len(segments), max(ends), dtype=torch.int32, device=q.device)
    for i, end in enumerate(ends):
        page_table[i, :end] = slots[:end].to(torch.int32)
    zero = torch.zeros(1, dtype=torch.int64, device=q.device)
    cu_seqlens_q = torch.cat([zero, lengths.cumsum(0)]).to(torch.int32)
    cache_seqlens = (prefixes + lengths).to(torch.int32)
    max_len = int(lengths.max())

    def run():
        return flash_attn_with_kvcache(q, k_buffer.unsqueeze(1), v_buffer.unsqueeze(1), cache_seqlens=cache_seqlens,
                                       page_table=page_table, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_len,
                                       softmax_scale=q.shape[2] ** -0.5, causal=True)

    return run
