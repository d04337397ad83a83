"""Interleaved comparisons: the orders in which a benchmark runs its configurations, and the
interval of a median over the segments so timed.

A configuration timed right after another runs in the memory state the other left: on a 2-core
machine with a shared 32 MiB L3, the same cache code measured 5-7% slower after SGLang's Python
caches than after a compact one (two identical adapters, one process). Rotating one fixed order
(A B C, B C A, ...) gives every configuration the same predecessor every time, so that effect
lands on one of them in full. `balanced_orders` gives every configuration every other one as its
predecessor equally often within the orders, and every position equally often; `Scrub` runs
before each order, so that the first configuration of an order always follows the same neutral
work (not the previous order's last configuration).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

# Twice the 32 MiB L3 of the machines this runs on.
SCRUB_BYTES = 64 << 20


class Scrub:
    """Work that evicts the CPU caches: one pass writing a buffer of `nbytes`."""

    def __init__(self, nbytes: int = SCRUB_BYTES):
        self._buffer = np.zeros(nbytes, dtype=np.uint8)

    def __call__(self) -> None:
        self._buffer += 1


def balanced_orders(names: Sequence[str]) -> list[list[str]]:
    """Orders of `names` in which each name directly follows each other name equally often
    and takes each position equally often (a Williams design): n orders for an even count n, 2n
    for an odd one above 1 (the n rotations of 0, 1, n-1, 2, n-2, ... and, for odd n, their
    reverses)."""
    n = len(names)
    if n == 0:
        return []
    if len(set(names)) != n:
        raise ValueError(f"names must be distinct, got {list(names)}")
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [[(i + shift) % n for i in first] for shift in range(n)]
    if n % 2 and n > 1:
        rows += [row[::-1] for row in rows]
    return [[names[i] for i in row] for row in rows]


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(median, low, high): the sample median and the distribution-free interval of the median
    between two order statistics, x_(j) and x_(n+1-j) with the largest j whose coverage,
    P(j <= Binomial(n, 1/2) <= n - j), is at least `confidence`; with too few values for that
    coverage, the whole range (min, max). The coverage holds for independent, identically
    distributed values; a benchmark's segments carry state from one to the next, so read it as
    an approximation there."""
    data = sorted(float(v) for v in values)
    n = len(data)
    if n == 0:
        raise ValueError("a median needs at least one value")
    if any(math.isnan(v) for v in data):
        raise ValueError("a median of values with NaN among them is undefined")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    median = (data[(n - 1) // 2] + data[n // 2]) / 2
    # Below: P(Binomial(n, 1/2) < j), the chance that fewer than j values lie below the median.
    below, j = 0.0, 0
    while j + 1 <= n // 2:
        below_next = below + math.comb(n, j) / 2 ** n
        if 1 - 2 * below_next < confidence:
            break
        below, j = below_next, j + 1
    j = max(j, 1)
    return median, data[j - 1], data[n - j]
