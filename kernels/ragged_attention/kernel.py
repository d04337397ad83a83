"""Ragged-position prefill attention: phantom holes and new tokens of many requests in one launch.

Each program handles one query tile (the positions of ONE segment inside one aligned block
``[b * BLOCK_M, (b + 1) * BLOCK_M)``) and one kv head, with all GROUP q heads of that kv head
packed into the M dimension of the dots: row ``r`` of a tile is position
``b * BLOCK_M + r // GROUP`` and q head ``kv_head * GROUP + r % GROUP``. ``BLOCK_M`` is
``BLOCK_R // GROUP`` for ``BLOCK_R`` rows (a power of two), so a group that is not a power of two
wastes at most ``GROUP - 1`` rows of a tile (3 of 128 for a group of 5) instead of padding every
position to the next power of two (37.5% for 5 -> 8). Rows past ``BLOCK_M * GROUP`` and positions
outside the segment are computed on zeros and not stored. A K/V tile is loaded once per group, not
once per q head.

KV tiles are aligned to absolute positions too (tile j holds positions ``j * BLOCK_N ..``). A
query tile whose positions are ``first .. last`` visits tiles ``0 .. last // BLOCK_N``; the tiles
ending at or below ``first`` need no mask, only the diagonal ones do. A query at position p sits in
the same row of its tile and sees the same KV tiles in the same order whatever segment or batch
it is in (tiles past p only add exact zeros), so its result does not depend on how the batch was
cut: a phantom recomputing a hole gets the attention outputs of the original prefill bit for bit.
That needs the interior (unmasked) and diagonal (masked) step to round identically for a row the
mask does not touch: both compute the exponent's argument and the running sum with the same
explicit FMAs, so the compiler's contraction of the remaining multiply-adds (on, for speed) cannot
make the two steps differ; ``compile_report`` checks that both loops compile to the same
floating-point instructions.

This module holds the Triton code and its launch only: the per-batch plan (segments checked, query
tiles cut, the slots checked on the device) is ``plan.py``, the public entry point ``prefill.py``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .configs import INTERPRETER, RaggedBlocks


@triton.jit
def _attend_kv_tile(
    acc,
    l_i,
    m_i,
    q,
    k_ptr,
    v_ptr,
    slot_row_ptr,
    num_slots,
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
    # The plan checked every slot, but a table written after planning without torch seeing it (a
    # raw pointer, .numpy(), another kernel) could hold anything: never address outside the pool.
    slots = tl.where((slots >= 0) & (slots < num_slots), slots, 0)
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
        s = tl.dot(q, kt, input_precision=DOT_PRECISION)  # [BLOCK_R, BLOCK_N] raw scores
    if MASKED:
        s = tl.where(k_pos[None, :] <= q_pos[:, None], s, float("-inf"))
    # Base-2 logits: qk_scale = sm_scale * log2(e). The scale is monotone, so the row maximum of the
    # scaled scores is the scaled row maximum. Tile 0 holds position 0, which every query sees, so
    # m_new is finite from the first tile on; a fully masked row of a later tile keeps m_i.
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    # One rounding for scale-and-shift (an explicit FMA in both kinds of tile: with contraction on,
    # a multiply and a subtract split by the mask's select would otherwise fuse only where unmasked).
    p = tl.math.exp2(tl.fma(s, qk_scale, -m_new[:, None]))
    alpha = tl.math.exp2(m_i - m_new)
    l_i = tl.fma(l_i, alpha, tl.sum(p, 1))
    acc = acc * alpha[:, None]
    if DOT_FP32:
        acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["stride_lt", "stride_lh", "stride_req", "num_slots"])
def _ragged_prefill_fwd_kernel(
    o_ptr,
    lse_ptr,
    work_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    req_to_token_ptr,
    tiles_ptr,
    status_ptr,
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
    num_slots,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
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
    # The plan's check of the slots this batch reads (queued before this launch): when it found a
    # slot outside the pool, no KV tile is visited and every output row becomes 0 / 0 = NaN.
    slots_ok = tl.load(status_ptr) == 2147483647

    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    # Row r holds position block_start + r // GROUP: token counts from the tile's first query.
    token = offs_r // GROUP - pos_start % BLOCK_M
    head_in_group = offs_r % GROUP
    row_valid = (token >= 0) & (token < n_rows) & (offs_r < BLOCK_M * GROUP)
    q_head = kv_head * GROUP + head_in_group
    # Padding rows take a position of the tile so that they stay finite; they are not stored.
    q_pos = pos_start + tl.minimum(tl.maximum(token, 0), n_rows - 1)
    q_row = (q_start + token).to(tl.int64)
    rd_mask = row_valid[:, None] & (offs_d[None, :] < HEAD_DIM)

    q_ptrs = q_ptr + q_row[:, None] * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=rd_mask, other=0.0)  # [BLOCK_R, BLOCK_D]
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    slot_row_ptr = req_to_token_ptr + req_row.to(tl.int64) * stride_req

    # KV tiles whose last position is <= the first query position need no mask.
    n_interior = tl.where(slots_ok, (pos_start + 1) // BLOCK_N, 0)
    n_visit = tl.where(slots_ok, last_pos // BLOCK_N + 1, 0)
    for start_n in range(0, n_interior * BLOCK_N, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        acc, l_i, m_i = _attend_kv_tile(
            acc, l_i, m_i, q, k_ptr, v_ptr, slot_row_ptr, num_slots, start_n, q_pos, last_pos, kv_head,
            stride_kt, stride_kh, stride_vt, stride_vh, qk_scale,
            HEAD_DIM, BLOCK_D, BLOCK_N, False, DOT_FP32, DOT_PRECISION,
        )
    for start_n in range(n_interior * BLOCK_N, n_visit * BLOCK_N, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        acc, l_i, m_i = _attend_kv_tile(
            acc, l_i, m_i, q, k_ptr, v_ptr, slot_row_ptr, num_slots, start_n, q_pos, last_pos, kv_head,
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


def is_interpreted() -> bool:
    """Whether Triton runs this package's kernels in its interpreter (``TRITON_INTERPRET=1`` when they
    were decorated, at import)."""
    return isinstance(_ragged_prefill_fwd_kernel, InterpretedFunction)


def check_backend(device: torch.device) -> None:
    """Raise ValueError unless the kernels can run on ``device``: CPU tensors need the interpreter."""
    if device.type == "cpu" and not is_interpreted():
        raise ValueError(
            "CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 before penelope.kernels "
            "is imported"
        )


def ragged_launch(q, k_buffer, v_buffer, req_to_token, tiles, status, sm_scale, out, lse, blocks: RaggedBlocks,
                  target: str, work=None):
    """Grid, positional arguments and keyword arguments of one ``_ragged_prefill_fwd_kernel`` launch.

    The launcher and ``compile_report`` both build launches here, so the report compiles exactly
    what the launcher runs. ``target``: ``configs.target_of(q.device)`` (or a report target).
    """
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_buffer.shape[1]
    return_lse = lse is not None
    count_work = work is not None
    # Unused pointer arguments still need a tensor; the constexpr flags keep them untouched.
    args = (
        out, lse if return_lse else out, work if count_work else tiles, q, k_buffer, v_buffer, req_to_token,
        tiles, status,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), out.stride(0), out.stride(1),
        lse.stride(0) if return_lse else 0, lse.stride(1) if return_lse else 0,
        req_to_token.stride(0), min(k_buffer.shape[0], v_buffer.shape[0]), sm_scale * math.log2(math.e),
    )
    kwargs = dict(
        HEAD_DIM=head_dim,
        GROUP=num_q_heads // num_kv_heads,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=blocks.block_m,
        BLOCK_R=blocks.rows,
        BLOCK_N=blocks.block_n,
        # The interpreter's bf16 tl.dot is wrong (bf16 is stored as uint16 there): use fp32 dots.
        DOT_FP32=target == INTERPRETER and q.dtype == torch.bfloat16,
        # fp32 inputs get exact fp32 dots rather than TF32; fp16/bf16 use the backend's default.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        RETURN_LSE=return_lse,
        COUNT_WORK=count_work,
        num_warps=blocks.num_warps,
        num_stages=blocks.num_stages,
        # Contraction on: the kernel's explicit FMAs keep masked and unmasked tiles identical.
        enable_fp_fusion=True,
    )
    return (tiles.shape[0], num_kv_heads), args, kwargs


def run_ragged_prefill(q, k_buffer, v_buffer, req_to_token, tiles, status, sm_scale, out, lse,
                       blocks: RaggedBlocks, target: str, *, compile_only: bool = False) -> None:
    """Launch the kernel over the query ``tiles`` (arguments as ``ragged_launch``), writing ``out``
    and ``lse``; with ``compile_only``, compile it for these arguments without running it."""
    grid, args, kwargs = ragged_launch(q, k_buffer, v_buffer, req_to_token, tiles, status, sm_scale, out, lse,
                                       blocks, target)
    if compile_only:
        _ragged_prefill_fwd_kernel.warmup(*args, grid=grid, **kwargs)
        return
    check_backend(q.device)
    _ragged_prefill_fwd_kernel[grid](*args, **kwargs)
