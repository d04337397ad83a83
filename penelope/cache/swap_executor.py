"""Run the tier plans of `penelope.cache.tiers` (and `penelope.cache.baselines.hicache`) on real KV pools.

Pools follow SGLang's per-layer layout: a list of buffers (K and V of every layer), each
`[slots, heads, head_dim]`, one row per token slot. The "GPU" pool has the cache's `capacity`
rows; the host pool has `host_rows` rows (CPU tier + swap buffer) and is pinned when a GPU is
present. On a CPU-only machine both are CPU tensors (the Triton copy then needs
`TRITON_INTERPRET=1`).

Copies go through `penelope.kernels.kv_swap.run_exchange`. `copy="triton"`: the two directions
run on their own side streams, layer by layer, ordered by events where the plan says so (never a
full-stream barrier); contiguous runs of at least `min_run` rows go through the copy engines and
scattered rows through the swap-copy kernel. `start(plan)` returns a handle whose
`wait_layer(l)` lets layer l's compute start while later layers still load; `run(plan)` makes
the compute stream wait for all of it. `copy="naive"`: the torch indexed-copy fallback.

`fence`: the stream forwards run on when it is not the stream plans are issued from (SGLang's
overlap scheduler issues from its scheduling stream while the previous forward still runs on its
forward stream). Every plan's copies then start after the work queued on the fence when the plan
is issued, so a copy never reads KV a forward is still writing nor overwrites KV a forward still
reads; and the fence waits for the copies, so a later forward sees what they loaded and may reuse
the slots they emptied.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from penelope.cache.slots import EMPTY_SLOTS
from penelope.errors import UsageError
from penelope.kernels.kv_swap import (
    COPY_FUNCTIONS,
    MIN_RUN,
    CudaStreams,
    ExchangePlan,
    HostStreams,
    SwapHandle,
    layer_groups,
    run_exchange,
)
from penelope.kernels.kv_swap.kernel import check_pools, launch_device


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
    dtype and row shape: every layer's K, then every layer's V) with the copy function `copy`
    ("triton" or "naive"). `num_layers`: layers of the pools (default half the buffers);
    `min_run`: shortest run of consecutive slots moved by the copy engines (None: the kernel only).
    `defer_waits`: `run` does not make compute wait; the handles are kept in `pending` for
    `wait_layer` (before each layer of the next forward) and `finish_layers` (after its last).
    `fence`: the forward stream, a stream of the stream model (see the module docstring); not with
    `defer_waits`, whose per-layer waits are for forwards on the issuing stream.
    """

    def __init__(self, gpu_pool: Sequence[torch.Tensor], host_pool: Sequence[torch.Tensor], copy: str = "triton",
                 num_layers: int | None = None, min_run: int | None = MIN_RUN, defer_waits: bool = False,
                 fence=None):
        if copy not in COPY_FUNCTIONS:
            raise UsageError(f"unknown copy function {copy!r}; choose one of {', '.join(COPY_FUNCTIONS)}")
        if fence is not None and defer_waits:
            raise UsageError("a fence stream and deferred per-layer waits do not combine")
        try:
            pools = check_pools(list(gpu_pool), list(host_pool))
            layer_groups(len(gpu_pool), num_layers)
        except ValueError as error:
            raise UsageError(f"KV pools: {error}") from None
        self.gpu_pool, self.host_pool, self.copy = list(gpu_pool), list(host_pool), copy
        self.num_layers, self.min_run = num_layers, min_run
        self.gpu_rows, self.host_rows = pools.src_rows, pools.dst_rows
        self.bytes_per_token = pools.row_bytes * pools.n_layers
        self.counters = ExecutorCounters()
        # The stream model, made at the first plan that needs one (or given to start).
        self.streams = None
        self.fence = fence
        # The last events of the latest exchange: the next one waits for them, so plans stay in order
        # even when compute waited only for some layers.
        self._last: tuple = ()
        self.defer_waits = defer_waits
        self.pending: list[SwapHandle] = []

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
        return cls(gpu, host, copy, num_layers=n_layers)

    def start(self, plan, streams=None) -> SwapHandle | None:
        """Issue one `TierPlan` without making compute wait: returns the handle whose
        `wait_layer(l)` / `wait_all()` order later work after the copies (None when nothing to copy,
        or for `copy="naive"` without a stream model, which runs in order on the current stream).
        Plans started one after the other stay ordered. `streams`: the stream model to use from now on (default: CUDA
        streams for GPU pools, host execution otherwise). Raises ValueError before copying when a
        slot is out of range."""
        steps = plan.steps()
        if not steps:
            return None
        if streams is not None:
            self.streams = streams
        elif self.streams is None and (self.copy == "triton" or self.fence is not None):
            device = (launch_device(self.gpu_pool, self.host_pool) if self.copy == "triton"
                      else self.gpu_pool[0].device)
            self.streams = CudaStreams(device) if device.type == "cuda" else HostStreams()
        after = self._last
        if self.fence is not None:
            # Everything queued on the forward stream so far: the forwards that last wrote the rows
            # this plan reads, or still read the slots it overwrites.
            after = (*after, self.streams.record(self.fence))
        handle = run_exchange(ExchangePlan(tuple(steps), EMPTY_SLOTS, EMPTY_SLOTS, plan.buffer_after), self.gpu_pool,
                              self.host_pool, self.copy, num_layers=self.num_layers, min_run=self.min_run,
                              streams=self.streams, wait=False, after=after)
        if handle is not None:
            self._last = handle.last
        counters = self.counters
        counters.plans += 1
        counters.steps += len(steps)
        counters.to_host_tokens += plan.to_host_tokens
        counters.to_gpu_tokens += plan.to_gpu_tokens
        counters.swapped_tokens += plan.swapped_tokens
        counters.bytes_moved += (plan.to_host_tokens + plan.to_gpu_tokens) * self.bytes_per_token
        return handle

    def run(self, plan) -> None:
        """Run one `TierPlan` (asynchronous on a GPU: later work on the current stream, and on the
        fence stream, sees its result, or, with `defer_waits`, each layer's work once `wait_layer`
        was called for it).
        Raises ValueError before copying when a slot is out of range."""
        handle = self.start(plan)
        if handle is None:
            return
        if self.defer_waits:
            self.pending.append(handle)
        else:
            handle.wait_all()
        if self.fence is not None:
            handle.wait_all(self.fence)

    def wait_layer(self, layer: int) -> None:
        """Make the compute stream wait until layer `layer`'s rows of every deferred plan moved."""
        for handle in self.pending:
            handle.wait_layer(layer)

    def finish_layers(self) -> None:
        """Forget the deferred plans once every layer of them was waited for (after a forward)."""
        self.pending.clear()

    def run_all(self, plans) -> None:
        """Run plans in order (as `TwoTierCache.take_plans()` returns them)."""
        for plan in plans:
            self.run(plan)
