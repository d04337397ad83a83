"""Ragged-position prefill attention: phantom holes and new tokens of many requests in one launch.

Each program handles one query tile (the positions of ONE segment inside one aligned block
``[b * BLOCK_M, (b + 1) * BLOCK_M)``) and one kv head, with all GROUP q heads of that kv head
packed into the M dimension of the dots: row ``r`` of a tile is position
``b * BLOCK_M + r // GROUP_P`` and q head ``kv_head * GROUP + r % GROUP_P`` (GROUP_P is GROUP
rounded up to a power of two; padded heads and positions outside the segment are computed on
zeros and not stored). So a K/V tile is loaded once per group, not once per q head.

KV tiles are aligned to absolute positions too (tile j holds positions ``j * BLOCK_N ..``). A
query tile whose positions are ``first .. last`` visits tiles ``0 .. last // BLOCK_N``; the tiles
ending at or below ``first`` need no mask, only the diagonal ones do. A query at position p sits in
the same row of its tile and sees the same KV tiles in the same order whatever segment or batch
it is in (tiles past p only add exact zeros), so its result does not depend on how the batch was
cut: a phantom recomputing a hole gets the attention outputs of the original prefill bit for bit.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .segments import (
    LENGTH,
    POS_START,
    build_query_tiles,
    check_batch,
    check_batch_tables,
    check_layer_inputs,
    segments_to_numpy,
)


@triton.jit
def _attend_kv_tile(
    acc,
    l_i,
    m_i,
    q,
    k_ptr,
    v_ptr,
    slot_row_ptr,
    start_n,
    q_pos,
    last_pos,
    kv_head,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over the KV tile at positions ``start_n .. start_n + BLOCK_N - 1``."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k_pos = start_n + offs_n  # [BLOCK_N]
    d_valid = offs_d < HEAD_DIM
    if MASKED:
        # Diagonal tile: positions past the tile's last query are neither loaded nor attended.
        k_valid = k_pos <= last_pos
        slots = tl.load(slot_row_ptr + k_pos, mask=k_valid, other=0).to(tl.int64)
    else:
        # Interior tile: every position is <= the tile's first query, hence in range and visible.
        k_valid = offs_n < BLOCK_N
        slots = tl.load(slot_row_ptr + k_pos).to(tl.int64)
    kt_ptrs = k_ptr + kv_head * stride_kh + slots[None, :] * stride_kt + offs_d[:, None]
    v_ptrs = v_ptr + kv_head * stride_vh + slots[:, None] * stride_vt + offs_d[None, :]
    if MASKED or BLOCK_D != HEAD_DIM:
        kt = tl.load(kt_ptrs, mask=k_valid[None, :] & d_valid[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        v = tl.load(v_ptrs, mask=k_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
    else:
        kt = tl.load(kt_ptrs)
        v = tl.load(v_ptrs)

    if DOT_FP32:
        s = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, kt, input_precision=DOT_PRECISION)
    # Base-2 logits: qk_scale = sm_scale * log2(e), so exp2 below is exp of the scaled scores.
    s = s * qk_scale  # [ROWS, BLOCK_N]
    if MASKED:
        s = tl.where(k_pos[None, :] <= q_pos[:, None], s, float("-inf"))
    # Tile 0 holds position 0, which every query sees, so m_new is finite from the first tile on.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if DOT_FP32:
        acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _ragged_prefill_fwd_kernel(
    o_ptr,
    lse_ptr,
    work_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    req_to_token_ptr,
    tiles_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    stride_req,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    COUNT_WORK: tl.constexpr,
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    req_row = tl.load(tiles_ptr + tile_id * 4)
    q_start = tl.load(tiles_ptr + tile_id * 4 + 1)
    pos_start = tl.load(tiles_ptr + tile_id * 4 + 2)
    n_rows = tl.load(tiles_ptr + tile_id * 4 + 3)
    last_pos = pos_start + n_rows - 1

    offs_r = tl.arange(0, BLOCK_M * GROUP_P)
    offs_d = tl.arange(0, BLOCK_D)
    # Row r holds position block_start + r // GROUP_P: token counts from the tile's first query.
    token = offs_r // GROUP_P - pos_start % BLOCK_M
    head_in_group = offs_r % GROUP_P
    row_valid = (token >= 0) & (token < n_rows) & (head_in_group < GROUP)
    q_head = kv_head * GROUP + head_in_group
    # Padding rows take a position of the tile so that they stay finite; they are not stored.
    q_pos = pos_start + tl.minimum(tl.maximum(token, 0), n_rows - 1)
    q_row = (q_start + token).to(tl.int64)
    rd_mask = row_valid[:, None] & (offs_d[None, :] < HEAD_DIM)

    q_ptrs = q_ptr + q_row[:, None] * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=rd_mask, other=0.0)  # [ROWS, BLOCK_D]
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M * GROUP_P], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_P], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_P, BLOCK_D], dtype=tl.float32)
    slot_row_ptr = req_to_token_ptr + req_row.to(tl.int64) * stride_req

    # KV tiles whose last position is <= the first query position need no mask.
    n_interior = (pos_start + 1) // BLOCK_N
    n_visit = last_pos // BLOCK_N + 1
    for start_n in range(0, n_interior * BLOCK_N, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        acc, l_i, m_i = _attend_kv_tile(
            acc, l_i, m_i, q, k_ptr, v_ptr, slot_row_ptr, start_n, q_pos, last_pos, kv_head,
            stride_kt, stride_kh, stride_vt, stride_vh, qk_scale,
            HEAD_DIM, BLOCK_D, BLOCK_N, False, DOT_FP32, DOT_PRECISION,
        )
    for start_n in range(n_interior * BLOCK_N, n_visit * BLOCK_N, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        acc, l_i, m_i = _attend_kv_tile(
            acc, l_i, m_i, q, k_ptr, v_ptr, slot_row_ptr, start_n, q_pos, last_pos, kv_head,
            stride_kt, stride_kh, stride_vt, stride_vh, qk_scale,
            HEAD_DIM, BLOCK_D, BLOCK_N, True, DOT_FP32, DOT_PRECISION,
        )

    o = acc / l_i[:, None]
    o_ptrs = o_ptr + q_row[:, None] * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=rd_mask)
    if RETURN_LSE:
        # Natural-log LSE of the scaled scores: the kernel works in base 2.
        lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
        tl.store(lse_ptr + q_row * stride_lt + q_head * stride_lh, lse, mask=row_valid)
    if COUNT_WORK:
        program = tile_id * tl.num_programs(1) + kv_head
        tl.store(work_ptr + program * 2, n_visit)
        tl.store(work_ptr + program * 2 + 1, n_visit - n_interior)


@triton.jit
def _store_kv_kernel(
    k_buffer_ptr,
    v_buffer_ptr,
    k_ptr,
    v_ptr,
    slots_ptr,
    stride_kbt,
    stride_kbh,
    stride_vbt,
    stride_vbh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]
    k = tl.load(k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(k_buffer_ptr + slot * stride_kbt + offs_h[:, None] * stride_kbh + offs_d[None, :], k, mask=mask)
    tl.store(v_buffer_ptr + slot * stride_vbt + offs_h[:, None] * stride_vbh + offs_d[None, :], v, mask=mask)


# Hopper: BLOCK_N, warps and stages tuned per (head_dim, group size, dtype); BLOCK_M is fixed by the
# host because the query tiles are cut on the host.
_HOPPER_CONFIGS = [
    triton.Config({"BLOCK_N": block_n}, num_warps=warps, num_stages=stages)
    for block_n in (64, 128)
    for warps in (4, 8)
    for stages in (2, 3)
]
_ragged_prefill_fwd_tuned = triton.autotune(configs=_HOPPER_CONFIGS, key=["HEAD_DIM", "GROUP"])(
    _ragged_prefill_fwd_kernel
)


class RaggedBlocks(NamedTuple):
    """Tile sizes of one launch: BLOCK_M queries x GROUP_P heads against BLOCK_N keys."""

    block_m: int
    block_n: int
    group_p: int
    num_warps: int
    num_stages: int


def ragged_attention_blocks(head_dim: int, group: int, interpreted: bool = False) -> RaggedBlocks:
    """Default tile sizes for ``head_dim`` and ``group`` q heads per kv head.

    The M dimension of the dots holds ``block_m * group_p`` rows: 128 on GPU (64 for head_dim
    above 128, to fit registers), 64 under the interpreter, where small tiles keep tests fast
    and still give several query tiles per segment. On Hopper, BLOCK_N, warps and stages are
    autotuned over ``_HOPPER_CONFIGS`` instead of the defaults returned here.
    """
    group_p = triton.next_power_of_2(group)
    if interpreted:
        rows, block_n = 64, 32
    else:
        rows, block_n = (128 if head_dim <= 128 else 64), 64
    num_warps = 4 if head_dim <= 64 else 8
    return RaggedBlocks(max(1, rows // group_p), block_n, group_p, num_warps, 2)


def _is_interpreted(kernel) -> bool:
    return isinstance(kernel, InterpretedFunction)


def _check_backend(device: torch.device) -> None:
    if device.type == "cpu" and not _is_interpreted(_ragged_prefill_fwd_kernel):
        raise ValueError(
            "CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 before penelope.kernels "
            "is imported"
        )


def _query_tiles(segs: np.ndarray, blocks: RaggedBlocks, device: torch.device) -> torch.Tensor:
    """The launch's query tiles as an int32 ``[n_tiles, 4]`` tensor on ``device``."""
    return torch.from_numpy(build_query_tiles(segs, blocks.block_m).astype(np.int32)).to(device)


def _launch_ragged_prefill(q, k_buffer, v_buffer, req_to_token, tiles, sm_scale, out, lse, blocks,
                           work=None, autotune=False):
    """Launch the kernel over prebuilt query ``tiles``; inputs are already validated."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    group = num_q_heads // num_kv_heads
    if tiles.shape[0] == 0:
        return
    interpreted = q.device.type == "cpu"
    return_lse = lse is not None
    count_work = work is not None
    # Unused pointer arguments still need a tensor; the constexpr flags keep them untouched.
    lse_arg = lse if return_lse else out
    work_arg = work if count_work else tiles
    args = (
        out, lse_arg, work_arg, q, k_buffer, v_buffer, req_to_token, tiles,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), out.stride(0), out.stride(1),
        lse.stride(0) if return_lse else 0, lse.stride(1) if return_lse else 0,
        req_to_token.stride(0), sm_scale * math.log2(math.e),
    )
    constexprs = dict(
        HEAD_DIM=head_dim,
        GROUP=group,
        GROUP_P=blocks.group_p,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=blocks.block_m,
        # The interpreter's bf16 tl.dot is wrong (bf16 is stored as uint16 there): use fp32 dots.
        DOT_FP32=interpreted and q.dtype == torch.bfloat16,
        # fp32 inputs get exact fp32 dots rather than TF32; fp16/bf16 use the backend's default.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        RETURN_LSE=return_lse,
        COUNT_WORK=count_work,
    )
    grid = (tiles.shape[0], num_kv_heads)
    # No FMA contraction: interior (unmasked) and diagonal (masked) tiles must round identically,
    # or a query's result would depend on which kind of tile a KV tile is for its query tile.
    if autotune:
        _ragged_prefill_fwd_tuned[grid](*args, **constexprs, enable_fp_fusion=False)
    else:
        _ragged_prefill_fwd_kernel[grid](
            *args, **constexprs, BLOCK_N=blocks.block_n, num_warps=blocks.num_warps,
            num_stages=blocks.num_stages, enable_fp_fusion=False,
        )


def _is_hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


@dataclass(frozen=True, eq=False)
class RaggedPlan:
    """The per-batch half of ``ragged_prefill_attention``: checked segments and their query tiles.

    Every layer of a forward batch attends with the same ``req_to_token`` and ``segments``; a plan
    built once by ``plan_ragged_prefill`` and passed as ``plan=`` to each layer's call spares the
    layers the checks that read the batch on the host (device syncs) and the tile construction.
    It stays valid while ``req_to_token`` and ``segments`` are not modified.
    """

    req_to_token: torch.Tensor  # int32 [R, max_len], the table that was checked
    segments: torch.Tensor  # int32 [N, 4]
    device: torch.device  # of every layer's q and pool
    num_tokens: int  # query rows T that the segments cover
    num_slots: int  # slots S every read slot was checked against
    blocks: RaggedBlocks  # tile sizes the query tiles were cut for
    tiles: torch.Tensor  # int32 [n_tiles, 4] query tiles on `device`


def plan_ragged_prefill(
    req_to_token: torch.Tensor,
    segments: torch.Tensor,
    *,
    num_tokens: int,
    num_slots: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> RaggedPlan:
    """Check one batch and cut its query tiles, once for all the layers that attend over it.

    Args:
        req_to_token: int32 ``[R, max_len]``, pool slot of (request row, absolute position).
        segments: int32 ``[N, 4]`` rows ``(req_row, q_start, pos_start, length)``, as in
            ``ragged_prefill_attention``.
        num_tokens: query rows ``T`` of every layer's q.
        num_slots: pool slots ``S``: every slot a query reads must lie in ``[0, S)``, and every
            layer's pool must have at least ``S`` rows.
        num_q_heads, num_kv_heads, head_dim: the layers' attention shape (the query tiles are cut
            for the tile sizes of ``head_dim`` and the group size).

    Returns:
        ``RaggedPlan`` on ``req_to_token``'s device, where the layers' q and pools must be.

    Raises:
        ValueError: what ``ragged_prefill_attention`` raises for the table and the segments. The
        checks copy the segments to the host and test every slot a query reads (device syncs).
    """
    if min(num_q_heads, num_kv_heads, head_dim) <= 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"q heads ({num_q_heads}) must be a positive multiple of kv heads ({num_kv_heads}), "
            f"head_dim ({head_dim}) positive"
        )
    check_batch_tables(req_to_token, segments)
    segs = check_batch(req_to_token, segments, num_tokens, num_slots)
    device = req_to_token.device
    blocks = ragged_attention_blocks(head_dim, num_q_heads // num_kv_heads, device.type == "cpu")
    return RaggedPlan(req_to_token, segments, device, num_tokens, num_slots, blocks,
                      _query_tiles(segs, blocks, device))


def _check_plan(plan: RaggedPlan, q, k_buffer, req_to_token, segments) -> None:
    """That ``plan`` fits this layer's call: cheap checks only, no device sync."""
    if not isinstance(plan, RaggedPlan):
        raise ValueError(f"plan must be a RaggedPlan, got {type(plan).__name__}")
    if req_to_token is not plan.req_to_token or segments is not plan.segments:
        raise ValueError("plan was built for other req_to_token or segments tensors: build one plan per batch")
    if q.device != plan.device:
        raise ValueError(f"q is on {q.device} but the plan on {plan.device}")
    if q.shape[0] != plan.num_tokens:
        raise ValueError(f"plan covers {plan.num_tokens} query rows but q has {q.shape[0]}")
    if k_buffer.shape[0] < plan.num_slots:
        raise ValueError(
            f"k_buffer has {k_buffer.shape[0]} slots, fewer than the {plan.num_slots} the plan "
            f"checked req_to_token against"
        )
    head_dim, group = q.shape[2], q.shape[1] // k_buffer.shape[1]
    blocks = ragged_attention_blocks(head_dim, group, q.device.type == "cpu")
    if blocks != plan.blocks:
        raise ValueError(
            f"plan's tiles {plan.blocks} do not fit head_dim {head_dim} with {group} q heads per kv "
            f"head, which need {blocks}"
        )


def ragged_prefill_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    segments: torch.Tensor,
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
        segments: int32 ``[N, 4]`` rows ``(req_row, q_start, pos_start, length)``: query rows
            ``q_start .. q_start + length - 1`` are positions ``pos_start ..`` of row ``req_row``.
            They must cover q's rows exactly once; one row's segments must not share a position.
            Empty segments are allowed. A query at position p attends to positions ``0 .. p``.
        sm_scale: softmax scale, default ``D ** -0.5``.
        return_lse: also return the log-sum-exp (natural log) of the scaled scores.
        out, lse_out: optional preallocated ``[T, Hq, D]`` (q's dtype) and ``[T, Hq]`` fp32 outputs.
        plan: ``plan_ragged_prefill(req_to_token, segments, ...)`` of this batch, shared by its
            layers: then the call skips the per-batch checks and tile construction, and only
            checks that the plan fits (same ``req_to_token`` and ``segments`` objects, q's rows,
            device and tile sizes, a pool of at least the plan's ``num_slots`` rows).

    Returns:
        ``o`` ``[T, Hq, D]`` in q's dtype, and ``lse`` ``[T, Hq]`` fp32 when ``return_lse``.

    Raises:
        ValueError: bad shapes, dtypes, devices or strides, segments that overlap, leave rows
        uncovered or run past q or ``req_to_token``, or slots outside the pool; a plan that does
        not fit. Without a plan, validation copies the segments to the host and checks every slot
        a query can read (device syncs on every call).
    """
    sm_scale = check_layer_inputs(q, k_buffer, v_buffer, sm_scale)
    num_tokens, num_q_heads, head_dim = q.shape
    if plan is None:
        check_batch_tables(req_to_token, segments, q.device)
        plan = plan_ragged_prefill(
            req_to_token, segments, num_tokens=num_tokens, num_slots=k_buffer.shape[0],
            num_q_heads=num_q_heads, num_kv_heads=k_buffer.shape[1], head_dim=head_dim,
        )
    else:
        _check_plan(plan, q, k_buffer, req_to_token, segments)
    out = _checked_output(out, "out", (num_tokens, num_q_heads, head_dim), q.dtype, q.device)
    if return_lse:
        lse_out = _checked_output(lse_out, "lse_out", (num_tokens, num_q_heads), torch.float32, q.device)
    if num_tokens > 0:
        _check_backend(q.device)
        _launch_ragged_prefill(q, k_buffer, v_buffer, req_to_token, plan.tiles, sm_scale, out,
                               lse_out if return_lse else None, plan.blocks, autotune=_is_hopper(q.device))
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


def store_kv(k_buffer, v_buffer, slots, k, v, impl: str = "auto") -> None:
    """Write the batch's K/V rows into pool slots: ``k_buffer[slots[i]] = k[i]`` (and V), in place.

    Args:
        k_buffer, v_buffer: ``[S, Hkv, D]`` pool of one layer (unit stride on D).
        slots: int32 or int64 ``[T]`` distinct slots in ``[0, S)``.
        k, v: ``[T, Hkv, D]`` rows in the pool's dtype (unit stride on D).
        impl: ``"triton"`` (one launch for K and V), ``"torch"`` (indexed copy), or ``"auto"``:
            Triton on GPU, indexed copy on CPU (no interpreter needed there).
    """
    tensors = {"k_buffer": k_buffer, "v_buffer": v_buffer, "slots": slots, "k": k, "v": v}
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device != k_buffer.device:
            raise ValueError(f"{name} is on {tensor.device} but k_buffer is on {k_buffer.device}")
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    if k_buffer.dim() != 3 or v_buffer.shape != k_buffer.shape or v_buffer.dtype != k_buffer.dtype:
        raise ValueError(
            f"k_buffer and v_buffer must be 3-D with equal shape and dtype, got {tuple(k_buffer.shape)} "
            f"{k_buffer.dtype} and {tuple(v_buffer.shape)} {v_buffer.dtype}"
        )
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be 1-D int32/int64, got shape {tuple(slots.shape)} {slots.dtype}")
    row_shape = (slots.shape[0], *k_buffer.shape[1:])
    for name in ("k", "v"):
        if tuple(tensors[name].shape) != row_shape or tensors[name].dtype != k_buffer.dtype:
            raise ValueError(
                f"{name} must be {row_shape} {k_buffer.dtype}, got {tuple(tensors[name].shape)} "
                f"{tensors[name].dtype}"
            )
    for name in ("k_buffer", "v_buffer", "k", "v"):
        if tensors[name].stride(2) != 1:
            raise ValueError(f"{name} needs a unit stride on head_dim, got strides {tensors[name].stride()}")
    if slots.numel() == 0:
        return
    num_slots = k_buffer.shape[0]
    low, high = int(slots.min()), int(slots.max())
    if low < 0 or high >= num_slots:
        raise ValueError(f"slots must lie in [0, {num_slots}), got values in [{low}, {high}]")
    if torch.unique(slots).numel() != slots.numel():
        raise ValueError("slots contain duplicates: two rows would race for one pool slot")

    if impl == "torch" or (impl == "auto" and k_buffer.device.type == "cpu"):
        k_buffer[slots.long()] = k
        v_buffer[slots.long()] = v
        return
    _check_backend(k_buffer.device)
    num_kv_heads, head_dim = k_buffer.shape[1:]
    _store_kv_kernel[(slots.shape[0],)](
        k_buffer, v_buffer, k, v, slots,
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


class RaggedWork(NamedTuple):
    """Work of one launch, counted on the host from the kernel's own tiling.

    Pairs are query-key pairs summed over q heads; tile pairs are (query tile, KV tile) visits
    summed over kv heads; bytes are read from the pool (K and V) and from ``req_to_token``.
    """

    query_tiles: int
    tile_pairs_visited: int
    tile_pairs_masked: int
    tile_pairs_needed: int
    tile_pairs_unskipped: int
    causal_pairs: int
    computed_pairs: int
    kv_bytes: int
    index_bytes: int
    num_queries: int

    @property
    def efficiency(self) -> float:
        """Causal query-key pairs over score elements computed (1.0 = no wasted score)."""
        return self.causal_pairs / self.computed_pairs if self.computed_pairs else 1.0

    @property
    def tile_efficiency(self) -> float:
        """Tile pairs a causal mask needs over tile pairs visited (1.0 = nothing skippable visited)."""
        return self.tile_pairs_needed / self.tile_pairs_visited if self.tile_pairs_visited else 1.0

    @property
    def kv_bytes_per_query(self) -> float:
        return self.kv_bytes / self.num_queries if self.num_queries else 0.0


def ragged_attention_work(
    segments,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    elem_bytes: int = 2,
    block_m: int | None = None,
    block_n: int | None = None,
) -> RaggedWork:
    """Count the work of ``ragged_prefill_attention`` for ``segments`` without running it.

    Args:
        segments: ``[N, 4]`` rows ``(req_row, q_start, pos_start, length)`` (tensor or array).
        num_q_heads, num_kv_heads, head_dim: attention shape.
        elem_bytes: bytes per K/V element (2 for fp16/bf16).
        block_m, block_n: tiling; default: the GPU defaults of ``ragged_attention_blocks``.

    Returns:
        ``RaggedWork``. ``tile_pairs_needed`` counts the (query tile, KV tile) pairs holding at least
        one query-key pair with key position <= query position, found by testing each pair;
        ``tile_pairs_unskipped`` is what a kernel without tile skipping would visit (every KV tile
        of the request up to its longest segment end).
    """
    segs = segments_to_numpy(segments)
    group = num_q_heads // num_kv_heads
    default = ragged_attention_blocks(head_dim, group)
    block_m = default.block_m if block_m is None else block_m
    block_n = default.block_n if block_n is None else block_n
    group_p = triton.next_power_of_2(group)
    tiles = build_query_tiles(segs, block_m)
    first, rows = tiles[:, POS_START], tiles[:, LENGTH]
    last = first + rows - 1

    # The kernel's loop bounds.
    visited = last // block_n + 1
    masked = visited - (first + 1) // block_n
    # Independently: KV tile j is needed iff its first key is <= the tile's largest position.
    kv_tiles = np.arange(int(visited.max()) + 1 if len(tiles) else 0)
    needed = (kv_tiles[None, :] * block_n <= last[:, None]).sum(axis=1) if len(tiles) else visited
    live = segs[segs[:, LENGTH] > 0]
    row_end = {}
    for req_row, _, pos_start, length in live.tolist():
        row_end[req_row] = max(row_end.get(req_row, 0), pos_start + length)
    unskipped = -(-np.array([row_end[r] for r in tiles[:, 0].tolist()], dtype=np.int64) // block_n)

    # A query at position p attends to p + 1 keys.
    causal_per_head = int(((live[:, POS_START] + 1) * live[:, LENGTH] + live[:, LENGTH] * (live[:, LENGTH] - 1)
                           // 2).sum())
    # Each program loads the K and V rows of positions 0 .. last (masked loads stop at last).
    kv_rows = int((last + 1).sum()) * num_kv_heads
    return RaggedWork(
        query_tiles=len(tiles),
        tile_pairs_visited=int(visited.sum()) * num_kv_heads,
        tile_pairs_masked=int(masked.sum()) * num_kv_heads,
        tile_pairs_needed=int(needed.sum()) * num_kv_heads,
        tile_pairs_unskipped=int(unskipped.sum()) * num_kv_heads,
        causal_pairs=causal_per_head * num_q_heads,
        computed_pairs=int(visited.sum()) * num_kv_heads * block_m * group_p * block_n,
        kv_bytes=kv_rows * head_dim * elem_bytes * 2,
        index_bytes=kv_rows * 4,
        num_queries=int(live[:, LENGTH].sum()),
    )
