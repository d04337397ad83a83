"""The swap executor: plans of a real two-tier workload run bit-exactly by the Triton copy kernel
(interpreted on CPU) and by the torch fallback, counters, and clear errors."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from tier_helpers import FingerprintRig

from penelope.cache.host_tier import TierPlan
from penelope.cache.swap_executor import SwapExecutor
from penelope.cache.tiers import TwoTierCache
from penelope.errors import UsageError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_pools(n_layers, gpu_rows, host_rows, seed):
    """bf16 pools of random bits (NaN payloads included), as int16 views would show them."""
    g = torch.Generator().manual_seed(seed)

    def buffer(rows):
        bits = torch.randint(-(2**15), 2**15, (rows, 2, 8), generator=g, dtype=torch.int32).to(torch.int16)
        return bits.view(torch.bfloat16)

    gpu = [buffer(gpu_rows).to(DEVICE) for _ in range(2 * n_layers)]
    host = [buffer(host_rows) for _ in range(2 * n_layers)]
    return gpu, [t.pin_memory() for t in host] if DEVICE == "cuda" else host


def test_triton_and_torch_fallback_run_the_same_plans_bit_for_bit():
    cache = TwoTierCache(32, 24, block_size=4, swap_buffer=4)
    rig = FingerprintRig(cache, cache.host_rows)
    executors = [SwapExecutor(*random_pools(3, 32, cache.host_rows, seed=5), copy=copy) for copy in ("triton", "naive")]
    rng = random.Random(2)
    sessions = [[rng.randrange(99) for _ in range(6)] for _ in range(3)]
    for step in range(14):
        a = step % 3
        rig.serve(sessions[a], output_tokens=2)
        sessions[a] += [rng.randrange(99) for _ in range(rng.randrange(2, 7))]
        if len(sessions[a]) > 28:
            sessions[a] = sessions[a][:6]
    plans = rig.ran
    assert any(plan.swapped_tokens for plan in plans) and any(len(plan.to_host_gpu) for plan in plans)
    for plan in plans:
        for executor in executors:
            executor.run(plan)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        for a, b in zip(executors[0].gpu_pool + executors[0].host_pool,
                        executors[1].gpu_pool + executors[1].host_pool, strict=True):
            assert torch.equal(a.view(torch.int16).cpu(), b.view(torch.int16).cpu())
    counters = executors[0].counters
    assert counters.plans == sum(1 for plan in plans if plan.steps())
    moved = sum(plan.to_host_tokens + plan.to_gpu_tokens for plan in plans)
    assert counters.bytes_moved == moved * 6 * 2 * 8 * 2
    assert counters.swapped_tokens == sum(plan.swapped_tokens for plan in plans) > 0


def test_a_plan_moves_exactly_its_rows():
    gpu, host = random_pools(1, 8, 8, seed=1)
    before_gpu, before_host = [t.clone() for t in gpu], [t.clone() for t in host]
    executor = SwapExecutor(gpu, host, copy="naive")
    plan = TierPlan(to_host_gpu=np.array([1, 2]), to_host_host=np.array([5, 0]), to_gpu_host=np.array([3]),
                    to_gpu_gpu=np.array([1]))
    executor.run(plan)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    for layer in range(2):
        g, h = gpu[layer].view(torch.int16).cpu(), host[layer].view(torch.int16)
        bg, bh = before_gpu[layer].view(torch.int16).cpu(), before_host[layer].view(torch.int16)
        assert torch.equal(h[5], bg[1]) and torch.equal(h[0], bg[2]) and torch.equal(g[1], bh[3])
        untouched_host = [i for i in range(8) if i not in (0, 5)]
        assert torch.equal(h[untouched_host], bh[untouched_host])
        assert torch.equal(g[[0, 2, 3, 4, 5, 6, 7]], bg[[0, 2, 3, 4, 5, 6, 7]])
    assert executor.counters.to_host_tokens == 2 and executor.counters.to_gpu_tokens == 1


def test_allocate_builds_pools_on_this_machine():
    executor = SwapExecutor.allocate(2, 16, 24, (2, 4), torch.float16, device="cpu", copy="naive")
    assert len(executor.gpu_pool) == 4 and executor.gpu_pool[0].shape == (16, 2, 4)
    assert executor.host_pool[0].shape == (24, 2, 4) and executor.bytes_per_token == 4 * 8 * 2


def test_errors_are_clear():
    gpu, host = random_pools(1, 8, 8, seed=1)
    with pytest.raises(UsageError, match="unknown copy function 'fast'"):
        SwapExecutor(gpu, host, copy="fast")
    with pytest.raises(UsageError, match="KV pools"):
        SwapExecutor(gpu, [t[:, :1] for t in host])
    executor = SwapExecutor(gpu, host, copy="naive")
    with pytest.raises(ValueError, match="outside the pool"):
        executor.run(TierPlan(to_host_gpu=np.array([0]), to_host_host=np.array([8])))
    assert executor.counters.plans == 0
