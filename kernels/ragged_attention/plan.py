"""The per-batch plan of ragged prefill attention, made once per forward batch and shared by every layer.

``plan_ragged_prefill`` does the per-batch work from host-side segment lists: it checks the
segments, cuts the query tiles, uploads them without blocking and queues the device-side check of
the slots the batch reads (``slot_check.py``). Nothing in a layer's call then waits for the GPU;
``check_plan_fits`` is the layer's host-side check that the plan belongs to its call.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..host_transfer import DeviceFlag, upload
from .configs import RaggedBlocks, ragged_attention_blocks, target_of
from .segments import (
    LENGTH,
    POS_START,
    REQ_ROW,
    build_query_tiles,
    check_segments,
    check_table,
    host_segments,
)
from .slot_check import SLOTS_OK, run_slot_check


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
        run_slot_check(req_to_token, rows_dev, status.value, num_slots, int(rows[:, 1].max()))
    status.publish()
    plan = RaggedPlan(req_to_token, req_to_token._version, segments, device, num_tokens, num_slots, blocks, target,
                      tiles_dev, rows, status)
    if check or (check is None and device.type == "cpu"):
        plan.check()
    return plan


def check_plan_fits(plan: RaggedPlan, q, k_buffer, req_to_token, segments) -> None:
    """Raise ValueError unless ``plan`` fits this layer's call: host-side checks only, no device sync."""
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
