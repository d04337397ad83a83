"""Phantom batches for the ragged prefill kernel tests: batch construction, the kernel's plan and a run."""

import torch

from penelope.kernels.ragged_attention import (
    plan_ragged_prefill,
    ragged_prefill_attention,
)

# Phantom + real batch: per request row, its context length and the (pos_start, length) ranges
# whose queries the batch computes. Row 0: a hole starting at 0, a one-token hole, and 111 new
# tokens; row 1: a hole ending exactly where its 63 new tokens start; row 2: a plain prefill.
PHANTOM_BATCH = [
    (271, [(0, 63), (100, 1), (160, 111)]),
    (192, [(64, 65), (129, 63)]),
    (65, [(0, 65)]),
]


def make_batch(requests, num_q_heads, num_kv_heads, head_dim, dtype, seed=0, order_seed=None):
    """Pool, req_to_token with scattered slots, queries and segments for ``requests``.

    ``requests``: list of ``(context_len, [(pos_start, length), ...])``. Query rows follow the
    listed order unless ``order_seed`` shuffles the segments' placement in q.
    """
    gen = torch.Generator().manual_seed(seed)
    max_len = max(ctx for ctx, _ in requests)
    num_slots = sum(ctx for ctx, _ in requests) + 29
    perm = torch.randperm(num_slots, generator=gen)
    req_to_token = torch.full((len(requests), max_len + 3), -1, dtype=torch.int32)
    used = 0
    for row, (ctx, _) in enumerate(requests):
        req_to_token[row, :ctx] = perm[used : used + ctx].to(torch.int32)
        used += ctx
    spans = [(row, pos, length) for row, (_, ranges) in enumerate(requests) for pos, length in ranges]
    if order_seed is not None:
        order = torch.randperm(len(spans), generator=torch.Generator().manual_seed(order_seed))
        spans = [spans[i] for i in order.tolist()]
    segments, q_start = [], 0
    for row, pos, length in spans:
        segments.append((row, q_start, pos, length))
        q_start += length
    k_buffer = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_buffer = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(q_start, num_q_heads, head_dim, generator=gen).to(dtype)
    return dict(
        q=q,
        k_buffer=k_buffer,
        v_buffer=v_buffer,
        req_to_token=req_to_token,
        segments=torch.tensor(segments, dtype=torch.int32).reshape(-1, 4),
    )


def run_kernel(batch, **kwargs):
    """Run the kernel into NaN-filled outputs, so rows it fails to write cannot pass."""
    q = batch["q"]
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32)
    result = ragged_prefill_attention(**batch, return_lse=True, out=out, lse_out=lse, **kwargs)
    assert result[0] is out and result[1] is lse
    return out, lse


def plan_for(batch, num_slots=None):
    """``plan_ragged_prefill`` of ``batch`` (a ``make_batch`` dict) for its q and pool shapes."""
    q, k_buffer = batch["q"], batch["k_buffer"]
    return plan_ragged_prefill(
        batch["req_to_token"], batch["segments"], num_tokens=q.shape[0],
        num_slots=k_buffer.shape[0] if num_slots is None else num_slots,
        num_q_heads=q.shape[1], num_kv_heads=k_buffer.shape[1], head_dim=q.shape[2],
    )


