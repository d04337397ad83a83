"""The public op: ``ragged_prefill_attention`` (one layer's call: checks, then one kernel launch) and
``warm_up_ragged_attention`` (compile the kernels once when the model is loaded).

A call with ``plan=`` (``plan_ragged_prefill``, once per batch) only checks that the plan fits and
launches ``kernel.py``'s kernel; without a plan it plans the batch itself and waits for the slot check.
"""

from __future__ import annotations

import torch

from .configs import RaggedBlocks, ragged_attention_blocks, target_of
from .kernel import is_interpreted, run_ragged_prefill
from .plan import RaggedPlan, check_plan_fits, plan_ragged_prefill
from .segments import check_layer_inputs, check_table
from .slot_check import run_slot_check


def ragged_prefill_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    segments,
    sm_scale: float | None = None,
    return_lse: bool = False,
    *,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    plan: RaggedPlan | None = None,
):
    """Causal prefill attention by ABSOLUTE position over a token-indexed KV pool, one launch.

    Args:
        q: ``[T, Hq, D]`` fp16, bf16 or fp32 queries (any token/head strides, unit stride on D).
        k_buffer, v_buffer: ``[S, Hkv, D]`` KV pool of one layer, q's dtype; the batch's own K/V
            must already be stored (``store_kv``). ``Hq`` must be a multiple of ``Hkv``.
        req_to_token: int32 ``[R, max_len]``, pool slot of (request row, absolute position).
        segments: int32 ``[N, 4]`` rows ``(req_row, q_start, pos_start, length)`` (a tensor on q's
            device or on the CPU, a numpy array or a list): query rows ``q_start .. q_start +
            length - 1`` are positions ``pos_start ..`` of row ``req_row``. They must cover q's rows
            exactly once; one row's segments must not share a position. Empty segments are allowed.
            A query at position p attends to positions ``0 .. p``.
        sm_scale: softmax scale, default ``D ** -0.5``.
        return_lse: also return the log-sum-exp (natural log) of the scaled scores.
        out, lse_out: optional preallocated ``[T, Hq, D]`` (q's dtype) and ``[T, Hq]`` fp32 outputs.
        plan: ``plan_ragged_prefill(req_to_token, segments, ...)`` of this batch, shared by its
            layers: then the call does no per-batch work and never waits for the GPU; it checks
            that the plan fits (same ``req_to_token`` and ``segments`` objects, the table not
            written since, q's rows, device and tile sizes, a pool of at least ``num_slots`` rows).

    Returns:
        ``o`` ``[T, Hq, D]`` in q's dtype, and ``lse`` ``[T, Hq]`` fp32 when ``return_lse``.

    Raises:
        ValueError: bad shapes, dtypes, devices or strides, segments that overlap, leave rows
        uncovered or run past q or ``req_to_token``, or slots outside the pool; a plan that does
        not fit. Without a plan the call plans the batch and waits for its slot check (a sync).
    """
    sm_scale = check_layer_inputs(q, k_buffer, v_buffer, sm_scale)
    num_tokens, num_q_heads, head_dim = q.shape
    if plan is None:
        check_table(req_to_token, q.device)
        plan = plan_ragged_prefill(
            req_to_token, segments, num_tokens=num_tokens, num_slots=k_buffer.shape[0],
            num_q_heads=num_q_heads, num_kv_heads=k_buffer.shape[1], head_dim=head_dim, dtype=q.dtype, check=True,
        )
    else:
        check_plan_fits(plan, q, k_buffer, req_to_token, segments)
    out = _checked_output(out, "out", (num_tokens, num_q_heads, head_dim), q.dtype, q.device)
    if return_lse:
        lse_out = _checked_output(lse_out, "lse_out", (num_tokens, num_q_heads), torch.float32, q.device)
    if num_tokens > 0 and plan.tiles.shape[0] > 0:
        run_ragged_prefill(q, k_buffer, v_buffer, req_to_token, plan.tiles, plan.status.value, sm_scale, out,
                           lse_out if return_lse else None, plan.blocks, plan.target)
    return (out, lse_out) if return_lse else out


def _checked_output(tensor, name, shape, dtype, device):
    if tensor is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(tensor.shape) != shape or tensor.dtype != dtype or tensor.device != device:
        raise ValueError(
            f"{name} must be {shape} {dtype} on {device}, got {tuple(tensor.shape)} {tensor.dtype} "
            f"on {tensor.device}"
        )
    if tensor.stride(-1) != 1:
        raise ValueError(f"{name} needs a unit stride on its last dim, got strides {tensor.stride()}")
    return tensor


def warm_up_ragged_attention(
    k_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    num_q_heads: int,
    return_lse: bool = False,
) -> RaggedBlocks | None:
    """Compile, without running, the ragged kernel and the slot check for one model's layers.

    Call it once per process when the model is loaded (SGLang: when the attention backend is
    created), so that no request waits for a compile, and every process and tensor-parallel rank
    uses the same pinned configuration. ``k_buffer``: one layer's ``[S, Hkv, D]`` pool (its dtype,
    strides and device are those of every layer); ``req_to_token``: the int32 table the batches
    will use; ``num_q_heads``: q heads of this rank. Returns the pinned tile sizes, or None under
    the interpreter (nothing to compile).
    """
    if not isinstance(k_buffer, torch.Tensor) or k_buffer.dim() != 3:
        raise ValueError("k_buffer must be one layer's [S, Hkv, D] pool")
    check_table(req_to_token, k_buffer.device)
    num_kv_heads, head_dim = k_buffer.shape[1:]
    if num_q_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"q heads ({num_q_heads}) must be a positive multiple of kv heads ({num_kv_heads})")
    device = k_buffer.device
    target = target_of(device)
    blocks = ragged_attention_blocks(head_dim, num_q_heads // num_kv_heads, target, k_buffer.dtype)
    if is_interpreted():
        return None
    # Tensors of the layers' dtypes and strides; nothing is launched, so one row each suffices.
    q = torch.empty((1, num_q_heads, head_dim), dtype=k_buffer.dtype, device=device)
    ints = torch.zeros(8, dtype=torch.int32, device=device)
    lse = torch.empty((1, num_q_heads), dtype=torch.float32, device=device) if return_lse else None
    run_ragged_prefill(q, k_buffer, k_buffer, req_to_token, ints.view(2, 4), ints[:1], 1.0, q, lse, blocks, target,
                       compile_only=True)
    run_slot_check(req_to_token, ints[:6].view(2, 3), ints[:1], k_buffer.shape[0], 1, compile_only=True)
    return blocks
