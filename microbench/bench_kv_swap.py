"""KV slot copy throughput: our Triton kernel vs torch ``index_select`` + ``index_copy_``.

Rows are Qwen3-8B's: 36 layers x (K, V) = 72 buffers of 8 kv heads x 128 x bf16 (2 KiB per row),
moved in chunks of 1,024 tokens made of 16 randomly placed 64-token blocks (what the cache hands
over). GB/s counts the payload once: ``tokens * 72 * 2 KiB / time``.

- CPU (both pools in host memory): the Triton kernel runs under ``TRITON_INTERPRET=1`` (numpy,
  one Python call per program), so its figure measures the interpreter, not the design. Each
  result also reports memory traffic against the minimum (read + write the payload once): the
  kernel moves each row once, the torch path gathers into a temporary and scatters it, twice the
  minimum.
- GPU: device -> pinned and pinned -> device, with the fraction of the ``cudaMemcpy`` peak
  measured between the same buffers (per-layer contiguous copies of the same byte count). Goal:
  at least 80% for 1,024-token chunks. Also the swap-buffer exchange with one and two chunks of
  buffer (the second lets the two directions overlap), 64-token blocks moved by the copy engines or
  by the kernel, and an exchange issued while compute runs (how much of it is hidden).

Run: ``python -m pytest microbench/bench_kv_swap.py --benchmark-json out.json``.
"""

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU the kernel can only run interpreted; set before the kernel module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
from overlap import matmul_compute, measure_overlap  # noqa: E402
from timing import time_calls  # noqa: E402

from penelope.kernels.kv_swap import copy_kv_slots, naive_copy_kv_slots, plan_exchange, run_exchange  # noqa: E402
from penelope.kernels.kv_swap import kernel as kv_kernel  # noqa: E402

SHAPES = {
    # name: (buffers = layers x K/V, kv heads, head dim, dtype)
    "qwen3-8b": (72, 8, 128, torch.bfloat16),
    # The GPU script's reduced run on the CPU (microbench/gpu_stages/swap.py).
    "tiny": (4, 2, 64, torch.bfloat16),
}
CHUNK_TOKENS = 1024
BLOCK_TOKENS = 64
CPU_POOL_TOKENS = 2 * CHUNK_TOKENS
GPU_POOL_TOKENS = 8 * CHUNK_TOKENS
PROVIDERS = {"triton": copy_kv_slots, "torch": naive_copy_kv_slots}

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _environment(device: torch.device) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "device_name": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
        "commit": _commit(),
        "triton_interpreted": kv_kernel._is_interpreted(),
    }


def make_pool(shape: str, tokens: int, device: str, pinned: bool = False) -> list[torch.Tensor]:
    buffers, heads, dim, dtype = SHAPES[shape]
    pool = []
    for _ in range(buffers):
        t = torch.empty((tokens, heads, dim), dtype=dtype, pin_memory=pinned, device=device)
        t.view(torch.int16).random_()
        pool.append(t)
    return pool


def block_slots(pool_tokens: int, tokens: int, seed: int) -> torch.Tensor:
    """Token slots of ``tokens // 64`` randomly chosen, randomly ordered 64-token blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(pool_tokens // BLOCK_TOKENS, generator=gen)[: tokens // BLOCK_TOKENS]
    return (blocks[:, None] * BLOCK_TOKENS + torch.arange(BLOCK_TOKENS)).reshape(-1)


def row_bytes(shape: str) -> int:
    _, heads, dim, dtype = SHAPES[shape]
    return heads * dim * torch.empty((), dtype=dtype).element_size()


def _median_seconds(benchmark) -> float:
    return benchmark.stats.stats.median


@pytest.mark.parametrize("provider", list(PROVIDERS))
def test_cpu_copy(benchmark, provider):
    if provider == "triton" and not kv_kernel._is_interpreted():
        pytest.skip("CPU pools need TRITON_INTERPRET=1 (set by this module when no GPU is present)")
    shape = "qwen3-8b"
    src = make_pool(shape, CPU_POOL_TOKENS, "cpu")
    dst = make_pool(shape, CPU_POOL_TOKENS, "cpu")
    src_slots = block_slots(CPU_POOL_TOKENS, CHUNK_TOKENS, seed=1)
    dst_slots = block_slots(CPU_POOL_TOKENS, CHUNK_TOKENS, seed=2)
    copy = PROVIDERS[provider]
    benchmark.pedantic(copy, args=(src, dst, src_slots, dst_slots), rounds=5, iterations=1, warmup_rounds=1)

    payload = CHUNK_TOKENS * len(src) * row_bytes(shape)
    # Bytes read + written: the kernel moves each row once; the torch path also writes and reads
    # back a gathered temporary.
    traffic = 2 * payload if provider == "triton" else 4 * payload
    benchmark.extra_info.update(_environment(torch.device("cpu")))
    benchmark.extra_info.update(
        shape=shape,
        dtype=str(SHAPES[shape][3]),
        tokens=CHUNK_TOKENS,
        buffers=len(src),
        row_bytes=row_bytes(shape),
        payload_bytes=payload,
        traffic_bytes=traffic,
        traffic_vs_minimum=traffic / (2 * payload),
        gbps=payload / _median_seconds(benchmark) / 1e9,
        # This machine's CPUs are shared: the best round is the least disturbed one.
        gbps_best=payload / benchmark.stats.stats.min / 1e9,
    )


def _cuda_seconds(fn, repeats: int = 10) -> float:
    """Median seconds of ``fn`` between CUDA events, after one warm-up (the upper median of an even
    number of rounds)."""
    times = time_calls(fn, torch.device("cuda"), repeats, warmup=1)
    return sorted(times)[len(times) // 2]


def _memcpy_peak_gbps(src, dst, tokens: int, row_bytes: int) -> float:
    """cudaMemcpy throughput between the same buffers: one contiguous copy per layer buffer."""

    def copy():
        for s, d in zip(src, dst, strict=True):
            d[:tokens].copy_(s[:tokens], non_blocking=True)

    return tokens * len(src) * row_bytes / _cuda_seconds(copy) / 1e9


@pytest.fixture(scope="module")
def gpu_pools():
    device = torch.device("cuda")
    shape = "qwen3-8b"
    gpu = make_pool(shape, GPU_POOL_TOKENS, "cuda")
    host = make_pool(shape, GPU_POOL_TOKENS, "cpu", pinned=True)
    row = row_bytes(shape)
    peaks = {
        "d2h": _memcpy_peak_gbps(gpu, host, CHUNK_TOKENS, row),
        "h2d": _memcpy_peak_gbps(host, gpu, CHUNK_TOKENS, row),
    }
    return device, shape, gpu, host, peaks


@requires_cuda
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("provider", [*PROVIDERS, "triton_launch"])
def test_gpu_copy(benchmark, gpu_pools, direction, provider):
    device, shape, gpu, host, peaks = gpu_pools
    src, dst = (gpu, host) if direction == "d2h" else (host, gpu)
    src_slots = block_slots(GPU_POOL_TOKENS, CHUNK_TOKENS, seed=3).to(device)
    dst_slots = block_slots(GPU_POOL_TOKENS, CHUNK_TOKENS, seed=4).to(device)
    if provider == "triton_launch":
        # The kernel alone: pools and slots checked once, as the exchange executor does.
        pools = kv_kernel.check_pools(src, dst)
        kv_kernel.check_slots(pools, src_slots, dst_slots)

        def copy(src, dst, src_slots, dst_slots):
            kv_kernel.launch_copy(pools, src, dst, src_slots, dst_slots, device)
    else:
        copy = PROVIDERS[provider]

    def run():
        copy(src, dst, src_slots, dst_slots)
        torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=10, iterations=1, warmup_rounds=2)
    payload = CHUNK_TOKENS * len(src) * row_bytes(shape)
    gbps = payload / _median_seconds(benchmark) / 1e9
    benchmark.extra_info.update(_environment(device))
    benchmark.extra_info.update(
        shape=shape,
        dtype=str(SHAPES[shape][3]),
        direction=direction,
        tokens=CHUNK_TOKENS,
        buffers=len(src),
        row_bytes=row_bytes(shape),
        payload_bytes=payload,
        gbps=gbps,
        memcpy_peak_gbps=peaks[direction],
        fraction_of_memcpy_peak=gbps / peaks[direction],
        goal_fraction=0.8,
    )


@requires_cuda
@pytest.mark.parametrize("min_run", [64, None], ids=["runs-by-copy-engine", "kernel-only"])
@pytest.mark.parametrize("buffer_chunks", [1, 2])
def test_gpu_exchange(benchmark, gpu_pools, buffer_chunks, min_run):
    """Exchange 4,096 tokens each way through a 1,024-token buffer, in chunks of 1,024 / buffer_chunks;
    64-token blocks moved by the copy engines (one cudaMemcpyAsync per block and buffer) or every
    row by the slot-copy kernel."""
    device, shape, gpu, host, peaks = gpu_pools
    tokens = 4 * CHUNK_TOKENS
    out_gpu = block_slots(GPU_POOL_TOKENS, tokens, seed=5)
    host_blocks = block_slots(GPU_POOL_TOKENS, tokens + CHUNK_TOKENS, seed=6)
    in_host, buffer = host_blocks[:tokens], host_blocks[tokens:]
    chunk = CHUNK_TOKENS // buffer_chunks
    plan = plan_exchange(out_gpu, in_host, buffer, chunk)

    def run():
        run_exchange(plan, gpu, host, min_run=min_run)
        torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=5, iterations=1, warmup_rounds=1)
    payload = 2 * tokens * len(gpu) * row_bytes(shape)
    gbps = payload / _median_seconds(benchmark) / 1e9
    benchmark.extra_info.update(_environment(device))
    benchmark.extra_info.update(
        shape=shape,
        tokens_each_way=tokens,
        buffer_tokens=CHUNK_TOKENS,
        chunk_tokens=chunk,
        min_run=min_run,
        payload_bytes_both_ways=payload,
        gbps_both_ways=gbps,
        memcpy_peak_gbps_d2h=peaks["d2h"],
        memcpy_peak_gbps_h2d=peaks["h2d"],
        fraction_of_memcpy_peak=gbps / (peaks["d2h"] + peaks["h2d"]),
        goal_fraction=0.8,
    )


@requires_cuda
def test_gpu_exchange_overlaps_compute(benchmark, gpu_pools):
    """An exchange issued on its side streams just before compute (bf16 matmuls standing in for a
    prefill, sized to last as long as the exchange) on the main stream, which then waits for it: the
    time of both against each alone (``overlap.py``). ``overlap_fraction`` 1.0: the exchange was
    hidden entirely; 0: the two ran one after the other."""
    device, shape, gpu, host, peaks = gpu_pools
    tokens = CHUNK_TOKENS
    out_gpu = block_slots(GPU_POOL_TOKENS, tokens, seed=7)
    host_blocks = block_slots(GPU_POOL_TOKENS, 2 * tokens, seed=8)
    plan = plan_exchange(out_gpu, host_blocks[:tokens], host_blocks[tokens:])

    def start_exchange():
        return run_exchange(plan, gpu, host, wait=False).wait_all

    compute = matmul_compute(device, _cuda_seconds(lambda: start_exchange()()))
    figures = measure_overlap(compute, start_exchange, device)

    def both():
        join = start_exchange()
        compute()
        join()
        torch.cuda.synchronize()

    benchmark.pedantic(both, rounds=3, iterations=1, warmup_rounds=1)
    payload = 2 * tokens * len(gpu) * row_bytes(shape)
    benchmark.extra_info.update(_environment(device))
    benchmark.extra_info.update(shape=shape, tokens_each_way=tokens, payload_bytes_both_ways=payload,
                                gbps_both_ways_alone=payload / figures["copy_s"] / 1e9, **figures)
