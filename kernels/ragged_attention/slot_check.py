"""Device-side check of the slots a batch reads: every ``req_to_token`` entry its queries attend to
must name a row of the pool.

A plan (``plan.py``) queues this check once per batch; it writes the number of the first bad slot
(or ``SLOTS_OK``) into a status word that the attention kernel reads before it visits any KV tile,
so a batch with a bad slot reads nothing and nobody waits for the check on the host.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernel import check_backend

# Status of a batch's slot check: no bad slot found. Anything else is the linear index (over the
# batch's checked positions) of the first slot outside the pool. The attention kernel compares the
# status with this value (as the literal 2147483647).
SLOTS_OK = 2**31 - 1


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


def check_slots_launch(req_to_token, rows, status, num_slots: int, max_need: int):
    """Grid, arguments and keyword arguments of the slot check over ``rows`` (int32 ``[n, 3]``)."""
    grid = (rows.shape[0], triton.cdiv(max_need, CHECK_BLOCK))
    args = (status, req_to_token, rows, req_to_token.stride(0), num_slots)
    return grid, args, dict(BLOCK=CHECK_BLOCK, num_warps=4)


def run_slot_check(req_to_token, rows, status, num_slots: int, max_need: int, *, compile_only: bool = False) -> None:
    """Queue the check of ``rows`` (int32 ``[n, 3]``, see ``_check_slots_kernel``) into ``status``;
    with ``compile_only``, compile it for these arguments without running it."""
    grid, args, kwargs = check_slots_launch(req_to_token, rows, status, num_slots, max_need)
    if compile_only:
        _check_slots_kernel.warmup(*args, grid=grid, **kwargs)
        return
    check_backend(req_to_token.device)
    _check_slots_kernel[grid](*args, **kwargs)
