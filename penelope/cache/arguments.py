"""Checks of the arguments the cache's public methods take: each bad value is one UsageError
naming the argument, raised before anything changes."""
from __future__ import annotations

import numbers

import numpy as np

from penelope.errors import UsageError
from penelope.memory import check_memory

_INT64_MAX = np.iinfo(np.int64).max
# Bytes `alloc(n)` takes per slot: the int64 result, an int64 temporary and the int8 owner tag.
_ALLOC_BYTES_PER_SLOT = 17
# Smaller allocations skip the memory check: reading /proc/meminfo would cost more than they do.
_CHECKED_ALLOC_BYTES = 1 << 26


def check_alloc_memory(n: int) -> None:
    """Raise UsageError, before anything is evicted or allocated, when handing out `n` slots
    would take more memory than is available (a pool of 2**31 slots is lazy: only what is handed
    out costs memory)."""
    if n * _ALLOC_BYTES_PER_SLOT >= _CHECKED_ALLOC_BYTES:
        check_memory(n * _ALLOC_BYTES_PER_SLOT, f"allocating {n:,} slots")


def count(value, what: str) -> int:
    """`value` as an int; UsageError unless it is a non-negative integer."""
    if type(value) is int and value >= 0:
        # The common case, before the slower check against the `numbers.Integral` ABC.
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise UsageError(f"{what} must be a non-negative integer, got {value!r}")
    return int(value)


def int_array(values, what: str) -> np.ndarray:
    """A 1-D contiguous int64 array; an int64 numpy array is used as is, without a copy."""
    if isinstance(values, np.ndarray) and values.dtype == np.int64 and values.ndim == 1:
        return np.ascontiguousarray(values)
    try:
        array = np.asarray(values)
    except (TypeError, ValueError) as error:
        raise UsageError(f"{what} must be a 1-D sequence of integers ({error})") from None
    if array.size == 0 and array.ndim == 1:
        return np.empty(0, dtype=np.int64)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise UsageError(f"{what} must be a 1-D sequence of integers, got {array.dtype} with shape {array.shape}")
    if array.dtype.kind == "u" and array.size and int(array.max()) > _INT64_MAX:
        raise UsageError(f"{what} has a value above the int64 range")
    return array.astype(np.int64)
