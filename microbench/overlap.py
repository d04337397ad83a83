"""Whether a copy hides behind compute: both issued together, timed against each alone.

The copy is issued beside the main stream (``SideStream.start``: a CUDA side stream on a GPU, a
thread on the CPU) and the compute on the main stream right after, before anything waits; the main
stream then waits for the copy. The span from before the copy to after the wait is ``both_s``:
``max(compute, copy)`` when they overlap entirely, their sum when they run one after the other.
``overlap_fraction`` = (compute + copy - both) / min(compute, copy): 1 when the shorter one was
hidden entirely, 0 when they were serialized.
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Callable

import torch
from timing import time_calls

Join = Callable[[], None]


class SideStream:
    """Where a copy runs beside the main stream's work."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def start(self, fn: Callable[[], object]) -> Join:
        """Issue ``fn`` beside the main stream (after the work already queued there); returns the
        call that makes the main stream wait for it."""
        if self.stream is None:
            thread = threading.Thread(target=fn)
            thread.start()
            return thread.join
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            fn()
        done = self.stream.record_event()
        return lambda: main.wait_event(done)


def overlap_figures(compute_s: float, copy_s: float, both_s: float) -> dict:
    """The three times and the share of the shorter one that was hidden."""
    hidden = compute_s + copy_s - both_s
    return {"compute_s": compute_s, "copy_s": copy_s, "both_s": both_s, "hidden_s": hidden,
            "overlap_fraction": hidden / min(compute_s, copy_s)}


def measure_overlap(compute: Callable[[], object], start_copy: Callable[[], Join], device: torch.device,
                    rounds: int = 5) -> dict:
    """Median times of ``compute`` alone, the copy alone and both together (``overlap_figures``).

    ``compute`` queues work on the main stream; ``start_copy`` issues the copy beside it and returns
    its join (``SideStream.start``, or an exchange's ``SwapHandle.wait_all``)."""

    def copy_alone():
        start_copy()()

    def both():
        join = start_copy()
        compute()
        join()

    def median(fn):
        return statistics.median(time_calls(fn, device, rounds, warmup=1))

    return overlap_figures(median(compute), median(copy_alone), median(both))


def matmul_compute(device: torch.device, seconds: float, size: int | None = None) -> Callable[[], None]:
    """Compute standing in for a prefill: square matmuls (bf16 8192 on a GPU, fp32 256 on the CPU)
    repeated so that one call lasts about ``seconds``, on the main stream."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    size = size or (8192 if cuda else 256)
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16 if cuda else torch.float32)
    out = torch.empty_like(a)
    one = statistics.median(time_calls(lambda: torch.mm(a, a, out=out), device, 3))
    count = max(1, round(seconds / one))

    def compute():
        for _ in range(count):
            torch.mm(a, a, out=out)

    return compute
