"""Stage 4: moving KV between the GPU and pinned host memory.

1. Copy throughput, host to device and device to host, of one chunk of 1,024 tokens made of 16
   scattered 64-token blocks of Qwen3-8B's 72 layer buffers (``bench_kv_swap.py``'s shapes):
   the Triton slot-copy kernel, ``cudaMemcpyAsync`` per 64-token block and buffer (what the
   exchange hands the copy engines), and ``cudaMemcpyAsync`` of the same bytes as one contiguous
   run per buffer (the copy engines' peak).
2. Overlap: a copy issued on a side stream and bf16 matmuls (sized to last as long) on the main
   stream, timed together against each alone (``overlap.py``), for the copy engines and the kernel
   in both directions, and for the swap-buffer exchange (``run_exchange``, its own side streams).
3. The time to pin 16 GiB of host memory (``torch.empty(pin_memory=True)``), bounded: less when
   the host has less than twice that available, or when the rate of a first 1 GiB says 16 GiB
   would not finish before the stage's deadline (the point says which).

Each copy point is measured only when the last one's time says it fits before the stage's
deadline, each overlap point when its copy's time does.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from bench_kv_swap import BLOCK_TOKENS, block_slots, make_pool, row_bytes
from machine import host_memory
from overlap import SideStream, matmul_compute, measure_overlap
from timing import time_calls

from penelope.kernels.kv_swap import copy_kv_slots, plan_exchange, run_exchange

from .context import PASSED, Pace, StageContext

GIB = 1 << 30
DIRECTIONS = ("h2d", "d2h")


@dataclass(frozen=True)
class SwapSetup:
    shape: str  # a key of bench_kv_swap.SHAPES
    pool_tokens: int
    chunk_tokens: int
    rounds: int
    pin_bytes: int  # 0: nothing to pin (no CUDA)


FULL = SwapSetup("qwen3-8b", pool_tokens=8 * 1024, chunk_tokens=1024, rounds=10, pin_bytes=16 * GIB)
REDUCED = SwapSetup("tiny", pool_tokens=512, chunk_tokens=128, rounds=2, pin_bytes=0)


class Pools:
    """A GPU pool and a host pool (pinned on a GPU machine), and one chunk's scattered slots."""

    def __init__(self, setup: SwapSetup, device: torch.device):
        self.device, self.setup = device, setup
        self.gpu = make_pool(setup.shape, setup.pool_tokens, device.type)
        self.host = make_pool(setup.shape, setup.pool_tokens, "cpu", pinned=device.type == "cuda")
        self.src_slots = block_slots(setup.pool_tokens, setup.chunk_tokens, seed=3)
        self.dst_slots = block_slots(setup.pool_tokens, setup.chunk_tokens, seed=4)
        self.payload = setup.chunk_tokens * len(self.gpu) * row_bytes(setup.shape)

    def sides(self, direction: str):
        return (self.host, self.gpu) if direction == "h2d" else (self.gpu, self.host)

    def copies(self, direction: str) -> dict:
        """Provider -> a call that moves this direction's chunk (asynchronously, current stream)."""
        src, dst = self.sides(direction)
        src_slots, dst_slots = self.src_slots.to(self.device), self.dst_slots.to(self.device)
        chunk = self.setup.chunk_tokens
        block_starts = list(zip(self.src_slots[::BLOCK_TOKENS].tolist(), self.dst_slots[::BLOCK_TOKENS].tolist(),
                                strict=True))

        def triton():
            copy_kv_slots(src, dst, src_slots, dst_slots)

        def memcpy_blocks():
            for s, d in zip(src, dst, strict=True):
                for src_start, dst_start in block_starts:
                    d[dst_start : dst_start + BLOCK_TOKENS].copy_(s[src_start : src_start + BLOCK_TOKENS],
                                                                  non_blocking=True)

        def memcpy_contiguous():
            for s, d in zip(src, dst, strict=True):
                d[:chunk].copy_(s[:chunk], non_blocking=True)

        return {"triton": triton, "memcpy_blocks": memcpy_blocks, "memcpy_contiguous": memcpy_contiguous}


def median_seconds(fn, device: torch.device, rounds: int) -> float:
    return statistics.median(time_calls(fn, device, rounds, warmup=2))


def measure_copies(ctx: StageContext, pools: Pools, setup: SwapSetup) -> dict:
    seconds = {}
    pace = Pace(ctx)
    for direction in DIRECTIONS:
        for provider, copy in pools.copies(direction).items():
            if not pace.has_time(what="copy", direction=direction, provider=provider):
                continue
            seconds[direction, provider] = median_seconds(copy, ctx.device, setup.rounds)
            pace.done()
            ctx.log.write("copy", direction=direction, provider=provider, shape=setup.shape,
                          tokens=setup.chunk_tokens, block_tokens=BLOCK_TOKENS, buffers=len(pools.gpu),
                          payload_bytes=pools.payload, seconds=seconds[direction, provider],
                          gb_per_s=pools.payload / seconds[direction, provider] / 1e9)
    return seconds


def overlap_seconds(copy_s: float, setup: SwapSetup) -> float:
    """Seconds an overlap point takes: compute sized to the copy, the copy, and both, each run
    ``rounds`` times after a warm-up. Copies are timed, not scaled: a point's fixed costs would
    dwarf a small copy's seconds."""
    return 3 * (setup.rounds + 1) * copy_s


def measure_overlaps(ctx: StageContext, pools: Pools, setup: SwapSetup, seconds: dict) -> None:
    side = SideStream(ctx.device)
    for direction in DIRECTIONS:
        copies = pools.copies(direction)
        for provider in ("memcpy_contiguous", "triton"):
            copy_s = seconds.get((direction, provider))
            if copy_s is None or not ctx.has_time(overlap_seconds(copy_s, setup), what="overlap", copy=provider,
                                                  direction=direction):
                continue
            compute = matmul_compute(ctx.device, copy_s)
            figures = measure_overlap(compute, lambda copy=copies[provider]: side.start(copy), ctx.device,
                                      setup.rounds)
            ctx.log.write("overlap", copy=provider, direction=direction, payload_bytes=pools.payload, **figures)
    tokens = setup.chunk_tokens
    out_gpu = block_slots(setup.pool_tokens, tokens, seed=7)
    host_blocks = block_slots(setup.pool_tokens, 2 * tokens, seed=8)
    plan = plan_exchange(out_gpu, host_blocks[:tokens], host_blocks[tokens:])

    def start_exchange():
        return run_exchange(plan, pools.gpu, pools.host, wait=False).wait_all

    # The exchange moves a chunk each way.
    if not ctx.has_time(overlap_seconds(2 * max(seconds.values(), default=0.0), setup), what="overlap",
                        copy="exchange", direction="both"):
        return
    exchange_s = median_seconds(lambda: start_exchange()(), ctx.device, setup.rounds)
    figures = measure_overlap(matmul_compute(ctx.device, exchange_s), start_exchange, ctx.device, setup.rounds)
    ctx.log.write("overlap", copy="exchange", direction="both", payload_bytes=2 * pools.payload, **figures)


def pin_seconds(nbytes: int) -> float:
    began = time.perf_counter()
    buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    seconds = time.perf_counter() - began
    del buffer
    # The caching host allocator keeps freed pinned blocks; give them back to the system.
    getattr(torch._C, "_host_emptyCache", lambda: None)()
    return seconds


def measure_pinning(ctx: StageContext, requested: int) -> None:
    if not ctx.has_time(0.0, what=f"pinning {requested // GIB} GiB"):
        return
    available = host_memory().get("MemAvailable", 0)
    nbytes, reasons = requested, []
    if 2 * requested > available:
        nbytes = available // 2 // GIB * GIB
        reasons.append(f"{available / GIB:.0f} GiB of host memory available: pinning at most half of it")
    first = pin_seconds(GIB)
    ctx.log.write("pin", pinned_bytes=GIB, seconds=first, gb_per_s=GIB / first / 1e9, requested_bytes=GIB)
    # Keep a third of what is left for the rest of the stage.
    affordable = int(GIB * 0.66 * ctx.left() / first) // GIB * GIB
    if affordable < nbytes:
        nbytes = affordable
        reasons.append(f"at {GIB / first / 1e9:.1f} GB/s only {affordable // GIB} GiB fit before the deadline")
    if nbytes <= GIB:
        ctx.log.write("skipped", what=f"pinning {requested // GIB} GiB", reason="; ".join(reasons))
        return
    seconds = pin_seconds(nbytes)
    ctx.log.write("pin", requested_bytes=requested, pinned_bytes=nbytes, seconds=seconds,
                  gb_per_s=nbytes / seconds / 1e9, reduced_because="; ".join(reasons) or None)


def run(ctx: StageContext) -> int:
    setup = FULL if ctx.full else REDUCED
    pools = Pools(setup, ctx.device)
    seconds = measure_copies(ctx, pools, setup)
    measure_overlaps(ctx, pools, setup, seconds)
    del pools
    if setup.pin_bytes:
        measure_pinning(ctx, setup.pin_bytes)
    else:
        ctx.log.write("skipped", what="pinning host memory", reason="needs CUDA")
    return PASSED
