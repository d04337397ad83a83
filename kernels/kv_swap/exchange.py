"""Chunked exchange of GPU and host KV rows through a swap buffer (docs/design.md section 3, two tiers).

When both tiers are full, loading ``n`` host rows onto the GPU means demoting ``n`` GPU rows to the
host at the same time, with no free slot on either side except a reserved host swap buffer. The
rotation runs chunk by chunk: chunk ``i`` of the outgoing GPU rows is copied into buffer slots
(device -> host), the GPU slots it freed receive chunk ``i`` of the incoming host rows (host ->
device), and the host slots just emptied join the buffer for the next chunks. Host slots are
therefore indirected: an outgoing row ends at a host slot that used to belong to an incoming row or
to the buffer, and the buffer itself moves.

Two parts, kept apart so the cache can plan without tensors:
- ``plan_exchange`` (pure, numpy): the copy steps, their ordering constraints, the new host slot of
  every outgoing row and the new buffer slots.
- ``run_exchange``: runs a plan on real pools with a copy function chosen by name (``"triton"``:
  the stream schedule of ``schedule.py``, copy engines and the slot-copy kernel; ``"naive"``: the
  torch reference).

The buffer is a FIFO of host slots. With ``chunk_size == len(buffer)`` (the paper's rotation) each
device -> host step must wait for the previous host -> device step, which emptied the slots it
writes. With a buffer of two chunks or more, the device -> host copy of chunk ``i + 1`` writes
slots freed two steps earlier, so on a GPU it overlaps the host -> device copy of chunk ``i``: each
direction runs on its own stream and events order exactly the dependent steps, layer by layer
(``schedule.py``). Both directions first wait for an event recorded on the current stream (the
compute that wrote the KV being demoted); later compute waits for the layers it reads.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from .kernel import check_pools, launch_device
from .naive import naive_copy_unchecked
from .schedule import MIN_RUN, SwapHandle, issue_exchange, layer_groups
from .streams import CopyRecord, CudaStreams, HostStreams, Streams

D2H = "d2h"
H2D = "h2d"
COPY_FUNCTIONS = ("triton", "naive")


@dataclass(frozen=True)
class CopyStep:
    """One copy of an exchange.

    ``kind``: ``"d2h"`` (GPU pool -> host pool) or ``"h2d"``. ``src_slots``, ``dst_slots``: int64
    ``[m]`` slots in the source and destination pools. ``chunk``: chunk index. ``after``: index of
    an earlier step of the other direction that must finish before this one starts, or -1. Steps of
    one direction run in list order.
    """

    kind: str
    chunk: int
    src_slots: np.ndarray
    dst_slots: np.ndarray
    after: int


@dataclass(frozen=True)
class ExchangePlan:
    """Result of ``plan_exchange``.

    ``steps``: the copies, in an order that is valid on one stream. ``out_host_slots``: int64
    ``[n]``, the host slot where outgoing row ``i`` (GPU slot ``out_gpu_slots[i]``) ends.
    ``in_gpu_slots``: int64 ``[n]``, the GPU slot where incoming row ``i`` ends (the outgoing row's
    old slot). ``buffer_slots``: int64 ``[B]``, the host slots of the swap buffer afterwards (no live
    data).
    """

    steps: tuple[CopyStep, ...]
    out_host_slots: np.ndarray
    in_gpu_slots: np.ndarray
    buffer_slots: np.ndarray


def _as_slots(name: str, slots) -> np.ndarray:
    if isinstance(slots, torch.Tensor):
        slots = slots.detach().cpu().numpy()
    arr = np.asarray(slots)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{name} must be a 1-D array of integer slots, got {arr.dtype} {arr.shape}")
    arr = arr.astype(np.int64)
    if arr.size and arr.min() < 0:
        raise ValueError(f"{name} contains the negative slot {int(arr.min())}")
    return arr


def _first_duplicate(arr: np.ndarray) -> int | None:
    values, counts = np.unique(arr, return_counts=True)
    repeated = values[counts > 1]
    return int(repeated[0]) if repeated.size else None


def plan_exchange(out_gpu_slots, in_host_slots, buffer_slots, chunk_size: int | None = None) -> ExchangePlan:
    """Plan the swap-buffer rotation that moves ``n`` GPU rows to the host and ``n`` host rows in.

    Args:
        out_gpu_slots: ``[n]`` GPU slots of the rows to demote, distinct.
        in_host_slots: ``[n]`` host slots of the rows to load, distinct.
        buffer_slots: ``[B]`` host slots of the swap buffer (no live data), disjoint from
            ``in_host_slots``; ``B >= 1`` when ``n > 0``.
        chunk_size: rows per chunk, ``1 <= chunk_size <= B``; default ``B`` (the paper's rotation).
            ``chunk_size <= B // 2`` lets the two directions overlap on a GPU.

    Returns an ``ExchangePlan``; raises ``ValueError`` on invalid slots. Rows are token slots (any
    granularity): the caller passes every token slot of the blocks it moves.
    """
    out_gpu = _as_slots("out_gpu_slots", out_gpu_slots)
    in_host = _as_slots("in_host_slots", in_host_slots)
    buffer = _as_slots("buffer_slots", buffer_slots)
    n = out_gpu.size
    if in_host.size != n:
        raise ValueError(f"an exchange moves as many rows each way: {n} outgoing but {in_host.size} incoming")
    if (dup := _first_duplicate(out_gpu)) is not None:
        raise ValueError(f"out_gpu_slots lists GPU slot {dup} twice")
    if (dup := _first_duplicate(np.concatenate([in_host, buffer]))) is not None:
        raise ValueError(f"host slot {dup} appears twice in in_host_slots and buffer_slots")
    if chunk_size is None:
        chunk_size = max(buffer.size, 1)
    if not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    if n and chunk_size > buffer.size:
        raise ValueError(f"chunk_size {chunk_size} exceeds the swap buffer's {buffer.size} slots")

    # FIFO of (host slot, index of the h2d step that emptied it, -1 for the original buffer).
    fifo = deque((int(slot), -1) for slot in buffer)
    steps: list[CopyStep] = []
    out_host = np.empty(n, dtype=np.int64)
    for chunk, start in enumerate(range(0, n, chunk_size)):
        rows = slice(start, min(start + chunk_size, n))
        taken = [fifo.popleft() for _ in range(rows.stop - rows.start)]
        out_host[rows] = [slot for slot, _ in taken]
        # Writing a buffer slot must wait until the step that read its previous row is done.
        wait = max(freed_by for _, freed_by in taken)
        steps.append(CopyStep(D2H, chunk, out_gpu[rows].copy(), out_host[rows].copy(), wait))
        # The GPU slots are overwritten only after their rows were copied out.
        steps.append(CopyStep(H2D, chunk, in_host[rows].copy(), out_gpu[rows].copy(), len(steps) - 1))
        fifo.extend((int(slot), len(steps) - 1) for slot in in_host[rows])
    new_buffer = np.array([slot for slot, _ in fifo], dtype=np.int64)
    return ExchangePlan(tuple(steps), out_host, out_gpu.copy(), new_buffer)


def _check_plan_ranges(plan: ExchangePlan, gpu_rows: int, host_rows: int) -> None:
    for i, step in enumerate(plan.steps):
        src_rows, dst_rows = (gpu_rows, host_rows) if step.kind == D2H else (host_rows, gpu_rows)
        for what, slots, rows in (("source", step.src_slots, src_rows), ("destination", step.dst_slots, dst_rows)):
            if slots.size and (slots.min() < 0 or slots.max() >= rows):
                raise ValueError(f"step {i} ({step.kind}) has a {what} slot outside the pool's [0, {rows})")


def run_exchange(
    plan: ExchangePlan,
    gpu_pool: Sequence[torch.Tensor],
    host_pool: Sequence[torch.Tensor],
    copy: str = "triton",
    *,
    num_layers: int | None = None,
    min_run: int | None = MIN_RUN,
    streams: Streams | None = None,
    wait: bool = True,
    after: tuple = (),
) -> SwapHandle | None:
    """Run a plan from ``plan_exchange`` on real pools.

    Args:
        plan: the exchange to run.
        gpu_pool, host_pool: lists of per-layer buffers ``[slots, H, D]`` (every layer's K, then
            every layer's V), same dtype and row shape. With ``copy="triton"`` the GPU pool is on a
            GPU and the host pool pinned, or both are CPU tensors under ``TRITON_INTERPRET=1``;
            ``"naive"`` accepts any placement.
        copy: ``"triton"`` (``schedule.issue_exchange``: side streams ordered by events, layer by
            layer, contiguous runs of at least ``min_run`` rows by the copy engines, the rest by the
            slot-copy kernel; ``min_run=None``: the kernel only) or ``"naive"`` (torch indexed copies
            on the current stream, in list order; through ``streams`` when one is given, after
            ``after``).
        num_layers: layers of the pools (default ``len(gpu_pool) // 2``): the unit of ``wait_layer``.
        streams: the stream model (``"triton"`` default: CUDA streams for GPU pools, ``HostStreams``
            otherwise; ``"naive"`` default: none, the copies run directly on the current stream).
        wait: make the current stream wait for every copy before returning (an event wait, not a
            barrier); False leaves that to the returned handle (``wait_layer`` / ``wait_all``).
        after: events the copies wait for besides the current stream's work (with ``wait=False``,
            pass the previous exchange's ``handle.last`` so that exchanges stay ordered).

    Returns the ``SwapHandle`` whose events later work waits on (None for an empty plan or for
    ``"naive"`` without a stream model).
    Raises ``ValueError`` before copying anything when the pools or the plan's slots are invalid.
    """
    if copy not in COPY_FUNCTIONS:
        raise ValueError(f"unknown copy function {copy!r}; choose one of {', '.join(COPY_FUNCTIONS)}")
    d2h_pools = check_pools(gpu_pool, host_pool)
    h2d_pools = check_pools(host_pool, gpu_pool)
    _check_plan_ranges(plan, d2h_pools.src_rows, d2h_pools.dst_rows)
    groups = layer_groups(len(gpu_pool), num_layers)
    if not plan.steps:
        return None
    pools = {D2H: (d2h_pools, gpu_pool, host_pool), H2D: (h2d_pools, host_pool, gpu_pool)}

    if copy == "naive":
        # Torch ops on the current stream, in list order: the one-stream order is valid.
        if streams is None:
            for step in plan.steps:
                _, src, dst = pools[step.kind]
                naive_copy_unchecked(src, dst, torch.from_numpy(step.src_slots), torch.from_numpy(step.dst_slots))
            return None
        return _issue_naive(plan.steps, pools, len(groups), streams, after, wait)

    device = launch_device(gpu_pool, host_pool)
    if streams is None:
        streams = CudaStreams(device) if device.type == "cuda" else HostStreams()
    handle = issue_exchange(plan.steps, pools, groups, streams, device, min_run, after)
    if wait:
        handle.wait_all()
    return handle


def _issue_naive(steps, pools, num_layers: int, streams: Streams, after: tuple, wait: bool) -> SwapHandle:
    """The naive copies issued through a stream model: on the current stream, after ``after``;
    the handle's events mark the end of all of them (every layer waits for the whole plan)."""
    current = streams.current()
    for event in after:
        streams.wait(current, event)
    for index, step in enumerate(steps):
        _, src, dst = pools[step.kind]
        record = CopyRecord(step.kind, index, -1, tuple(range(len(src))), step.src_slots, step.dst_slots, "naive")
        streams.issue(current, partial(naive_copy_unchecked, src, dst, torch.from_numpy(step.src_slots),
                                       torch.from_numpy(step.dst_slots)), record)
    done = streams.record(current)
    handle = SwapHandle(streams, [(done, None)] * num_layers, (done,))
    if wait:
        handle.wait_all()
    return handle


def exchange_kv(
    gpu_pool: Sequence[torch.Tensor],
    host_pool: Sequence[torch.Tensor],
    out_gpu_slots,
    in_host_slots,
    buffer_slots,
    chunk_size: int | None = None,
    copy: str = "triton",
) -> ExchangePlan:
    """Plan and run an exchange (``plan_exchange`` then ``run_exchange``); returns the plan."""
    plan = plan_exchange(out_gpu_slots, in_host_slots, buffer_slots, chunk_size)
    run_exchange(plan, gpu_pool, host_pool, copy)
    return plan
