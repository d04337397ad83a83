"""The host KV pool of Penelope's CPU tier inside SGLang, and what runs the tier's copies.

The pool mirrors SGLang's device KV pool (``MHATokenToKVPool``): one K and one V buffer per layer,
``[host_rows, heads, head_dim]``; ``host_rows`` are the CPU tier plus the swap buffer
(``penelope.cache.tiers``). All buffers are slices of ONE plain host allocation of exactly
``host_rows`` x the pool's bytes per token, which is what the start-up check compared with the
host's memory; on a GPU machine each slice is pinned with ``cudaHostRegister`` (torch's pinned
allocator would round every buffer up to a power of two, nearly doubling a large tier).

A ``SwapExecutor`` runs the cache's tier plans between SGLang's buffers and these: on a GPU on
side streams, on CPU in order. Its fence is SGLang's forward stream: every copy starts after the
forwards queued when it is issued (under the overlap scheduler the previous forward may still
write or read the slots it touches) and every later forward waits for it.

Sizing: the plugin's ``cpu_cache`` option (tokens), else SGLang's own ``--hicache-size`` (GB of
host memory per rank) or ``--hicache-ratio`` (host tokens per device token), which SGLang reads only
with ``--enable-hierarchical-cache`` (not supported with this backend: the CPU tier is Penelope's).
"""
from __future__ import annotations

import logging
import weakref

import torch

from penelope.cache.swap_executor import SwapExecutor
from penelope.errors import UsageError
from penelope.memory import format_bytes

logger = logging.getLogger(__name__)
_GB = 1 << 30


def kv_bytes_per_token(kv_pool) -> int:
    """Bytes one token's K and V take over every layer of SGLang's device pool."""
    layers = range(kv_pool.start_layer, kv_pool.start_layer + kv_pool.layer_num)
    return sum(kv_pool.get_key_buffer(i)[0].nbytes + kv_pool.get_value_buffer(i)[0].nbytes for i in layers)


def host_tokens(cpu_cache: int, hicache_size_gb: float, hicache_ratio: float | None, device_tokens: int,
                bytes_per_token: int) -> int:
    """Tokens of the CPU tier: `cpu_cache` if set (> 0), else `hicache_size_gb` of host memory,
    else `hicache_ratio` times the device pool, else 0 (GPU only)."""
    if cpu_cache:
        return cpu_cache
    if hicache_size_gb and hicache_size_gb > 0:
        return int(hicache_size_gb * _GB // bytes_per_token)
    if hicache_ratio is not None and hicache_ratio > 0:
        return int(hicache_ratio * device_tokens)
    return 0


def check_fits(need: int, what: str, available: int | None = None) -> None:
    """UsageError (one line) when `need` bytes of host memory (`what` says for what) exceed the
    free host memory."""
    import psutil

    available = psutil.virtual_memory().available if available is None else available
    if need > available:
        raise UsageError(f"penelope: the CPU tier needs {need / _GB:.1f} GiB of host memory ({what}), only "
                         f"{available / _GB:.1f} GiB are free")


def host_buffers(count: int, rows: int, row_shape: tuple[int, ...], dtype: torch.dtype,
                 register=None) -> list[torch.Tensor]:
    """`count` host buffers `[rows, *row_shape]`, slices of one allocation of exactly their total
    size. `register(buffer)`, when given, is called once per buffer (``cuda_host_register`` pins
    it). Not zeroed: the CPU tier writes a row before anything reads it."""
    flat = torch.empty((count, rows, *row_shape), dtype=dtype)
    buffers = list(flat.unbind(0))
    if register is not None:
        for buffer in buffers:
            register(buffer)
    return buffers


def cuda_host_register(buffer: torch.Tensor) -> None:
    """Pin `buffer`'s memory (exactly its bytes) for the GPU's copy engines, until it is freed."""
    cudart = torch.cuda.cudart()
    pointer = buffer.data_ptr()
    code = int(cudart.cudaHostRegister(pointer, buffer.nbytes, 0))
    if code != 0:
        raise UsageError(f"penelope: cudaHostRegister of {buffer.nbytes / _GB:.2f} GiB of the CPU tier failed "
                         f"({cudart.cudaGetErrorString(code)})")
    # Unpin when the buffer goes (the tier keeps its buffers for the process's lifetime).
    weakref.finalize(buffer, cudart.cudaHostUnregister, pointer)


class HostKV:
    """Host buffers shaped like SGLang's device KV pool, and the executor copying between them.

    `fence`: the stream SGLang's forwards run on (``model_runner.forward_stream``; None: forwards
    run on the stream plans are issued from)."""

    def __init__(self, kv_pool, host_rows: int, copy: str = "auto", fence=None):
        layers = range(kv_pool.start_layer, kv_pool.start_layer + kv_pool.layer_num)
        device = [kv_pool.get_key_buffer(i) for i in layers] + [kv_pool.get_value_buffer(i) for i in layers]
        first = device[0]
        if first.dim() != 3 or any(t.shape[1:] != first.shape[1:] or t.dtype != first.dtype for t in device):
            raise UsageError("penelope: the CPU tier needs SGLang's per-token K/V pool layout")
        need = host_rows * kv_bytes_per_token(kv_pool)
        check_fits(need, f"{host_rows} tokens on this rank")
        pin = first.is_cuda
        host = host_buffers(len(device), host_rows, tuple(first.shape[1:]), first.dtype,
                            register=cuda_host_register if pin else None)
        logger.info("penelope: CPU tier of %s rows (swap buffer included): %s of host memory %s", f"{host_rows:,}",
                    format_bytes(need), "pinned" if pin else "(not pinned: no GPU)")
        if copy == "auto":
            # The swap-copy kernel needs a GPU (or Triton's interpreter); torch's indexed copy runs anywhere.
            copy = "triton" if first.is_cuda else "naive"
        self.host = host
        self.host_bytes = need
        self.executor = SwapExecutor(device, host, copy, num_layers=len(layers), fence=fence)

    def run(self, plans) -> None:
        """Run the cache's plans in order (see the module docstring for the ordering on a GPU)."""
        for plan in plans:
            self.executor.run(plan)
