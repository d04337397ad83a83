"""Run the tier plans of `penelope.tiers` (and `penelope.hicache`) on real KV pools.

Pools follow SGLang's per-layer layout: a list of buffers (K and V of every layer), each
`[slots, heads, head_dim]`, one row per token slot. The "GPU" pool has the cache's `capacity`
rows; the host pool has `host_rows` rows (CPU tier + swap buffer) and is pinned when a GPU is
present. On a CPU-only machine both are CPU tensors (the Triton copy then needs
`TRITON_INTERPRET=1`).

Copies go through `penelope.kernels.kv_swap.run_exchange`: `copy="triton"` is the swap-copy
kernel (one launch copies a step's rows of every layer; on a GPU the two directions run on their
own streams, ordered by events where the plan says so), `copy="naive"` the torch indexed-copy
fallback.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from penelope.errors import UsageError
from penelope.kernels.kv_swap import COPY_FUNCTIONS, ExchangePlan, run_exchange
from penelope.kernels.kv_swap.kernel import check_pools

_EMPTY = np.empty(0, dtype=np.int64)


@dataclass
class ExecutorCounters:
    """Plans and copy steps run; token rows moved each way (`swapped_tokens`: loaded through the
    swap buffer); `bytes_moved`: both directions, all layers, K and V."""

    plans: int = 0
    steps: int = 0
    to_host_tokens: int = 0
    to_gpu_tokens: int = 0
    swapped_tokens: int = 0
    bytes_moved: int = 0


class SwapExecutor:
    """Runs plans on `gpu_pool` and `host_pool` (lists of per-layer buffers `[rows, *row]`, same
    dtype and row shape) with the copy function `copy` ("triton" or "naive")."""

    def __init__(self, gpu_pool: Sequence[torch.Tensor], host_pool: Sequence[torch.Tensor], copy: str = "triton"):
        if copy not in COPY_FUNCTIONS:
            raise UsageError(f"unknown copy function {copy!r}; choose one of {', '.join(COPY_FUNCTIONS)}")
        try:
            pools = check_pools(list(gpu_pool), list(host_pool))
        except ValueError as error:
            raise UsageError(f"KV pools: {error}") from None
        self.gpu_pool, self.host_pool, self.copy = list(gpu_pool), list(host_pool), copy
        self.gpu_rows, self.host_rows = pools.src_rows, pools.dst_rows
        self.bytes_per_token = pools.row_bytes * pools.n_layers
        self.counters = ExecutorCounters()

    @classmethod
    def allocate(cls, n_layers: int, gpu_rows: int, host_rows: int, row_shape: tuple[int, ...],
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device | None = None,
                 copy: str = "triton") -> SwapExecutor:
        """Zeroed pools: K and V buffers for `n_layers` layers, `[gpu_rows, *row_shape]` on `device`
        (CUDA when available, else CPU) and `[host_rows, *row_shape]` on the host, pinned when the
        device is a GPU."""
        device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        pin = device.type == "cuda"
        gpu = [torch.zeros((gpu_rows, *row_shape), dtype=dtype, device=device) for _ in range(2 * n_layers)]
        host = [torch.zeros((host_rows, *row_shape), dtype=dtype, pin_memory=pin) for _ in range(2 * n_layers)]
        return cls(gpu, host, copy)

    def run(self, plan) -> None:
        """Run one `TierPlan` (asynchronous on the current stream on a GPU: later work on that
        stream sees its result). Raises ValueError before copying when a slot is out of range."""
        steps = plan.steps()
        if not steps:
            return
        run_exchange(ExchangePlan(tuple(steps), _EMPTY, _EMPTY, plan.buffer_after), self.gpu_pool,
                     self.host_pool, self.copy)
        counters = self.counters
        counters.plans += 1
        counters.steps += len(steps)
        counters.to_host_tokens += plan.to_host_tokens
        counters.to_gpu_tokens += plan.to_gpu_tokens
        counters.swapped_tokens += plan.swapped_tokens
        counters.bytes_moved += (plan.to_host_tokens + plan.to_gpu_tokens) * self.bytes_per_token

    def run_all(self, plans) -> None:
        """Run plans in order (as `TwoTierCache.take_plans()` returns them)."""
        for plan in plans:
            self.run(plan)
