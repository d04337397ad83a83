"""A lower bound on the recompute cost of any eviction policy serving a given sequence of requests.

The offline `oracle` policy knows the future, but farthest-next-use is not optimal when tokens
differ in cost; this bound closes the bracket from below, so "distance to optimal" is an interval
[bound, oracle] rather than a guess.

The sequence is what one replay admitted and finished, in order (`ReplayResult.events`). Between
a request of session s finishing and s's next request being admitted (the next one the replay
served: requests that cannot fit are skipped), the private tokens the next
request reuses (its common prefix with the finished one, minus blocks any other session also has)
were in the cache at the finish; none can come back without being recomputed, because only s
computes them. At every admission e the cache holds at most its capacity C (GPU + CPU for two
tiers): the running requests' whole inputs and outputs (shared blocks once) plus whatever waiting
histories it kept. So at least

    d_e = running footprint + sum of the waiting private tokens - C

of the waiting tokens were gone at e, and each lost token is recomputed when its session comes
back, at no less than the cost of the cheapest tokens of its history (the front of its private
part: c_lin + attention at those positions, by the cost model). Choosing y_k lost tokens of each
waiting interval k covering every d_e at least cost is a linear program on a line; any
non-negative dual vector z (one price per admission) gives the lower bound

    sum_e d_e z_e - sum_k f_k*(sum_{e in k} z_e),

with f_k* the convex conjugate of the interval's cost of losing y tokens (weak duality), whatever
the solver did. Coordinate ascent on z (each step exact) approaches the LP's optimum; the value is
valid after any number of sweeps.

Valid for any policy that serves the same admissions in the same order. A closed-loop replay's
order depends on the policy, so each run is bounded on its own sequence; docs/results.md's bracket is
the oracle's run: [bound on its sequence, its cost].
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from penelope.sim.workloads.types import Workload

SWEEPS = 60


@dataclass(frozen=True)
class Interval:
    """A waiting session's reused private tokens: lost tokens cost alpha * y + beta * y**2 / 2 at
    least (the cheapest y of them); `events`: the admissions while it waits."""

    alpha: float
    beta: float
    tokens: int
    events: tuple[int, ...]

    def lost(self, price: float) -> float:
        """Tokens a price of `price` per token would buy back (the conjugate's argmax)."""
        if price <= self.alpha:
            return 0.0
        if self.beta <= 0:
            return float(self.tokens)
        return min(float(self.tokens), (price - self.alpha) / self.beta)

    def conjugate(self, price: float) -> float:
        y = self.lost(price)
        return price * y - self.alpha * y - self.beta * y * y / 2


def recompute_bound(workload: Workload, events: list[tuple[str, int, int]], capacity: int, cost_model,
                    sweeps: int = SWEEPS) -> float:
    """Lower bound (cost-model units) on the recompute cost of serving `events` (admissions and
    finishes in order, as `ReplayResult.events`) with a cache of `capacity` tokens; see the module
    docstring."""
    demands, intervals = _program(workload, events, capacity, cost_model)
    if not intervals or not any(d > 0 for d in demands):
        return 0.0
    covering: list[list[int]] = [[] for _ in demands]
    for k, interval in enumerate(intervals):
        for e in interval.events:
            covering[e].append(k)
    prices = [0.0] * len(demands)
    totals = [0.0] * len(intervals)
    order = [e for e, d in enumerate(demands) if d > 0 and covering[e]]
    for sweep in range(sweeps):
        changed = 0.0
        for e in (order if sweep % 2 == 0 else reversed(order)):
            ks = covering[e]
            others = [totals[k] - prices[e] for k in ks]
            price = _solve(demands[e], [intervals[k] for k in ks], others)
            if price != prices[e]:
                changed = max(changed, abs(price - prices[e]))
                for k, rest in zip(ks, others, strict=True):
                    totals[k] = rest + price
                prices[e] = price
        if changed == 0.0:
            break
    value = sum(d * z for d, z in zip(demands, prices, strict=True))
    value -= sum(interval.conjugate(total) for interval, total in zip(intervals, totals, strict=True))
    return max(0.0, value)


def _solve(demand: float, intervals: list[Interval], others: list[float]) -> float:
    """The smallest price z >= 0 at which the intervals give back `demand` tokens,
    sum_k lost_k(others_k + z) = demand (the largest useful z when they cannot)."""
    if sum(iv.lost(o) for iv, o in zip(intervals, others, strict=True)) >= demand:
        return 0.0
    # lost_k is piecewise linear in z with breakpoints where it starts and stops growing.
    points = sorted({max(0.0, iv.alpha - o) for iv, o in zip(intervals, others, strict=True)}
                    | {max(0.0, iv.alpha - o + iv.beta * iv.tokens) for iv, o in zip(intervals, others, strict=True)})
    low = 0.0
    for point in points:
        if sum(iv.lost(o + point) for iv, o in zip(intervals, others, strict=True)) >= demand:
            # Linear between `low` and `point`: interpolate.
            at_low = sum(iv.lost(o + low) for iv, o in zip(intervals, others, strict=True))
            at_point = sum(iv.lost(o + point) for iv, o in zip(intervals, others, strict=True))
            if at_point <= at_low:
                return point
            return low + (point - low) * (demand - at_low) / (at_point - at_low)
        low = point
    # Even every waiting token is not enough (cannot happen for a schedule that fit): price them all.
    return low


def _program(workload: Workload, events, capacity: int, cost_model) -> tuple[list[float], list[Interval]]:
    """Demands d_e (tokens, one per admission) and waiting intervals of a replay's events."""
    bs = workload.block_size
    shared = _shared_keys(workload)
    full_weight = float(cost_model.attention_cost(1.0) - cost_model.attention_cost(0.0))
    # Slope of attention cost per position beyond any sliding window: the smallest one.
    far = float(1 << 30)
    beta = min(full_weight, max(0.0, float(cost_model.attention_cost(far + 1.0) - cost_model.attention_cost(far))))

    shared_in_use: Counter = Counter()
    private_tokens = 0  # private whole blocks, partial last blocks and outputs of running requests
    waiting: dict[int, tuple[int, int, int]] = {}  # session -> (next admission, tokens, first position)
    footprints: list[int] = []
    spans: list[tuple[int, int, int, int]] = []  # (first admission, end admission, tokens, first position)
    # The request a session sends after one finishes is its next ADMITTED one: the replay skips
    # requests that cannot fit the cache, and the session goes on with the one after.
    served: dict[int, list[int]] = {}
    for kind, number, index in events:
        if kind == "admit":
            served.setdefault(number, []).append(index)
    following_of = {(number, a): b for number, indices in served.items()
                    for a, b in zip(indices[:-1], indices[1:], strict=True)}
    for kind, number, index in events:
        request = workload.sessions[number].requests[index]
        keys = np.unique(request.keys)
        is_shared = np.isin(keys, shared)
        own = (len(keys) - int(is_shared.sum())) * bs
        own += max(0, request.input_tokens - request.n_blocks * bs) + request.output_tokens
        if kind == "admit":
            if number in waiting:
                first_event, tokens, first = waiting.pop(number)
                spans.append((first_event, len(footprints), tokens, first))
            shared_in_use.update(keys[is_shared].tolist())
            private_tokens += own
            footprints.append(len(shared_in_use) * bs + private_tokens)
            continue
        shared_in_use.subtract(keys[is_shared].tolist())
        shared_in_use = +shared_in_use
        private_tokens -= own
        if (number, index) not in following_of:
            continue
        following = workload.sessions[number].requests[following_of[number, index]]
        n = min(request.n_blocks, following.n_blocks, request.input_tokens // bs)
        differ = np.flatnonzero(request.keys[:n] != following.keys[:n])
        reused = request.keys[:int(differ[0]) if len(differ) else n]
        private = np.flatnonzero(~np.isin(reused, shared))
        if len(private):
            waiting[number] = (len(footprints), len(private) * bs, int(private[0]) * bs)
    # Waits that end in an admission: their tokens are lost at a price; other waits never are.
    waiting_sum = np.zeros(len(footprints) + 1)
    intervals = []
    for first_event, end_event, tokens, first in spans:
        if end_event <= first_event:
            continue
        waiting_sum[first_event] += tokens
        waiting_sum[end_event] -= tokens
        alpha = float(cost_model.c_lin + cost_model.attention_cost(float(max(0, first - 1))))
        intervals.append(Interval(alpha, beta, tokens, tuple(range(first_event, end_event))))
    waiting_now = np.cumsum(waiting_sum)[:len(footprints)]
    demands = [max(0.0, float(f + w - capacity)) for f, w in zip(footprints, waiting_now, strict=True)]
    return demands, intervals


def _shared_keys(workload: Workload) -> np.ndarray:
    """Block keys that more than one session's requests contain (sorted)."""
    per_session = [np.unique(np.concatenate([r.keys for r in s.requests])) for s in workload.sessions if s.requests]
    if not per_session:
        return np.empty(0, dtype=np.int64)
    keys, counts = np.unique(np.concatenate(per_session), return_counts=True)
    return keys[counts > 1]
