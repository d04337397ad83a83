"""Issue an exchange's copies so that they overlap compute: side streams, events, one layer at a time.

An exchange (``plan_exchange``) is a list of copy steps, device -> host (``d2h``) and host -> device
(``h2d``); steps of one direction run in order, and a step may wait for an earlier step of the other
direction (``after``: a GPU slot must be copied out before a row is copied in, a buffer slot must
be copied in before it is written again). Every such conflict is between rows of the SAME buffer,
so the rotation can run layer by layer: layer l's steps depend only on layer l's earlier steps.

The schedule:

- the d2h copies run on one side stream and the h2d copies on another (PCIe is full duplex); both
  start after an event recorded on the compute stream when the exchange is issued (the rows being
  demoted were written by compute queued before), never after a full-stream barrier;
- layers are issued in order; step s of layer l waits for the event of step ``after`` of layer l
  only; after its last step, each direction records a per-layer event;
- ``SwapHandle.wait_layer(l)`` makes a stream (compute) wait for layer l's two events: a prefill's
  layer l starts as soon as layer l's rows are in, while later layers still load;
  ``wait_all()`` waits for the last events (everything);
- within a step, rows whose source and destination slots both run consecutively for at least
  ``min_run`` rows are moved by the copy engines (torch ``copy_`` of a slice, a cudaMemcpyAsync:
  no SM is used, nothing competes with compute); the remaining scattered rows of the layer go
  through one launch of the Triton slot-copy kernel.

The slot lists the kernel needs are uploaded once (pinned, non-blocking) on the compute stream
before the side streams' start event, and kept alive on both side streams.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..host_transfer import upload
from .kernel import PoolPair, launch_copy, pointer_table
from .streams import CopyRecord, Streams

# Default shortest run (rows) moved by the copy engine: one cache block of 64 tokens. A run is
# one cudaMemcpyAsync per buffer, so shorter runs would cost more in launches than they save; the
# threshold is an estimate, to be measured on a GPU (microbench/bench_kv_swap.py).
MIN_RUN = 64


def contiguous_runs(src_slots: np.ndarray, dst_slots: np.ndarray, min_run: int | None):
    """Split a copy of rows ``src_slots[i] -> dst_slots[i]`` into runs and scattered rows.

    A run is a maximal stretch where both slot lists increase by one from row to row. Returns
    ``(runs, rest)``: ``runs`` a list of ``(src_start, dst_start, rows)`` for the runs of at least
    ``min_run`` rows (none when ``min_run`` is None), ``rest`` int64 indices into the slot lists of
    every other row, in order.
    """
    n = len(src_slots)
    if n == 0 or min_run is None:
        return [], np.arange(n, dtype=np.int64)
    breaks = np.flatnonzero((np.diff(src_slots) != 1) | (np.diff(dst_slots) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [n]])
    long = ends - starts >= min_run
    runs = [(int(src_slots[s]), int(dst_slots[s]), int(e - s)) for s, e in zip(starts[long], ends[long], strict=True)]
    mask = np.ones(n, dtype=bool)
    for s, e in zip(starts[long], ends[long], strict=True):
        mask[s:e] = False
    return runs, np.flatnonzero(mask)


def layer_groups(n_buffers: int, num_layers: int | None = None) -> list[tuple[int, ...]]:
    """Buffer indices of each layer in a pool of ``n_buffers`` buffers listed as SGLang and the
    engine list them: every layer's K, then every layer's V (``num_layers`` default ``n // 2``).
    Layer l is ``(l, l + L, ...)``."""
    num_layers = n_buffers // 2 if num_layers is None else num_layers
    if num_layers < 1 or n_buffers % num_layers:
        raise ValueError(f"{n_buffers} buffers do not split into {num_layers} layers")
    return [tuple(range(layer, n_buffers, num_layers)) for layer in range(num_layers)]


@dataclass
class SwapHandle:
    """The events of an issued exchange. ``layer_events[l]``: (d2h, h2d) events after layer l's
    copies (None where a direction had nothing to copy); ``last``: the last event of each stream."""

    streams: Streams
    layer_events: list[tuple[object, object]]
    last: tuple[object, ...]

    def wait_layer(self, layer: int, stream=None) -> None:
        """Make ``stream`` (default: the compute stream) wait until layer ``layer``'s rows moved."""
        stream = self.streams.current() if stream is None else stream
        for event in self.layer_events[layer]:
            if event is not None:
                self.streams.wait(stream, event)

    def wait_all(self, stream=None) -> None:
        """Make ``stream`` (default: the compute stream) wait until every copy is done."""
        stream = self.streams.current() if stream is None else stream
        for event in self.last:
            self.streams.wait(stream, event)


def _reorder(pool: Sequence[torch.Tensor], groups) -> list[torch.Tensor]:
    return [pool[index] for group in groups for index in group]


def issue_exchange(
    steps,
    pools: dict[str, tuple[PoolPair, Sequence[torch.Tensor], Sequence[torch.Tensor]]],
    groups: list[tuple[int, ...]],
    streams: Streams,
    device: torch.device,
    min_run: int | None = MIN_RUN,
    after: tuple = (),
) -> SwapHandle:
    """Issue ``steps`` (``CopyStep``s, checked) layer by layer on two side streams; see the module.

    ``pools``: for ``"d2h"`` and ``"h2d"``, the checked pool pair and the source and destination
    buffer lists. ``groups``: buffer indices per layer (``layer_groups``). ``after``: events both
    side streams wait for first besides the compute stream's (the ``last`` events of an earlier
    exchange that compute has not waited for). Returns the handle whose events later work waits on.
    """
    current = streams.current()
    if any(pair.src_stride != pair.row_bytes or pair.dst_stride != pair.row_bytes for pair, _, _ in pools.values()):
        # Padded slots: a run is not one contiguous block of memory, so no copy-engine runs.
        min_run = None
    plans = []
    flat_parts = []
    offset = 0
    for step in steps:
        runs, rest = contiguous_runs(step.src_slots, step.dst_slots, min_run)
        plans.append((runs, rest, offset))
        if len(rest):
            flat_parts += [step.src_slots[rest], step.dst_slots[rest]]
            offset += 2 * len(rest)
    # One upload of every step's scattered slots, and per pool one pointer table in layer order,
    # both queued on the compute stream before the side streams' start event.
    flat = upload(np.concatenate(flat_parts).astype(np.int64), device) if flat_parts else None
    tables = {}
    for kind, (_, src, dst) in pools.items():
        tables[kind] = (pointer_table(_reorder(src, groups), device), pointer_table(_reorder(dst, groups), device))

    side = {"d2h": streams.new_stream("d2h"), "h2d": streams.new_stream("h2d")}
    start = streams.record(current)
    for stream in side.values():
        streams.wait(stream, start)
        for event in after:
            streams.wait(stream, event)
        if flat is not None:
            streams.keep_alive(flat, stream)

    layer_events = []
    for layer, group in enumerate(groups):
        done = []
        used = {"d2h": False, "h2d": False}
        for index, step in enumerate(steps):
            stream = side[step.kind]
            if step.after >= 0:
                streams.wait(stream, done[step.after])
            runs, rest, at = plans[index]
            pool_pair, src, dst = pools[step.kind]
            for src_start, dst_start, rows in runs:
                record = CopyRecord(step.kind, index, layer, group, np.arange(src_start, src_start + rows),
                                    np.arange(dst_start, dst_start + rows), "copy_engine")
                streams.issue(stream, _run_copy(src, dst, group, src_start, dst_start, rows), record)
            if len(rest):
                record = CopyRecord(step.kind, index, layer, group, step.src_slots[rest], step.dst_slots[rest],
                                    "kernel")
                src_table, dst_table = tables[step.kind]
                cut = slice(layer * len(group), (layer + 1) * len(group))
                streams.issue(stream, _kernel_copy(pool_pair, src_table[cut], dst_table[cut], flat[at : at + len(rest)],
                                                   flat[at + len(rest) : at + 2 * len(rest)], device), record)
            used[step.kind] = used[step.kind] or bool(runs) or bool(len(rest))
            done.append(streams.record(stream))
        layer_events.append(tuple(streams.record(side[kind]) if used[kind] else None for kind in ("d2h", "h2d")))
    last = tuple(streams.record(stream) for stream in side.values())
    return SwapHandle(streams, layer_events, last)


def _run_copy(src, dst, group, src_start, dst_start, rows):
    def run():
        for index in group:
            dst[index][dst_start : dst_start + rows].copy_(src[index][src_start : src_start + rows], non_blocking=True)

    return run


def _kernel_copy(pool_pair: PoolPair, src_table, dst_table, src_slots, dst_slots, device):
    def run():
        launch_copy(pool_pair, None, None, src_slots, dst_slots, device, tables=(src_table, dst_table))

    return run
