"""Triton kernel that copies KV rows of every layer between two pools by slot lists.

Layout. A pool is SGLang's per-layer layout: a list of buffers (K and V of every layer), each
``[slots, H, D]`` (any row shape ``[slots, *row]`` works), one row per token slot. Copying slot
``src_slots[i]`` of ``src[l]`` into slot ``dst_slots[i]`` of ``dst[l]`` for every layer ``l`` and
every ``i`` is one launch.

Design: pointer tables. The launcher builds two int64 tensors holding the base address
(``data_ptr()``) of every layer buffer of each side; the kernel loads the address of its layer and
casts it to a pointer. The grid is ``(slot chunk, layer)``: program ``(c, l)`` copies rows
``c * BLOCK_SLOTS ...`` of layer ``l``. Buffers therefore need not be one stacked tensor, the
number of layers is not bounded by a kernel signature, and either side may be a GPU tensor or a
pinned host tensor: with CUDA unified addressing the address of pinned memory is valid on the GPU,
so a device -> pinned or pinned -> device copy is the same kernel, reading or writing host memory
over the interconnect. Tables depend only on the addresses, so they are cached by address.

Bit-exactness: the kernel never interprets values. Rows are copied as unsigned integer words of the
widest size (8, 4, 2 or 1 bytes) that divides the row size, both row strides and every base
address, so bf16, fp8 and NaN payloads are moved bit for bit.

Under ``TRITON_INTERPRET=1`` the same design works on CPU tensors: the interpreter dereferences
raw addresses of host memory (checked by the tests). The interpreter cannot reach GPU memory, so
there every buffer must be a CPU tensor; without the interpreter at least one side must be on a
GPU. ``naive_copy_kv_slots`` (``naive.py``) is the torch reference for any placement.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ..host_transfer import upload


# n_slots changes with every chunk: one compiled variant for all counts (1 or a multiple of 16
# would otherwise each compile their own).
@triton.jit(do_not_specialize=["n_slots"])
def _copy_kv_slots_kernel(
    dst_ptr_table,
    src_ptr_table,
    dst_slots,
    src_slots,
    n_slots,
    ROW_WORDS: tl.constexpr,
    DST_STRIDE: tl.constexpr,
    SRC_STRIDE: tl.constexpr,
    WORD: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_SLOTS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
):
    chunk = tl.program_id(0)
    layer = tl.program_id(1)
    # Base addresses of this layer's buffers, as pointers to WORD-sized integers; every base is
    # ALIGN bytes aligned (checked by the launcher), which lets the compiler vectorise.
    dst_base = tl.load(dst_ptr_table + layer).to(tl.pointer_type(WORD))
    src_base = tl.load(src_ptr_table + layer).to(tl.pointer_type(WORD))
    dst_base = tl.multiple_of(dst_base, ALIGN)
    src_base = tl.multiple_of(src_base, ALIGN)

    rows = chunk * BLOCK_SLOTS + tl.arange(0, BLOCK_SLOTS)
    row_mask = rows < n_slots
    # int64 slots times constexpr strides: offsets never overflow int32 on large pools.
    dst_off = tl.load(dst_slots + rows, mask=row_mask, other=0) * DST_STRIDE  # [BLOCK_SLOTS]
    src_off = tl.load(src_slots + rows, mask=row_mask, other=0) * SRC_STRIDE  # [BLOCK_SLOTS]
    for w0 in tl.static_range(0, ROW_WORDS, BLOCK_WORDS):
        cols = w0 + tl.arange(0, BLOCK_WORDS)
        mask = row_mask[:, None] & (cols < ROW_WORDS)[None, :]  # [BLOCK_SLOTS, BLOCK_WORDS]
        words = tl.load(src_base + src_off[:, None] + cols[None, :], mask=mask)
        tl.store(dst_base + dst_off[:, None] + cols[None, :], words, mask=mask)


_WORD_DTYPES = {8: (tl.uint64, torch.int64), 4: (tl.uint32, torch.int32), 2: (tl.uint16, torch.int16),
                1: (tl.uint8, torch.uint8)}

# Integer dtype of each element size, used by the reference to copy bits, not values.
INT_DTYPE_OF_SIZE = {size: torch_dtype for size, (_, torch_dtype) in _WORD_DTYPES.items()}


@dataclass(frozen=True)
class PoolPair:
    """Checked description of a source and a destination pool (lists of per-layer buffers).

    ``src_rows``/``dst_rows``: slots per buffer; ``row_bytes``: bytes per row; ``src_stride`` and
    ``dst_stride``: bytes between consecutive slots; ``word_bytes``: integer word size the rows are
    copied in (divides the row size, both strides and every base address); ``address_align``:
    a power of two up to 16 dividing every base address; ``aliased_layers``: layers whose source
    and destination are the same buffer.
    """

    n_layers: int
    src_rows: int
    dst_rows: int
    row_bytes: int
    src_stride: int
    dst_stride: int
    word_bytes: int
    address_align: int
    aliased_layers: tuple[int, ...]


def _row_is_contiguous(buf: torch.Tensor) -> bool:
    expected = 1
    for size, stride in zip(reversed(buf.shape[1:]), reversed(buf.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _check_side(name: str, bufs: Sequence[torch.Tensor]) -> None:
    if isinstance(bufs, torch.Tensor) or not isinstance(bufs, Sequence):
        raise ValueError(f"{name} must be a list of per-layer tensors, got {type(bufs).__name__}")
    if len(bufs) == 0:
        raise ValueError(f"{name} is empty: pass one buffer per layer (K and V of every layer)")
    first = bufs[0]
    for i, buf in enumerate(bufs):
        if not isinstance(buf, torch.Tensor):
            raise ValueError(f"{name}[{i}] is a {type(buf).__name__}, not a tensor")
        if buf.dim() < 2:
            raise ValueError(f"{name}[{i}] has shape {tuple(buf.shape)}; expected [slots, *row]")
        if buf.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name}[{i}] is on {buf.device}: a pool holds its rows on the CPU or a CUDA GPU")
        if buf.shape != first.shape or buf.stride(0) != first.stride(0):
            raise ValueError(
                f"{name}[{i}] has shape {tuple(buf.shape)} and slot stride {buf.stride(0)}, but "
                f"{name}[0] has {tuple(first.shape)} and {first.stride(0)}: all layers must match"
            )
        if buf.dtype != first.dtype:
            raise ValueError(f"{name}[{i}] has dtype {buf.dtype} but {name}[0] has {first.dtype}")
        if buf.device != first.device:
            raise ValueError(f"{name}[{i}] is on {buf.device} but {name}[0] is on {first.device}")
        if not _row_is_contiguous(buf):
            raise ValueError(f"{name}[{i}] rows are not contiguous (strides {buf.stride()})")
        if name == "dst" and buf.requires_grad:
            # The copy writes memory behind autograd's back (torch refuses in-place writes to such
            # leaves); a KV pool is inference state and never needs gradients.
            raise ValueError(f"dst[{i}] requires grad: pass a pool without requires_grad (e.g. .detach())")


def _byte_range(buf: torch.Tensor, row_bytes: int) -> tuple[int, int]:
    """[first, last) byte addresses `buf`'s rows occupy."""
    start = buf.data_ptr()
    return start, start + (buf.shape[0] - 1) * buf.stride(0) * buf.element_size() + row_bytes


def _check_overlaps(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], row_bytes: int) -> tuple[int, ...]:
    """Layers whose source and destination are the same buffer (one pool, disjoint slots copied
    within it); raises ``ValueError`` where a write could land on memory another buffer uses:
    rows of one buffer overlapping each other (a slot stride below the row size, e.g. a stride-0
    view), two destination layers sharing rows, or a layer's destination rows among another
    layer's source rows. Buffers interleaved row by row (K and V of a layer in one tensor) share
    a memory range but no row, and are fine; sources may share anything (they are only read)."""
    for name, bufs in (("src", src), ("dst", dst)):
        first = bufs[0]
        if first.shape[0] > 1 and first.stride(0) * first.element_size() < row_bytes:
            raise ValueError(f"{name} rows overlap: slot stride {first.stride(0)} elements is below the row size "
                             f"({row_bytes // first.element_size()} elements)")
    aliased = set()
    spans = sorted((*_byte_range(buf, row_bytes), side, layer, buf)
                   for side, bufs in (("dst", dst), ("src", src)) for layer, buf in enumerate(bufs))
    active: list[tuple] = []  # earlier buffers whose range reaches past the current start
    for span in spans:
        start, _, side, layer, buf = span
        active = [a for a in active if a[1] > start]
        for _, _, other_side, other_layer, other in active:
            if "dst" not in (side, other_side) or not _rows_meet(buf, other, row_bytes):
                continue
            if {side, other_side} != {"src", "dst"} or layer != other_layer:
                raise ValueError(f"{other_side}[{other_layer}] and {side}[{layer}] share memory: every destination "
                                 "layer needs rows of its own, apart from every other layer's source")
            if buf.data_ptr() != other.data_ptr() or buf.stride(0) != other.stride(0) or buf.shape != other.shape:
                raise ValueError(f"src[{layer}] and dst[{layer}] share memory but are different views; only the "
                                 "same pool (identical buffers) with disjoint slots is supported")
            aliased.add(layer)
        active.append(span)
    return tuple(sorted(aliased))


def _rows_meet(a: torch.Tensor, b: torch.Tensor, row_bytes: int) -> bool:
    """Whether a row of `a` and a row of `b` (overlapping byte ranges) share a byte. With one slot
    stride, rows meet unless the two bases are offset by a whole row or more within a stride."""
    stride = a.stride(0) * a.element_size()
    if a.shape[0] == 1 and b.shape[0] == 1:
        return True
    if stride != b.stride(0) * b.element_size():
        return True  # different strides: assume the worst
    offset = (b.data_ptr() - a.data_ptr()) % stride
    return not (row_bytes <= offset <= stride - row_bytes)


def check_pools(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> PoolPair:
    """Validate two pools for a slot copy and describe them; raises ``ValueError``.

    ``src``, ``dst``: equally long lists of buffers ``[slots, *row]``; within a side all buffers
    share shape, slot stride, dtype and device; both sides share dtype and row shape; rows are
    contiguous (the slot stride may be larger than a row).
    """
    _check_side("src", src)
    _check_side("dst", dst)
    if len(src) != len(dst):
        raise ValueError(f"src has {len(src)} layer buffers but dst has {len(dst)}")
    s, d = src[0], dst[0]
    if s.dtype != d.dtype:
        raise ValueError(f"src dtype {s.dtype} differs from dst dtype {d.dtype}")
    if s.shape[1:] != d.shape[1:]:
        raise ValueError(f"src rows {tuple(s.shape[1:])} differ from dst rows {tuple(d.shape[1:])}")
    elem = s.element_size()
    row_bytes = math.prod(s.shape[1:]) * elem
    src_stride, dst_stride = s.stride(0) * elem, d.stride(0) * elem
    addresses = [b.data_ptr() for b in src] + [b.data_ptr() for b in dst]
    # The widest word dividing every size, stride and address keeps each access aligned.
    common = math.gcd(row_bytes, src_stride, dst_stride, *addresses)
    word_bytes = next(w for w in (8, 4, 2, 1) if common % w == 0)
    address_align = next(a for a in (16, 8, 4, 2, 1) if math.gcd(*addresses) % a == 0)
    aliased = _check_overlaps(src, dst, row_bytes)
    return PoolPair(len(src), s.shape[0], d.shape[0], row_bytes, src_stride, dst_stride, word_bytes,
                    address_align, aliased)


def _check_slot_tensor(name: str, slots: torch.Tensor) -> None:
    if not isinstance(slots, torch.Tensor):
        raise ValueError(f"{name} must be an int64 tensor, got {type(slots).__name__}")
    if slots.dtype != torch.int64 or slots.dim() != 1:
        raise ValueError(f"{name} must be a 1-D int64 tensor, got {slots.dtype} {tuple(slots.shape)}")
    if slots.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} is on {slots.device}: slots must be on the CPU or a CUDA GPU")


def check_slots(pools: PoolPair, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Validate slot lists against checked pools; raises ``ValueError``.

    ``src_slots``, ``dst_slots``: 1-D int64 tensors of equal length, in ``[0, rows)`` of their
    pool, no destination slot twice; when source and destination are the same pool the two sets
    must be disjoint. Reads the values (a device sync when the slots are on a GPU).
    """
    _check_slot_tensor("src_slots", src_slots)
    _check_slot_tensor("dst_slots", dst_slots)
    if src_slots.numel() != dst_slots.numel():
        raise ValueError(f"src_slots has {src_slots.numel()} entries but dst_slots has {dst_slots.numel()}")
    if src_slots.numel() == 0:
        return
    for name, slots, rows in (("src_slots", src_slots, pools.src_rows), ("dst_slots", dst_slots, pools.dst_rows)):
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= rows:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{name} contains slot {bad}, outside the pool's [0, {rows})")
    unique_dst = torch.unique(dst_slots)
    if unique_dst.numel() != dst_slots.numel():
        raise ValueError(f"dst_slots contains duplicates ({dst_slots.numel() - unique_dst.numel()} repeated)")
    if pools.aliased_layers:
        overlap = torch.isin(src_slots.to(unique_dst.device), unique_dst)
        if bool(overlap.any()):
            slot = int(src_slots[overlap.to(src_slots.device)][0])
            raise ValueError(f"src and dst are the same pool and slot {slot} is both read and written")


# Triton decides at decoration time whether a kernel is compiled or interpreted.
_INTERPRETED = isinstance(_copy_kv_slots_kernel, InterpretedFunction)


def _is_interpreted() -> bool:
    return _INTERPRETED


def launch_device(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> torch.device:
    """Device the kernel runs on for checked pools; raises ``ValueError`` when none can.

    A GPU when either side is on one (the other side then must be on the same GPU or in pinned host
    memory); the CPU under ``TRITON_INTERPRET=1`` when both sides are host tensors.
    """
    s, d = src[0], dst[0]
    if _is_interpreted():
        if s.is_cuda or d.is_cuda:
            raise ValueError("TRITON_INTERPRET=1 cannot reach GPU memory: pass CPU pools or unset it")
        return torch.device("cpu")
    cuda = [t for t in (s, d) if t.is_cuda]
    if not cuda:
        raise ValueError(
            "both pools are host tensors and no GPU is involved: set TRITON_INTERPRET=1 or use "
            "naive_copy_kv_slots"
        )
    device = cuda[0].device
    for name, t in (("src", s), ("dst", d)):
        if t.is_cuda and t.device != device:
            raise ValueError(f"{name} is on {t.device} but the copy runs on {device}")
        if not t.is_cuda and not t.is_pinned():
            raise ValueError(f"{name} is in pageable host memory; the GPU can only reach pinned memory")
    return device


# Pointer tables by (device, addresses). A table holds nothing but the addresses, so an entry is
# valid for any later buffers at the same addresses; the bound only limits memory.
_TABLES: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_TABLES_MAX = 64


def pointer_table(bufs: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """int64 ``[layers]`` tensor on ``device`` holding each buffer's ``data_ptr()`` (cached)."""
    key = (str(device), tuple(b.data_ptr() for b in bufs))
    table = _TABLES.get(key)
    if table is None:
        # Uploaded without blocking, in the current stream's order.
        table = upload(np.array(key[1], dtype=np.int64), device)
        _TABLES[key] = table
        if len(_TABLES) > _TABLES_MAX:
            _TABLES.popitem(last=False)
    else:
        _TABLES.move_to_end(key)
    return table


def kernel_constants(pools: PoolPair, device_type: str) -> dict:
    """The kernel's constexpr arguments for checked pools on ``"cpu"`` (interpreter) or ``"cuda"``."""
    word = pools.word_bytes
    row_words = pools.row_bytes // word
    # Few large programs for the interpreter (each program costs Python time); small programs on
    # a GPU so that a 1,024-token chunk of 72 layers spreads over every SM (a 2 KiB row is one
    # [4, 256] tile of 8-byte words per program, 16-byte accesses per thread).
    if device_type == "cpu":
        block_slots, block_words = 256, min(triton.next_power_of_2(row_words), 1024)
    else:
        block_slots, block_words = 4, min(triton.next_power_of_2(row_words), 256)
    return dict(
        ROW_WORDS=row_words,
        DST_STRIDE=pools.dst_stride // word,
        SRC_STRIDE=pools.src_stride // word,
        WORD=_WORD_DTYPES[word][0],
        ALIGN=pools.address_align,
        BLOCK_SLOTS=block_slots,
        BLOCK_WORDS=block_words,
    )


def copy_launch(pools: PoolPair, src_table: torch.Tensor, dst_table: torch.Tensor, src_slots: torch.Tensor,
                dst_slots: torch.Tensor, device_type: str):
    """Grid, arguments and keyword arguments of one ``_copy_kv_slots_kernel`` launch (shared with
    ``compile_report``): ``src_table``/``dst_table`` from ``pointer_table``, one entry per buffer
    to copy (the grid's second dimension)."""
    constants = kernel_constants(pools, device_type)
    n = src_slots.numel()
    grid = (triton.cdiv(n, constants["BLOCK_SLOTS"]), src_table.numel())
    return grid, (dst_table, src_table, dst_slots, src_slots, n), dict(constants, num_warps=4)


def launch_copy(
    pools: PoolPair,
    src: Sequence[torch.Tensor] | None,
    dst: Sequence[torch.Tensor] | None,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    device: torch.device,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Launch the copy on the current stream of ``device`` WITHOUT checking the slots.

    For callers that validated a whole schedule once (the swap exchange); ``src_slots`` and
    ``dst_slots`` must already be contiguous on ``device`` and have passed ``check_slots``.
    ``tables``: prebuilt ``(src, dst)`` pointer tables (then ``src``/``dst`` are not read), e.g.
    slices of a whole pool's tables to copy some of its buffers.
    """
    if src_slots.numel() == 0:
        return
    src_table, dst_table = tables if tables is not None else (pointer_table(src, device), pointer_table(dst, device))
    grid, args, kwargs = copy_launch(pools, src_table, dst_table, src_slots, dst_slots, device.type)
    _copy_kv_slots_kernel[grid](*args, **kwargs)


def copy_kv_slots(
    src: Sequence[torch.Tensor],
    dst: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
) -> None:
    """Copy rows ``src[l][src_slots[i]]`` to ``dst[l][dst_slots[i]]`` for every layer, in one launch.

    Args:
        src, dst: lists of per-layer buffers ``[slots, H, D]`` (K and V of every layer), same length,
            dtype and row shape. Either side may be on a GPU or in pinned host memory; under
            ``TRITON_INTERPRET=1`` both are CPU tensors.
        src_slots, dst_slots: int64 ``[n]`` slot indices (on the CPU or the launch device); no
            destination slot twice; disjoint when ``src`` and ``dst`` are the same pool.

    Moves ``n * len(src) * H * D * element_size`` bytes bit for bit, asynchronously on the current
    stream. Raises ``ValueError`` on invalid input before touching memory.
    """
    pools = check_pools(src, dst)
    device = launch_device(src, dst)
    check_slots(pools, src_slots, dst_slots)
    launch_copy(pools, src, dst, src_slots.to(device).contiguous(), dst_slots.to(device).contiguous(), device)
