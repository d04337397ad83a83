"""Statistics of replay ensembles: the mean of a metric over runs with a confidence interval, and
each policy's change against the baseline over paired runs.

A closed-loop replay is chaotic: a request finishing slightly earlier changes which history is
evicted next, and every later request feels it. An ensemble replays one setting N times, run i
with its own small perturbation (`penelope.sim.perturb`); the N values of a metric are treated as
a sample, and its mean is reported with a two-sided Student-t interval,

    mean +- t(1 - (1 - confidence) / 2, N - 1) * s / sqrt(N)

(s: the sample standard deviation). Policies are compared on PAIRED runs: run i of the baseline
and run i of the policy share the perturbation, so the change is computed per run,
`d_i = (policy_i - baseline_i) / baseline_i`, and its interval is that of the d_i. This is not the
change of the means: pairing removes the part of the noise both policies share.

A change is a win or a loss only when its interval excludes zero; otherwise there is no
significant difference. The interval is per comparison (no correction for the number of
comparisons in a table).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from penelope.errors import UsageError

CONFIDENCE = 0.95
WIN, LOSS, NO_DIFFERENCE = "win", "loss", "no significant difference"


def t_two_sided(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with `df` (a positive integer) degrees of freedom.

    The closed form for integer degrees of freedom (Abramowitz and Stegun 26.7.3 and 26.7.4):
    with theta = atan(t / sqrt(df)), a finite series in cos(theta)."""
    if isinstance(df, bool) or not isinstance(df, (int, np.integer)) or df < 1:
        raise UsageError(f"degrees of freedom must be a positive integer, got {df!r}")
    if t <= 0:
        return 0.0
    if math.isinf(t):
        return 1.0
    theta = math.atan(t / math.sqrt(df))
    sin, cos2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2 == 0:
        # sin(theta) * (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ... up to cos^(df-2)).
        term = total = 1.0
        for k in range(1, df // 2):
            term *= cos2 * (2 * k - 1) / (2 * k)
            total += term
        return min(1.0, sin * total)
    if df == 1:
        return 2.0 * theta / math.pi
    # 2/pi * (theta + sin * cos * (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ... up to cos^(df-3))).
    term = total = 1.0
    for k in range(1, (df - 1) // 2):
        term *= cos2 * (2 * k) / (2 * k + 1)
        total += term
    return min(1.0, 2.0 / math.pi * (theta + sin * math.sqrt(cos2) * total))


def t_quantile(confidence: float, df: int) -> float:
    """The t with P(|T| <= t) = `confidence` (0 < confidence < 1) for `df` degrees of freedom:
    the half-width of a two-sided interval in standard errors (12.706 for df 1, 2.262 for df 9
    at 95%). Found by bisection on `t_two_sided` to machine precision."""
    if not 0 < confidence < 1:
        raise UsageError(f"confidence must be between 0 and 1, got {confidence}")
    t_two_sided(1.0, df)  # validates df
    low, high = 0.0, 1.0
    while t_two_sided(high, df) < confidence:
        high *= 2.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        if mid in (low, high):
            break
        if t_two_sided(mid, df) < confidence:
            low = mid
        else:
            high = mid
    return high


@dataclass(frozen=True)
class Estimate:
    """The mean of `n` values with its two-sided interval [low, high] at `confidence`.

    With one value, or when a value is NaN, the interval is NaN (unknown)."""

    mean: float
    low: float
    high: float
    n: int
    confidence: float = CONFIDENCE

    @classmethod
    def of(cls, values: Sequence[float], confidence: float = CONFIDENCE) -> Estimate:
        """Mean and Student-t interval of `values` (see the module docstring)."""
        data = np.asarray(list(values), dtype=np.float64)
        if data.size == 0:
            raise UsageError("an estimate needs at least one value")
        if np.isnan(data).any():
            return cls(math.nan, math.nan, math.nan, int(data.size), confidence)
        mean = float(np.mean(data))
        if data.size == 1:
            return cls(mean, math.nan, math.nan, 1, confidence)
        # Equal values have no spread; do not let rounding in std() invent one.
        spread = 0.0 if np.all(data == data[0]) else float(np.std(data, ddof=1))
        half = t_quantile(confidence, data.size - 1) * spread / math.sqrt(data.size)
        return cls(mean, mean - half, mean + half, int(data.size), confidence)

    @property
    def half_width(self) -> float:
        return 0.5 * (self.high - self.low)

    @property
    def has_interval(self) -> bool:
        return not (math.isnan(self.low) or math.isnan(self.high))

    def verdict(self, lower_is_better: bool = True) -> str:
        """`win` or `loss` when the interval excludes zero, else `no significant difference`
        (also without an interval). For a change of a metric where lower is better (a time),
        below zero is a win; otherwise (a hit rate) above zero is."""
        if not self.has_interval or self.low <= 0 <= self.high:
            return NO_DIFFERENCE
        better = self.high < 0 if lower_is_better else self.low > 0
        return WIN if better else LOSS

    def as_dict(self) -> dict:
        return {"mean": self.mean, "low": self.low, "high": self.high, "n": self.n,
                "confidence": self.confidence}

    @classmethod
    def from_dict(cls, data: dict) -> Estimate:
        """The inverse of `as_dict` (JSON's null read as NaN)."""
        def number(key):
            value = data.get(key)
            return math.nan if value is None else float(value)

        return cls(number("mean"), number("low"), number("high"), int(data["n"]),
                   float(data.get("confidence", CONFIDENCE)))


def paired_changes(values: Sequence[float], baseline: Sequence[float]) -> list[float]:
    """Relative change of run i against run i of the baseline, `(v_i - b_i) / b_i`, per run
    (NaN where the baseline is 0)."""
    if len(values) != len(baseline):
        raise UsageError(f"paired runs need as many baseline runs as runs, got {len(baseline)} and {len(values)}")
    return [(v - b) / b if b else math.nan for v, b in zip(values, baseline, strict=True)]


def paired_differences(values: Sequence[float], baseline: Sequence[float]) -> list[float]:
    """Difference of run i and run i of the baseline, `v_i - b_i`, per run."""
    if len(values) != len(baseline):
        raise UsageError(f"paired runs need as many baseline runs as runs, got {len(baseline)} and {len(values)}")
    return [v - b for v, b in zip(values, baseline, strict=True)]
