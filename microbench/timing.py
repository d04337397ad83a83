"""Seconds of a call, the one way every microbenchmark that times its own calls measures them.

On a GPU: CUDA events around the call, read after the end event has completed (the time the GPU
spent, not the time the host took to queue the work). On the CPU: the wall clock, or the CPU time
of the calling thread (``clock="thread"``), which does not count the time the scheduler gives to
other jobs on a shared machine and, with torch on one thread, holds all of the work.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def elapsed(fn: Callable[[], object], device: torch.device, clock: str = "wall") -> float:
    """Seconds of one call of ``fn``: CUDA events when ``device`` is a GPU, else ``clock`` ("wall" or
    "thread")."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    timer = time.thread_time if clock == "thread" else time.perf_counter
    begin = timer()
    fn()
    return timer() - begin


def time_calls(fn: Callable[[], object], device: torch.device, rounds: int, warmup: int = 2,
               clock: str = "wall") -> list[float]:
    """Seconds of each of ``rounds`` calls of ``fn`` (``elapsed``), after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    return [elapsed(fn, device, clock) for _ in range(rounds)]


def bench_seconds(fn: Callable[[], object], device: torch.device, rep_ms: int = 100, cpu_rounds: int = 2,
                  cpu_warmup: int = 1) -> float:
    """Median seconds of a kernel call: on a GPU ``triton.testing.do_bench`` (L2 flushed before each
    call, as many calls as fill ``rep_ms``), else ``cpu_rounds`` wall-clock calls after
    ``cpu_warmup`` untimed ones."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") / 1e3
    return statistics.median(time_calls(fn, device, cpu_rounds, warmup=cpu_warmup))
