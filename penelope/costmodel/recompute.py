"""Recompute cost of KV-cache tokens by position (the paper's section 2.2).

Unit: one attention query-key pair summed over all layers and heads, that is
`4 * head_dim * num_q_heads * num_layers` FLOPs. Recomputing the token at position p costs its
linear layers, `c_lin` units whatever the position, plus attention over the tokens before it:
p units for a model whose layers all use full attention. Sliding-window layers pay at most their
window, linear-attention layers pay nothing that grows with position; the per-layer terms are
averaged over layers because the unit already sums over them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from penelope.costmodel.shapes import FULL, SLIDING, ModelShape
from penelope.errors import UsageError


@runtime_checkable
class RecomputeCost(Protocol):
    """What the cache and its policies read of a cost model: the cost of recomputing positions
    [start, end) of a sequence, in one unit of the model's choosing (`CostModel`, `TokenCost`)."""

    def span_cost(self, start: int, end: int) -> float:
        """Cost of positions [start, end)."""


class TokenCost:
    """The cost model of a cache built without one: every token costs 1 wherever it is."""

    def span_cost(self, start: int, end: int) -> float:
        return float(end - start)


class CostModel:
    """Position-dependent recompute cost of a model shape, in attention-pair units (a
    `RecomputeCost`)."""

    def __init__(self, shape: ModelShape):
        self.shape = shape
        self.flops_per_unit = 4.0 * shape.head_dim * shape.num_q_heads * shape.num_layers
        self.c_lin = shape.linear_flops_per_token() / self.flops_per_unit
        layers = shape.num_layers
        self._full_weight = sum(kind == FULL for kind in shape.layer_kinds) / layers
        self._sliding_weight = sum(kind == SLIDING for kind in shape.layer_kinds) / layers
        self._window = shape.sliding_window

    def attention_cost(self, p):
        """Attention units of the token at position `p` (scalar or numpy array)."""
        p = np.asarray(p, dtype=np.float64)
        cost = self._full_weight * p
        if self._sliding_weight:
            cost = cost + self._sliding_weight * np.minimum(p, self._window)
        return cost if cost.ndim else float(cost)

    def position_cost(self, p):
        """Total recompute units of the token at position `p` (scalar or numpy array)."""
        return self.c_lin + self.attention_cost(p)

    def attention_pairs(self, start: int, end: int) -> float:
        """Attention units of positions [start, end), in closed form."""
        _check_span(start, end)
        full = (start + end - 1) * (end - start) / 2.0
        cost = self._full_weight * full
        if self._sliding_weight:
            cost += self._sliding_weight * _sum_min(start, end, self._window)
        return float(cost)

    def span_cost(self, start: int, end: int) -> float:
        """Recompute units of positions [start, end)."""
        _check_span(start, end)
        return self.c_lin * (end - start) + self.attention_pairs(start, end)

    def spans_cost(self, spans) -> float:
        """Recompute units of several (start, end) spans."""
        return sum(self.span_cost(int(start), int(end)) for start, end in spans)


# Positions beyond any context a cache can hold (2**31 slots), with room to spare; below this the
# closed forms stay finite and exact to float precision.
MAX_POSITION = 2**40


def _check_span(start: int, end: int) -> None:
    # Written so that NaN fails too.
    if not 0 <= start <= end <= MAX_POSITION:
        raise UsageError(f"invalid position span [{start}, {end}): positions are in [0, 2**40]")


def _sum_min(start: int, end: int, window: int) -> float:
    """Sum of min(p, window) for p in [start, end)."""
    below_end = min(end, window)
    below = (start + below_end - 1) * (below_end - start) / 2.0 if below_end > start else 0.0
    above = (end - max(start, window)) * window if end > max(start, window) else 0.0
    return below + above


@dataclass(frozen=True)
class SpeedupPrediction:
    """The paper's experiment for one context: cost of the next request after each eviction."""

    context: int
    evicted: int
    evict_start: int
    append: int
    front_cost: float
    tail_cost: float

    @property
    def predicted_speedup(self) -> float:
        return self.tail_cost / self.front_cost if self.front_cost else float("nan")


def predict_speedup(
    cost: CostModel,
    context: int,
    evict_frac: float | None = 0.3,
    evict_start: int = 2048,
    append: int = 512,
    evicted: int | None = None,
) -> SpeedupPrediction:
    """Cache `context` tokens, evict `evicted` tokens (or `round(evict_frac * context)`) either as
    one span starting at `evict_start` (front) or from the tail, then append `append` new tokens.

    Returns the cost of the next request in both cases: front = recompute the span + the new
    tokens; tail = recompute the last `evicted` tokens + the new tokens."""
    if context <= 0:
        raise UsageError(f"context must be positive, got {context}")
    if append < 0:
        raise UsageError(f"append must be non-negative, got {append}")
    if evicted is None:
        if evict_frac is None or not 0.0 < evict_frac < 1.0:
            raise UsageError(f"--evict-frac must be in (0, 1), got {evict_frac}")
        evicted = round(evict_frac * context)
    if evicted <= 0:
        raise UsageError(f"evicted tokens must be positive, got {evicted}")
    if evict_start < 0 or evict_start >= context:
        raise UsageError(f"`evict_start` {evict_start} is not inside a context of {context} tokens")
    if evict_start + evicted > context:
        raise UsageError(
            f"cannot evict {evicted} tokens from position {evict_start} in a context of {context}"
        )
    new = cost.span_cost(context, context + append)
    front = cost.span_cost(evict_start, evict_start + evicted) + new
    tail = cost.span_cost(context - evicted, context) + new
    return SpeedupPrediction(context, evicted, evict_start, append, front, tail)
