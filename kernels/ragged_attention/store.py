"""Store of a batch's K/V rows into the token-indexed pool, before the layer's attention reads it.

Every layer stores to the same slots, so the slots are checked once per batch: ``plan_store_kv``
validates HOST-SIDE slots (range, duplicates) and uploads them without blocking; each layer's
``store_kv(..., plan=plan)`` then launches without reading anything back from the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from ..host_transfer import upload
from .kernel import check_backend


@triton.jit
def _store_kv_kernel(
    k_buffer_ptr,
    v_buffer_ptr,
    k_ptr,
    v_ptr,
    slots_ptr,
    stride_kbt,
    stride_kbh,
    stride_vbt,
    stride_vbh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]
    k = tl.load(k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(k_buffer_ptr + slot * stride_kbt + offs_h[:, None] * stride_kbh + offs_d[None, :], k, mask=mask)
    tl.store(v_buffer_ptr + slot * stride_vbt + offs_h[:, None] * stride_vbh + offs_d[None, :], v, mask=mask)


def store_launch(k_buffer, v_buffer, slots, k, v):
    """Grid, arguments and keyword arguments of one ``_store_kv_kernel`` launch (shared with
    ``compile_report``)."""
    num_kv_heads, head_dim = k_buffer.shape[1:]
    args = (
        k_buffer, v_buffer, k, v, slots,
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
    )
    kwargs = dict(
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )
    return (slots.shape[0],), args, kwargs


@dataclass(frozen=True, eq=False)
class KVStorePlan:
    """A batch's store slots, checked on the host and uploaded once for all its layers.

    ``slots``: int64 ``[T]`` on ``device``, distinct, in ``[0, num_slots)``."""

    slots: torch.Tensor
    num_slots: int
    device: torch.device


def plan_store_kv(slots, num_slots: int, device: torch.device | str) -> KVStorePlan:
    """Check the batch's store slots once and upload them without blocking.

    Args:
        slots: ``[T]`` integer slots, host-side (numpy array, list or CPU tensor): each token's row of
            the pool. A tensor on a GPU is accepted and read back (a sync).
        num_slots: rows of the pools the layers will store into.
        device: where the pools are.

    Raises ValueError on a slot outside ``[0, num_slots)`` or a slot listed twice.
    """
    device = torch.device(device)
    if isinstance(slots, torch.Tensor):
        if slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"slots must be int32/int64, got {slots.dtype}")
        # A host tensor is read in place; a GPU tensor is copied back (a sync).
        host = slots.detach().numpy() if slots.device.type == "cpu" else slots.detach().cpu().numpy()
    else:
        host = np.asarray(slots)
        if host.size and not np.issubdtype(host.dtype, np.integer):
            raise ValueError(f"slots must be integers, got {host.dtype}")
    if host.ndim != 1:
        raise ValueError(f"slots must be 1-D, got shape {host.shape}")
    host = host.astype(np.int64)
    if host.size:
        low, high = int(host.min()), int(host.max())
        if low < 0 or high >= num_slots:
            raise ValueError(f"slots must lie in [0, {num_slots}), got values in [{low}, {high}]")
        if np.unique(host).size != host.size:
            raise ValueError("slots contain duplicates: two rows would race for one pool slot")
    return KVStorePlan(upload(host, device), num_slots, device)


def _check_store_tensors(k_buffer, v_buffer, slots, k, v) -> None:
    """Types, devices, shapes, dtypes and strides of a store; no device sync."""
    tensors = {"k_buffer": k_buffer, "v_buffer": v_buffer, "slots": slots, "k": k, "v": v}
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device != k_buffer.device:
            raise ValueError(f"{name} is on {tensor.device} but k_buffer is on {k_buffer.device}")
    if k_buffer.dim() != 3 or v_buffer.shape != k_buffer.shape or v_buffer.dtype != k_buffer.dtype:
        raise ValueError(
            f"k_buffer and v_buffer must be 3-D with equal shape and dtype, got {tuple(k_buffer.shape)} "
            f"{k_buffer.dtype} and {tuple(v_buffer.shape)} {v_buffer.dtype}"
        )
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be 1-D int32/int64, got shape {tuple(slots.shape)} {slots.dtype}")
    row_shape = (slots.shape[0], *k_buffer.shape[1:])
    for name in ("k", "v"):
        if tuple(tensors[name].shape) != row_shape or tensors[name].dtype != k_buffer.dtype:
            raise ValueError(
                f"{name} must be {row_shape} {k_buffer.dtype}, got {tuple(tensors[name].shape)} "
                f"{tensors[name].dtype}"
            )
    for name in ("k_buffer", "v_buffer", "k", "v"):
        if tensors[name].stride(2) != 1:
            raise ValueError(f"{name} needs a unit stride on head_dim, got strides {tensors[name].stride()}")


def store_kv(k_buffer, v_buffer, slots, k, v, impl: str = "auto", *, plan: KVStorePlan | None = None) -> None:
    """Write the batch's K/V rows into pool slots: ``k_buffer[slots[i]] = k[i]`` (and V), in place.

    Args:
        k_buffer, v_buffer: ``[S, Hkv, D]`` pool of one layer (unit stride on D).
        slots: int32 or int64 ``[T]`` distinct slots in ``[0, S)``; with a plan, ``plan.slots``.
        k, v: ``[T, Hkv, D]`` rows in the pool's dtype (unit stride on D).
        impl: ``"triton"`` (one launch for K and V), ``"torch"`` (indexed copy), or ``"auto"``:
            Triton on GPU, indexed copy on CPU (no interpreter needed there).
        plan: ``plan_store_kv`` of this batch: the slots' values are then not read again (no device
            sync); only shapes, devices and the pool's size are checked.

    Without a plan the slots' range and uniqueness are checked here (device syncs on a GPU).
    """
    _check_store_tensors(k_buffer, v_buffer, slots, k, v)
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    num_slots = k_buffer.shape[0]
    if plan is not None:
        if not isinstance(plan, KVStorePlan) or slots is not plan.slots:
            raise ValueError("with a plan, pass plan.slots as slots (the slots the plan checked)")
        if num_slots < plan.num_slots:
            raise ValueError(f"k_buffer has {num_slots} slots, fewer than the {plan.num_slots} the plan checked")
    elif slots.numel():
        low, high = int(slots.min()), int(slots.max())
        if low < 0 or high >= num_slots:
            raise ValueError(f"slots must lie in [0, {num_slots}), got values in [{low}, {high}]")
        if torch.unique(slots).numel() != slots.numel():
            raise ValueError("slots contain duplicates: two rows would race for one pool slot")
    if slots.numel() == 0:
        return

    if impl == "torch" or (impl == "auto" and k_buffer.device.type == "cpu"):
        index = slots if slots.dtype == torch.int64 else slots.long()
        k_buffer.index_copy_(0, index, k)
        v_buffer.index_copy_(0, index, v)
        return
    check_backend(k_buffer.device)
    grid, args, kwargs = store_launch(k_buffer, v_buffer, slots, k, v)
    _store_kv_kernel[grid](*args, **kwargs)
