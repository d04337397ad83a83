"""What a serving team should know about its traffic before choosing a KV-cache policy.

- Request lengths: input and output token percentiles (`workload_stats`).
- Shared prefix: the longest key prefix that the first requests of ALL sessions share (the
  tools+system prompt), and per session the longest one it shares with any other session.
- Hit rate under an unbounded cache: requests in send order (sessions in workload order, each in
  its own order; open loop by arrival); a request reuses the leading run of its blocks that an
  earlier request already had at the same position. Block `(position, key)` pairs identify
  history because equal keys mean equal history before the block in these formats (see
  `workloads.py`). The partial last block never counts. This is the ceiling any policy can reach.
- Reuse distance of a request (every request after a session's first): the KV tokens OTHER
  sessions touch between this session's previous request and this one, each other session
  counted once at its largest input in that interval, the all-session shared prefix left out
  (it stays hot). A cache whose capacity exceeds the shared prefix + this request's previous
  input + its reuse distance keeps its history under LRU: the fraction of requests for which
  that holds at a capacity is the `lru_fit` estimate. The order of requests comes from a replay
  (send times), since in a closed loop it depends on the server.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from penelope.sim.metrics import RequestRecord, percentile
from penelope.sim.workloads.types import Workload


def shared_prefix(workload: Workload) -> dict[str, float]:
    """Shared-prefix figures in tokens: `all_sessions` (common to every session's first request),
    and the median and max over sessions of the longest prefix shared with another session."""
    firsts = [s.requests[0].keys for s in workload.sessions if s.requests]
    size = workload.block_size
    if len(firsts) < 2:
        return {"all_sessions": 0.0, "pairwise_p50": 0.0, "pairwise_max": 0.0}
    common = firsts[0]
    for keys in firsts[1:]:
        common = common[: _common_prefix(common, keys)]
    # The longest common prefix with any other sequence is with a neighbour in sorted order.
    order = sorted(range(len(firsts)), key=lambda i: tuple(firsts[i].tolist()))
    best = [0] * len(firsts)
    for a, b in zip(order, order[1:], strict=False):
        n = _common_prefix(firsts[a], firsts[b])
        best[a] = max(best[a], n)
        best[b] = max(best[b], n)
    return {
        "all_sessions": float(len(common) * size),
        "pairwise_p50": float(np.median(best) * size),
        "pairwise_max": float(max(best) * size),
    }


def unbounded_reuse(requests: Iterable, block_size: int):
    """(request, tokens a cache that never evicts holds for it) for `requests` in the order given:
    the leading whole blocks some earlier request sent at the same positions."""
    seen: set[tuple[int, int]] = set()
    for request in requests:
        keys = request.keys.tolist()
        # Only whole blocks are cached; the last key may cover a partial block (Mooncake).
        whole = min(len(keys), request.input_tokens // block_size)
        run = 0
        while run < whole and (run, keys[run]) in seen:
            run += 1
        seen.update(zip(range(run, whole), keys[run:whole], strict=True))
        yield request, run * block_size


def unbounded_hit_rate(workload: Workload) -> dict[str, float]:
    """Token hit rate with a cache that never evicts (see the module docstring)."""
    hit = total = 0
    for request, reused in unbounded_reuse(_send_order(workload), workload.block_size):
        hit += reused
        total += request.input_tokens
    return {"hit_rate": hit / total if total else float("nan"), "hit_tokens": hit, "input_tokens": total}


def reuse_distances(records: Iterable[RequestRecord], shared_tokens: int) -> list[tuple[int, int]]:
    """(previous input tokens of the session, reuse distance in tokens) for every request after
    its session's first, in send order (see the module docstring)."""
    order = sorted(records, key=lambda r: (r.send_time, r.session, r.index))
    previous: dict[str, int] = {}
    result = []
    for j, record in enumerate(order):
        i = previous.get(record.session)
        if i is not None:
            footprint: dict[str, int] = {}
            for other in order[i + 1 : j]:
                if other.session != record.session:
                    private = max(0, other.input_tokens - shared_tokens)
                    footprint[other.session] = max(footprint.get(other.session, 0), private)
            result.append((order[i].input_tokens, sum(footprint.values())))
        previous[record.session] = j
    return result


def reuse_summary(distances: list[tuple[int, int]], shared_tokens: int, capacity: int) -> dict[str, float]:
    """Percentiles of the reuse distance and the LRU fit estimate at `capacity` tokens."""
    values = [d for _, d in distances]
    fits = sum(shared_tokens + own + d <= capacity for own, d in distances)
    return {
        "reuses": len(values),
        "p10": percentile(values, 10),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "max": float(max(values)) if values else float("nan"),
        "lru_fit": fits / len(values) if values else float("nan"),
    }


def _send_order(workload: Workload):
    if workload.closed_loop:
        for session in workload.sessions:
            yield from session.requests
        return
    requests = [r for s in workload.sessions for r in s.requests]
    yield from sorted(requests, key=lambda r: r.arrival)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n
