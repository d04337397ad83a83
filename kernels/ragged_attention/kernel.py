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

The per-batch work (host checks of the segments, query tiles, the check of the slots the batch
reads) is a ``RaggedPlan``, made once per forward batch from host-side segment lists and shared
by every layer: ``plan_ragged_prefill``. Nothing in a layer's call waits for the GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ..host_transfer import DeviceFlag, upload
from .configs import INTERPRETER, RaggedBlocks, ragged_attention_blocks, target_of
from .segments import (
    LENGTH,
    POS_START,
    REQ_ROW,
    build_query_tiles,
    check_layer_inputs,
    check_segments,
    check_table,
    host_segments,
)

# Status of a batch's slot check: no bad slot found. Anything else is the linear index (over the
# batch's checked positions) of the first slot outside the pool.
SLOTS_OK = 2**31 - 1


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


@triton.jit(do_not_specialize=["stride_req", "num_slots"])
def _check_slots_kernel(
    status_ptr,
    req_to_token_ptr,
    rows_ptr,
    stride_req,
    num_slots,
    BLOCK: tl.constexpr,
):
    """Program (i, c): positions ``c * BLOCK ..`` of the i-th request row the batch reads.

    ``rows_ptr``: int32 ``[n, 3]`` rows ``(req_row, need, offset)``: positions ``0 .. need - 1`` of
    ``req_row`` are read by the batch's queries; ``offset`` numbers them across the batch. The
    smallest number of a slot outside ``[0, num_slots)`` goes to ``status`` (atomic min).
    """
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    req_row = tl.load(rows_ptr + i * 3)
    need = tl.load(rows_ptr + i * 3 + 1)
    offset = tl.load(rows_ptr + i * 3 + 2)
    pos = chunk * BLOCK + tl.arange(0, BLOCK)
    in_row = pos < need
    slots = tl.load(req_to_token_ptr + req_row.to(tl.int64) * stride_req + pos, mask=in_row, other=0)
    bad = in_row & ((slots < 0) | (slots >= num_slots))
    first = tl.min(tl.where(bad, offset + pos, 2147483647), 0)
    tl.atomic_min(status_ptr, first, mask=first < 2147483647)


# Positions each program of the slot check covers.
CHECK_BLOCK = 1024


def _is_interpreted(kernel) -> bool:
    return isinstance(kernel, InterpretedFunction)


def _check_backend(device: torch.device) -> None:
    if device.type == "cpu" and not _is_interpreted(_ragged_prefill_fwd_kernel):
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


def check_slots_launch(req_to_token, rows, status, num_slots: int, max_need: int):
    """Grid, arguments and keyword arguments of the slot check over ``rows`` (int32 ``[n, 3]``)."""
    grid = (rows.shape[0], triton.cdiv(max_need, CHECK_BLOCK))
    args = (status, req_to_token, rows, req_to_token.stride(0), num_slots)
    return grid, args, dict(BLOCK=CHECK_BLOCK, num_warps=4)


@dataclass(frozen=True, eq=False)
class RaggedPlan:
    """The per-batch half of ``ragged_prefill_attention``: checked segments, query tiles on the
    device, and the device-side check of every slot the batch's queries read.

    Made once per forward batch by ``plan_ragged_prefill`` and passed as ``plan=`` to every layer's
    call, which then does no per-batch work and no host synchronisation. The plan records
    ``req_to_token``'s version counter (bumped by every in-place torch write): a call whose table was
    written after planning is refused, since the slots were checked before the write.
    """

    req_to_token: torch.Tensor  # int32 [R, max_len], the table that was checked
    table_version: int  # req_to_token._version when the plan was made
    segments: object  # the segments object the plan was made from (identity is checked)
    device: torch.device  # of every layer's q and pool
    num_tokens: int  # query rows T that the segments cover
    num_slots: int  # slots S every read slot was checked against
    blocks: RaggedBlocks  # tile sizes the query tiles were cut for
    target: str  # pinned-configuration table the blocks come from
    tiles: torch.Tensor  # int32 [n_tiles, 4] query tiles on `device`
    rows: np.ndarray  # int64 [n, 3] (req_row, need, offset): the rows and positions checked
    status: DeviceFlag  # SLOTS_OK, or the number of the first slot outside the pool

    def poll(self) -> bool:
        """Whether the slot check is known to have passed; False while it is still running.
        Never blocks. Raises ValueError when it found a slot outside the pool."""
        value = self.status.poll()
        if value is None:
            return False
        self._raise_if_bad(value)
        return True

    def check(self) -> None:
        """Wait for the slot check (a host sync on a GPU) and raise ValueError if it failed."""
        self._raise_if_bad(self.status.wait())

    def _raise_if_bad(self, value: int) -> None:
        if value == SLOTS_OK:
            return
        i = int(np.searchsorted(self.rows[:, 2], value, side="right")) - 1
        row, pos = int(self.rows[i, 0]), value - int(self.rows[i, 2])
        # Read now (the error path may sync): the table may have changed since the check ran.
        slot = int(self.req_to_token[row, pos])
        if 0 <= slot < self.num_slots:
            raise ValueError(f"req_to_token[{row}, {pos}] was outside the pool's {self.num_slots} slots when the "
                             f"batch was checked (it holds {slot} now)")
        raise ValueError(f"req_to_token[{row}, {pos}] = {slot} is outside the pool's {self.num_slots} slots")


def _read_rows(segs: np.ndarray) -> np.ndarray:
    """int64 ``[n, 3]`` rows ``(req_row, need, offset)``: each request row the live segments read,
    the positions ``0 .. need - 1`` its queries attend to, and their running count."""
    live = segs[segs[:, LENGTH] > 0]
    if live.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    rows, inverse = np.unique(live[:, REQ_ROW], return_inverse=True)
    need = np.zeros(len(rows), dtype=np.int64)
    np.maximum.at(need, inverse, live[:, POS_START] + live[:, LENGTH])
    offset = np.cumsum(need) - need
    if int(need.sum()) >= SLOTS_OK:
        raise ValueError(f"the batch reads {int(need.sum())} slots, more than the check numbers in int32")
    return np.stack([rows, need, offset], axis=1)


def plan_ragged_prefill(
    req_to_token: torch.Tensor,
    segments,
    *,
    num_tokens: int,
    num_slots: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype | None = None,
    check: bool | None = None,
) -> RaggedPlan:
    """Check one batch and cut its query tiles, once for all the layers that attend over it.

    Args:
        req_to_token: int32 ``[R, max_len]``, pool slot of (request row, absolute position), on the
            device of the layers' q and pools.
        segments: rows ``(req_row, q_start, pos_start, length)``, as in ``ragged_prefill_attention``,
            preferably HOST-SIDE (a numpy integer array, a list of 4-tuples or an int32 CPU tensor):
            then planning never waits for the GPU. An int32 tensor on the table's device works too,
            at the cost of one copy to the host (a sync).
        num_tokens: query rows ``T`` of every layer's q.
        num_slots: pool slots ``S``: every slot a query reads must lie in ``[0, S)``, and every
            layer's pool must have at least ``S`` rows.
        num_q_heads, num_kv_heads, head_dim: the layers' attention shape (the query tiles are cut
            for the pinned tile sizes of ``head_dim``, the group size and the device's target).
        dtype: the layers' q dtype; only fp32 on a GPU has other tiles (None: fp16/bf16).
        check: wait for the device-side slot check and raise here (True); leave it to
            ``plan.check()`` or ``plan.poll()`` (False); default: True on the CPU, where nothing is
            asynchronous, False on a GPU.

    Work: the segments are checked on the host (O(N log N) in segments); tiles and the list of rows
    to check are uploaded in one non-blocking copy from pinned memory; one launch checks the slots of
    positions ``0 .. end of the last query`` of the batch's rows only (never the whole table). While
    the check runs, layers may already be queued: a launch after a failed check visits no KV tile
    and writes NaN. The check's result reaches the host without a sync (``poll``).

    Raises:
        ValueError: bad shapes or types, segments that overlap, leave query rows uncovered or run
        past q or ``req_to_token``; with ``check``, slots outside the pool.
    """
    if min(num_q_heads, num_kv_heads, head_dim) <= 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"q heads ({num_q_heads}) must be a positive multiple of kv heads ({num_kv_heads}), "
            f"head_dim ({head_dim}) positive"
        )
    check_table(req_to_token)
    segs = host_segments(segments, req_to_token.device)
    num_req_rows, max_len = req_to_token.shape
    check_segments(segs, num_tokens, num_req_rows, max_len)
    device = req_to_token.device
    target = target_of(device)
    blocks = ragged_attention_blocks(head_dim, num_q_heads // num_kv_heads, target, dtype)
    tiles = build_query_tiles(segs, blocks.block_m)
    rows = _read_rows(segs)
    # One upload for the tiles and the rows to check.
    flat = upload(np.concatenate([tiles.reshape(-1), rows.reshape(-1)]).astype(np.int32), device)
    tiles_dev = flat[: tiles.size].view(-1, 4)
    rows_dev = flat[tiles.size :].view(-1, 3)
    status = DeviceFlag(device, SLOTS_OK)
    if len(rows):
        _check_backend(device)
        grid, args, kwargs = check_slots_launch(req_to_token, rows_dev, status.value, num_slots, int(rows[:, 1].max()))
        _check_slots_kernel[grid](*args, **kwargs)
    status.publish()
    plan = RaggedPlan(req_to_token, req_to_token._version, segments, device, num_tokens, num_slots, blocks, target,
                      tiles_dev, rows, status)
    if check or (check is None and device.type == "cpu"):
        plan.check()
    return plan


def _check_plan(plan: RaggedPlan, q, k_buffer, req_to_token, segments) -> None:
    """That ``plan`` fits this layer's call: host-side checks only, no device sync."""
    if not isinstance(plan, RaggedPlan):
        raise ValueError(f"plan must be a RaggedPlan, got {type(plan).__name__}")
    if req_to_token is not plan.req_to_token or segments is not plan.segments:
        raise ValueError("plan was built for other req_to_token or segments tensors: build one plan per batch")
    if req_to_token._version != plan.table_version:
        raise ValueError(
            f"req_to_token was written in place after the plan checked it (version {plan.table_version} -> "
            f"{req_to_token._version}): its slots are unchecked; build a new plan for the new table"
        )
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
    blocks = ragged_attention_blocks(head_dim, group, plan.target, q.dtype)
    if blocks != plan.blocks:
        raise ValueError(
            f"plan's tiles {plan.blocks} do not fit head_dim {head_dim} with {group} q heads per kv "
            f"head and {q.dtype} inputs, which need {blocks} (plan fp32 batches with dtype=torch.float32)"
        )


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
        _check_plan(plan, q, k_buffer, req_to_token, segments)
    out = _checked_output(out, "out", (num_tokens, num_q_heads, head_dim), q.dtype, q.device)
    if return_lse:
        lse_out = _checked_output(lse_out, "lse_out", (num_tokens, num_q_heads), torch.float32, q.device)
    if num_tokens > 0 and plan.tiles.shape[0] > 0:
        _check_backend(q.device)
        grid, args, kwargs = ragged_launch(q, k_buffer, v_buffer, req_to_token, plan.tiles, plan.status.value,
                                           sm_scale, out, lse_out if return_lse else None, plan.blocks, plan.target)
        _ragged_prefill_fwd_kernel[grid](*args, **kwargs)
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
    if _is_interpreted(_ragged_prefill_fwd_kernel):
        return None
    # Tensors of the layers' dtypes and strides; nothing is launched, so one row each suffices.
    q = torch.empty((1, num_q_heads, head_dim), dtype=k_buffer.dtype, device=device)
    ints = torch.zeros(8, dtype=torch.int32, device=device)
    lse = torch.empty((1, num_q_heads), dtype=torch.float32, device=device) if return_lse else None
    grid, args, kwargs = ragged_launch(q, k_buffer, k_buffer, req_to_token, ints.view(2, 4), ints[:1], 1.0, q,
                                       lse, blocks, target)
    _ragged_prefill_fwd_kernel.warmup(*args, grid=grid, **kwargs)
    grid, args, kwargs = check_slots_launch(req_to_token, ints[:6].view(2, 3), ints[:1], k_buffer.shape[0], 1)
    _check_slots_kernel.warmup(*args, grid=grid, **kwargs)
    return blocks
