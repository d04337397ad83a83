"""Metrics of a replay: per-request TTFT, per-session completion time (JCT), cache hit rate.

Definitions (times in seconds of simulated time):
- TTFT of a request: `first_token_time - send_time`. The send time is when the request reaches
  the server (closed loop: previous reply + think_time; open loop: its arrival); the first token
  comes out of the batch that computes the request's last prompt chunk, so TTFT includes
  queueing, CPU->GPU loads, phantom refills and the prefill itself.
- JCT of a session: last `finish_time` minus first `send_time` among its requests.
- Hit rate: reused input tokens / input tokens, summed over requests (token-weighted). Reused
  means the KV was not computed for this request: found on GPU or loaded from CPU. Tokens
  refilled by a phantom are not reused.
- Recomputed tokens: tokens computed again although their KV had been computed before (phantom
  refills of holes and re-prefill of evicted tails); `recompute_cost` is their cost in the cost
  model's attention-pair units.
- Priming requests (`RequestRecord.measured` False, `simulate --prime`) are left out of every
  figure: TTFT, JCT (from a session's first measured send), hit rate and token counts.
- Percentiles: linear interpolation between closest ranks (numpy's default "linear" method,
  Hyndman-Fan type 7): for sorted values x[0..n-1], the q-th percentile is at rank
  h = (n - 1) * q / 100, i.e. x[floor(h)] + (h - floor(h)) * (x[floor(h) + 1] - x[floor(h)]).
  p50 of [1, 2, 3, 4] is 2.5; p90 is 3.7. Empty inputs give NaN.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from penelope.errors import UsageError


@dataclass(frozen=True)
class RequestRecord:
    """What the simulator records for one finished request (times in s, sizes in tokens);
    `replica`: the server that served it (0 with one server); `admit_time`: when the prefill batch
    of its first chunk started (its wait in the queue ends then); `measured`: False for a request
    that primes the cache (left out of `summarize`)."""

    session: str
    index: int
    send_time: float
    first_token_time: float
    finish_time: float
    input_tokens: int
    reused_tokens: int
    recomputed_tokens: int = 0
    recompute_cost: float = 0.0
    loaded_tokens: int = 0
    swap_loads: int = 0
    replica: int = 0
    admit_time: float | None = None
    measured: bool = True

    def __post_init__(self) -> None:
        where = f"request {self.index} of session {self.session!r}"
        if not self.send_time <= self.first_token_time <= self.finish_time:
            raise UsageError(
                f"{where}: times must satisfy send <= first token <= finish, got "
                f"{self.send_time}, {self.first_token_time}, {self.finish_time}"
            )
        if not 0 <= self.reused_tokens <= self.input_tokens:
            raise UsageError(f"{where}: reused tokens {self.reused_tokens} not in [0, {self.input_tokens}]")
        if min(self.recomputed_tokens, self.recompute_cost, self.loaded_tokens, self.swap_loads) < 0:
            raise UsageError(f"{where}: counters must be non-negative")

    @property
    def ttft(self) -> float:
        return self.first_token_time - self.send_time

    @property
    def queue_time(self) -> float:
        """Seconds from its send time to its admission (NaN when unknown)."""
        return self.admit_time - self.send_time if self.admit_time is not None else math.nan


@dataclass(frozen=True)
class Summary:
    """Aggregate metrics of one replay (one policy). Times in s, sizes in tokens."""

    requests: int
    sessions: int
    ttft_mean: float
    ttft_p50: float
    ttft_p90: float
    jct_mean: float
    jct_p50: float
    jct_p90: float
    hit_rate: float
    input_tokens: int
    reused_tokens: int
    recomputed_tokens: int
    recompute_cost: float
    loaded_tokens: int
    swap_loads: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) by linear interpolation between closest ranks; NaN if empty."""
    if not 0 <= q <= 100:
        raise UsageError(f"percentile must be in [0, 100], got {q}")
    array = np.asarray(list(values), dtype=np.float64)
    if array.size == 0:
        return math.nan
    return float(np.percentile(array, q, method="linear"))


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else math.nan


def session_jcts(records: Iterable[RequestRecord]) -> dict[str, float]:
    """JCT per session: last finish minus first send among the session's records."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for record in records:
        first[record.session] = min(first.get(record.session, math.inf), record.send_time)
        last[record.session] = max(last.get(record.session, -math.inf), record.finish_time)
    return {session: last[session] - first[session] for session in first}


def summarize(records: Iterable[RequestRecord]) -> Summary:
    """Aggregate the measured request records (any order) into TTFT, JCT and cache figures."""
    records = [r for r in records if r.measured]
    ttfts = [r.ttft for r in records]
    jcts = list(session_jcts(records).values())
    input_tokens = sum(r.input_tokens for r in records)
    reused = sum(r.reused_tokens for r in records)
    return Summary(
        requests=len(records),
        sessions=len(jcts),
        ttft_mean=_mean(ttfts),
        ttft_p50=percentile(ttfts, 50),
        ttft_p90=percentile(ttfts, 90),
        jct_mean=_mean(jcts),
        jct_p50=percentile(jcts, 50),
        jct_p90=percentile(jcts, 90),
        hit_rate=reused / input_tokens if input_tokens else math.nan,
        input_tokens=input_tokens,
        reused_tokens=reused,
        recomputed_tokens=sum(r.recomputed_tokens for r in records),
        recompute_cost=float(sum(r.recompute_cost for r in records)),
        loaded_tokens=sum(r.loaded_tokens for r in records),
        swap_loads=sum(r.swap_loads for r in records),
    )


CHANGE_FIELDS = (
    "ttft_mean",
    "ttft_p50",
    "ttft_p90",
    "jct_mean",
    "jct_p50",
    "jct_p90",
    "recomputed_tokens",
    "recompute_cost",
)


def relative_change(value: float, baseline: float) -> float:
    """(value - baseline) / baseline: -0.36 means 36% lower. NaN when the baseline is 0."""
    return (value - baseline) / baseline if baseline else math.nan


def changes_against(results: Mapping[str, Summary], baseline: str = "sglang") -> dict[str, dict[str, float]]:
    """Each policy's relative change of `CHANGE_FIELDS` against `baseline`, and its hit-rate
    difference in percentage points (`hit_rate_points`)."""
    if baseline not in results:
        raise UsageError(f"baseline policy {baseline!r} is not among the results ({', '.join(results)})")
    base = results[baseline]
    changes = {}
    for name, summary in results.items():
        row = {f: relative_change(getattr(summary, f), getattr(base, f)) for f in CHANGE_FIELDS}
        row["hit_rate_points"] = 100.0 * (summary.hit_rate - base.hit_rate)
        changes[name] = row
    return changes
