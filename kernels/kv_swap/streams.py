"""Where an exchange's copies are issued: CUDA streams and events, or a host model of them.

The schedule (``schedule.py``) is written against ``Streams``: create side streams, record events,
make a stream wait for an event, issue work on a stream, keep a tensor alive until a stream is done
with it. ``CudaStreams`` maps that onto torch.cuda. ``HostStreams`` runs everything at once on the
CPU (Triton interpreter, torch CPU copies), which is a valid execution of any correctly ordered
schedule; ``RecordingStreams`` does the same and records every call, so tests can check the
ordering itself: which event each copy waits for, and that copies touching the same rows are
ordered (happens-before = program order of each stream + record -> wait edges).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch


class Streams:
    """Interface of the stream/event model an exchange is issued on."""

    def current(self):
        """The stream compute runs on (where the KV being demoted was written)."""
        raise NotImplementedError

    def new_stream(self, name: str):
        """The side stream called ``name`` (the same one on every call)."""
        raise NotImplementedError

    def record(self, stream):
        """An event marking everything issued on ``stream`` so far."""
        raise NotImplementedError

    def wait(self, stream, event) -> None:
        """Work issued on ``stream`` from now on starts after ``event``."""
        raise NotImplementedError

    def issue(self, stream, fn: Callable[[], None], what: CopyRecord | None = None) -> None:
        """Queue ``fn``'s GPU work on ``stream``. ``what`` describes the copy (for recording)."""
        raise NotImplementedError

    def keep_alive(self, tensor: torch.Tensor, stream) -> None:
        """Do not let the allocator reuse ``tensor``'s memory before ``stream``'s queued work ran."""
        raise NotImplementedError


class CudaStreams(Streams):
    """torch.cuda streams and events on ``device``."""

    def __init__(self, device: torch.device):
        self.device = device
        self._side: dict[str, torch.cuda.Stream] = {}

    def current(self):
        return torch.cuda.current_stream(self.device)

    def new_stream(self, name: str):
        # One stream per name for the model's lifetime: exchanges of one direction stay in order.
        if name not in self._side:
            self._side[name] = torch.cuda.Stream(self.device)
        return self._side[name]

    def record(self, stream):
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream, event) -> None:
        stream.wait_event(event)

    def issue(self, stream, fn, what=None) -> None:
        with torch.cuda.stream(stream):
            fn()

    def keep_alive(self, tensor, stream) -> None:
        if tensor.is_cuda:
            tensor.record_stream(stream)


@dataclass(frozen=True)
class CopyRecord:
    """One issued copy: direction (``d2h``/``h2d``), exchange step, layer (-1: every layer),
    which buffers of the pools, the rows read and written, and the engine that moves them
    (``copy_engine``: torch copies of contiguous runs, no SMs; ``kernel``: the Triton slot copy;
    ``naive``: torch indexed copies of every buffer)."""

    kind: str
    step: int
    layer: int
    buffers: tuple[int, ...]
    src_slots: np.ndarray
    dst_slots: np.ndarray
    engine: str


class HostStreams(Streams):
    """Everything runs when issued, on the host; streams are names and events are numbers."""

    def __init__(self):
        self._events = 0

    def current(self):
        return "current"

    def new_stream(self, name: str):
        return name

    def record(self, stream):
        self._events += 1
        return self._events

    def wait(self, stream, event) -> None:
        pass

    def issue(self, stream, fn, what=None) -> None:
        fn()

    def keep_alive(self, tensor, stream) -> None:
        pass


@dataclass(frozen=True)
class Op:
    """A recorded call: ``kind`` is ``record``, ``wait``, ``copy``, ``compute`` or ``keep_alive``."""

    kind: str
    stream: str
    event: int | None = None
    copy: CopyRecord | None = None
    label: str = ""


@dataclass
class RecordingStreams(HostStreams):
    """``HostStreams`` that records every call in ``ops``, in issue order."""

    ops: list[Op] = field(default_factory=list)

    def __post_init__(self):
        super().__init__()

    def record(self, stream):
        event = super().record(stream)
        self.ops.append(Op("record", stream, event))
        return event

    def wait(self, stream, event) -> None:
        self.ops.append(Op("wait", stream, event))

    def issue(self, stream, fn, what=None) -> None:
        self.ops.append(Op("copy" if what is not None else "compute", stream, copy=what))
        fn()

    def keep_alive(self, tensor, stream) -> None:
        self.ops.append(Op("keep_alive", stream, label=f"{tuple(tensor.shape)}"))

    def compute(self, label: str, stream="current") -> int:
        """Record a piece of compute on ``stream`` (default: the current stream; a test's stand-in
        for a layer or a forward); returns its index in ``ops``."""
        self.ops.append(Op("compute", stream, label=label))
        return len(self.ops) - 1

    def happens_before(self) -> np.ndarray:
        """``[n, n]`` bool over ``ops``: True at (i, j) when op i is ordered before op j."""
        n = len(self.ops)
        before = np.zeros((n, n), dtype=bool)
        last_on: dict[str, int] = {}
        recorded_at: dict[int, int] = {}
        for j, op in enumerate(self.ops):
            preds = []
            if op.stream in last_on:
                preds.append(last_on[op.stream])
            if op.kind == "wait":
                preds.append(recorded_at[op.event])
            for i in preds:
                before[i, j] = True
                before[:, j] |= before[:, i]
            if op.kind == "record":
                recorded_at[op.event] = j
            last_on[op.stream] = j
        return before
