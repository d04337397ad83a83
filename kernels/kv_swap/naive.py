"""Torch reference for the KV slot copy: ``index_select`` then ``index_copy_``, one layer at a time.

Rows are viewed as integers of the element size, so the copy is bit-exact for every dtype (bf16,
fp8, NaN payloads) and works for dtypes whose indexed copy torch does not implement.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .kernel import INT_DTYPE_OF_SIZE, check_pools, check_slots


def naive_copy_unchecked(
    src: Sequence[torch.Tensor],
    dst: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
) -> None:
    """``naive_copy_kv_slots`` without validation, for callers that checked a whole schedule."""
    if src_slots.numel() == 0:
        return
    as_int = INT_DTYPE_OF_SIZE[src[0].element_size()]
    src_index = src_slots.to(src[0].device)
    dst_index = dst_slots.to(dst[0].device)
    for s, d in zip(src, dst, strict=True):
        # Gather on the source device, move the gathered rows once, scatter on the destination.
        rows = s.view(as_int).index_select(0, src_index).to(d.device)
        d.view(as_int).index_copy_(0, dst_index, rows)


def naive_copy_kv_slots(
    src: Sequence[torch.Tensor],
    dst: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
) -> None:
    """Copy ``src[l][src_slots[i]]`` to ``dst[l][dst_slots[i]]`` for every layer ``l`` with torch ops.

    Same arguments and checks as ``copy_kv_slots`` (lists of per-layer ``[slots, H, D]`` buffers,
    int64 ``[n]`` slots), but any device placement works, pageable host memory included. Moves the
    rows twice (gather into a temporary, then scatter) and launches two ops per layer.
    """
    pools = check_pools(src, dst)
    check_slots(pools, src_slots, dst_slots)
    naive_copy_unchecked(src, dst, src_slots, dst_slots)
