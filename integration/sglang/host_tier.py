"""The host KV pool of Penelope's CPU tier inside SGLang, and what runs the tier's copies.

The pool mirrors SGLang's device KV pool (``MHATokenToKVPool``): one K and one V buffer per layer,
``[host_rows, heads, head_dim]``, pinned on a GPU machine; ``host_rows`` are the CPU tier plus the
swap buffer (``penelope.cache.tiers``). A ``SwapExecutor`` runs the cache's tier plans between SGLang's
buffers and these: on a GPU on side streams with the compute stream made to wait on events (no
host synchronisation; SGLang's forward stream waits on the scheduling stream before every
forward, so a batch never reads KV whose copy has not landed), on CPU in order.

Sizing: the plugin's ``cpu_cache`` option (tokens), else SGLang's own ``--hicache-size`` (GB of
host memory) or ``--hicache-ratio`` (host tokens per device token), which SGLang reads only with
``--enable-hierarchical-cache`` (not supported with this backend: the CPU tier is Penelope's).
"""
from __future__ import annotations

import torch

from penelope.cache.swap_executor import SwapExecutor
from penelope.errors import UsageError

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


class HostKV:
    """Host buffers shaped like SGLang's device KV pool, and the executor copying between them."""

    def __init__(self, kv_pool, host_rows: int, copy: str = "auto"):
        layers = range(kv_pool.start_layer, kv_pool.start_layer + kv_pool.layer_num)
        device = [kv_pool.get_key_buffer(i) for i in layers] + [kv_pool.get_value_buffer(i) for i in layers]
        first = device[0]
        if first.dim() != 3:
            raise UsageError("penelope: the CPU tier needs SGLang's per-token K/V pool layout")
        check_fits(host_rows * kv_bytes_per_token(kv_pool), f"{host_rows} tokens on this rank")
        pin = first.is_cuda
        host = [torch.zeros((host_rows, *first.shape[1:]), dtype=first.dtype, pin_memory=pin) for _ in device]
        if copy == "auto":
            # The swap-copy kernel needs a GPU (or Triton's interpreter); torch's indexed copy runs anywhere.
            copy = "triton" if first.is_cuda else "naive"
        self.host = host
        self.executor = SwapExecutor(device, host, copy, num_layers=len(layers))

    def run(self, plans) -> None:
        """Run the cache's plans in order (see the module docstring for the ordering on a GPU)."""
        for plan in plans:
            self.executor.run(plan)
