"""Fit of the time model's constants to timed prefill batches and decode steps.

The simulator charges a prefill batch ``batch_overhead + sec_per_linear_unit * c_lin * tokens +
sec_per_attention_pair * pairs`` (``penelope.sim.timemodel``). ``fit_calibration`` fits those three
constants to measured batches and returns them with ``model``/``gpu``/``source``, the keys of a
calibration file (``timemodel.write_calibration`` merges them into one; ``TimeModel.from_json``
reads it). ``microbench/bench_cost_curve.py`` and ``penelope calibrate`` measure the batches;
``fit_decode`` fits the decode constants to the steps ``penelope calibrate`` measures.

``fastest_repeats`` keeps the fastest of the repeats of each point before a fit: on a shared
machine, other processes and a first run of a batch shape only ever add time.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

# Contexts at which a KV token costs twice a short request's (1 / kv_read_growth) that the decode
# fit tries, relative to the longest measured context: 2^(1/8) apart, from a sixteenth of the
# shortest context to 64 times the longest.
_GROWTH_STEP = 2 ** (1 / 8)
_GROWTH_SPAN = (1 / 16, 64)
# Golden-section steps refining the best growth of the grid (each narrows its range by 0.618).
_GROWTH_REFINE_STEPS = 40


def _nnls_fit(features: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients, by trying every subset of features (3 here)."""
    best, best_err = np.zeros(features.shape[1]), float(np.sum(target**2))
    for size in range(1, features.shape[1] + 1):
        for subset in itertools.combinations(range(features.shape[1]), size):
            coef, *_ = np.linalg.lstsq(features[:, subset], target, rcond=None)
            if np.any(coef < 0):
                continue
            err = float(np.sum((features[:, subset] @ coef - target) ** 2))
            if err < best_err:
                best_err = err
                best = np.zeros(features.shape[1])
                best[list(subset)] = coef
    return best


def fit_calibration(points, model: str, gpu: str | None, source: str) -> dict:
    """Fit the time model's prefill constants to measured batches.

    points: ``(linear_units, attention_pairs, seconds)`` per timed prefill batch, units as in
    ``penelope.costmodel.recompute`` (``linear_units = c_lin * tokens``): ``seconds = batch_overhead +
    sec_per_linear_unit * linear_units + sec_per_attention_pair * pairs`` with non-negative
    constants, each point weighed by 1 / seconds (relative errors). Constants the data cannot
    determine (a zero fit) are left out, so the simulator keeps its estimate for them.
    """
    result: dict = {"model": model}
    if gpu is not None:
        result["gpu"] = gpu
    result["source"] = source
    # A point's weight is 1 / seconds: a time that is not positive is no measurement.
    points = [p for p in points if p[2] > 0]
    if len(points) >= 3:
        data = np.asarray(points, dtype=np.float64)
        weight = 1.0 / data[:, 2]
        features = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]]) * weight[:, None]
        overhead, per_linear, per_pair = _nnls_fit(features, data[:, 2] * weight)
        if per_linear > 0:
            result["sec_per_linear_unit"] = float(per_linear)
        if per_pair > 0:
            result["sec_per_attention_pair"] = float(per_pair)
        result["batch_overhead"] = float(overhead)
    return result


def fit_quality(predicted, measured) -> dict:
    """R^2 of `predicted` against `measured` seconds and the largest relative error (|p - m| / m)."""
    p, m = np.asarray(predicted, dtype=np.float64), np.asarray(measured, dtype=np.float64)
    total = float(np.sum((m - m.mean()) ** 2))
    r2 = 1.0 - float(np.sum((m - p) ** 2)) / total if total > 0 else float("nan")
    worst = float(np.max(np.abs(p - m) / m)) if len(m) else float("nan")
    return {"r2": r2, "max_relative_error": worst, "points": int(len(m))}


def prefill_prediction(fit: dict, linear_units, pairs) -> np.ndarray:
    """Seconds `fit_calibration`'s constants give for each prefill batch (one batch per point)."""
    return (fit.get("batch_overhead", 0.0) + fit.get("sec_per_linear_unit", 0.0) * np.asarray(linear_units, float)
            + fit.get("sec_per_attention_pair", 0.0) * np.asarray(pairs, float))


def fastest_repeats(points: Sequence[Sequence[float]]) -> list[tuple]:
    """Each point's fastest repeat: points whose work (every field but the last, the seconds) is
    the same are repeats; the one with the fewest positive seconds is kept, in the order work first
    appears. Points without a positive time are left out."""
    fastest: dict[tuple, float] = {}
    for *work, seconds in points:
        key = tuple(work)
        if seconds > 0 and (key not in fastest or seconds < fastest[key]):
            fastest[key] = seconds
    return [(*work, seconds) for work, seconds in fastest.items()]


def repeat_spread(points: Sequence[Sequence[float]]) -> tuple[float, float] | None:
    """(median, largest) of (slowest - fastest) / fastest over the points measured more than once
    (work as in `fastest_repeats`); None when no point was repeated."""
    times: dict[tuple, list[float]] = {}
    for *work, seconds in points:
        if seconds > 0:
            times.setdefault(tuple(work), []).append(seconds)
    spreads = [(max(t) - min(t)) / min(t) for t in times.values() if len(t) > 1]
    if not spreads:
        return None
    return float(np.median(spreads)), float(max(spreads))


def fit_decode(points, kv_bytes_per_token: float) -> dict:
    """The decode constants of the time model from measured steps ``(batch, kv_tokens, seconds)``.

    The time model charges a step ``decode_overhead + (weight_bytes + embedding_row_bytes * batch +
    kv_bytes_per_token * kv_tokens * (1 + kv_read_growth * kv_tokens / batch)) / hbm_bandwidth``.
    For each growth g of a grid (0, and 1 / L for contexts L 2^(1/8) apart over `_GROWTH_SPAN` of
    the measured contexts) a non-negative fit of ``d0 + d1 * batch + d2 * kv_tokens * (1 + g *
    kv_tokens / batch)`` (relative errors), the best growth of the grid refined between its
    neighbours by golden section; the growth kept is 0 unless another lowers the Akaike
    information criterion (n log(RSS / n) + 2 per constant: it must cut the residuals by more than
    its one constant's worth). With `kv_bytes_per_token` as given: ``hbm_bandwidth =
    kv_bytes_per_token / d2`` (the rate a short request's KV is read at), the step's fixed time in
    ``decode_overhead = d0`` with ``weight_bytes = 0``, ``embedding_row_bytes = d1 *
    hbm_bandwidth``, ``kv_read_growth = g``. Empty when fewer than 3 points, or when the steps do
    not grow with the KV (d2 = 0 for every growth: no bandwidth can be read from them)."""
    points = [p for p in points if p[2] > 0]
    if len(points) < 3:
        return {}
    data = np.asarray(points, dtype=np.float64)
    batch, kv, seconds = data[:, 0], data[:, 1], data[:, 2]
    context = kv / batch
    weight = 1.0 / seconds

    def fit(growth: float) -> tuple[float, float, np.ndarray] | None:
        """(Akaike score, growth, coefficients) of the fit with this growth; None when d2 = 0."""
        features = np.column_stack([np.ones(len(data)), batch, kv * (1.0 + growth * context)]) * weight[:, None]
        coef = _nnls_fit(features, seconds * weight)
        if coef[2] <= 0:
            return None
        rss = float(np.sum((features @ coef - seconds * weight) ** 2))
        # n log(RSS / n) + 2 k, k = 3 constants and 4 with a growth; an exact fit is the best there is.
        return len(data) * np.log(max(rss, 1e-300) / len(data)) + 2 * (3 + (growth > 0)), growth, coef

    low, high = _GROWTH_SPAN[0] * context.min(), _GROWTH_SPAN[1] * context.max()
    count = int(np.floor(np.log(high / low) / np.log(_GROWTH_STEP))) + 1
    grid = [1.0 / (low * _GROWTH_STEP**k) for k in range(count)]
    fits = [f for f in map(fit, [0.0, *grid]) if f is not None]
    if not fits:
        return {}
    best = min(fits, key=lambda f: f[0])
    if best[1] > 0:
        # Between the grid's neighbours of the best growth, by golden section on its logarithm.
        a, b = np.log(best[1] / _GROWTH_STEP), np.log(best[1] * _GROWTH_STEP)
        ratio = (np.sqrt(5) - 1) / 2
        for _ in range(_GROWTH_REFINE_STEPS):
            c, d = b - ratio * (b - a), a + ratio * (b - a)
            fc, fd = fit(float(np.exp(c))), fit(float(np.exp(d)))
            if fd is None or (fc is not None and fc[0] < fd[0]):
                b = d
            else:
                a = c
        refined = fit(float(np.exp((a + b) / 2)))
        if refined is not None and refined[0] <= best[0]:
            best = refined
    _, growth, (d0, d1, d2) = best
    bandwidth = kv_bytes_per_token / d2
    return {"decode_overhead": float(d0), "weight_bytes": 0.0, "embedding_row_bytes": float(d1 * bandwidth),
            "kv_bytes_per_token": float(kv_bytes_per_token), "hbm_bandwidth": float(bandwidth),
            "kv_read_growth": float(growth)}


def decode_prediction(fit: dict, batches, kv_tokens) -> np.ndarray:
    """Seconds per step `fit_decode`'s constants give for each point."""
    b, kv = np.asarray(batches, float), np.asarray(kv_tokens, float)
    kv_read = fit["kv_bytes_per_token"] * kv * (1.0 + fit.get("kv_read_growth", 0.0) * kv / b)
    read = fit["weight_bytes"] + fit["embedding_row_bytes"] * b + kv_read
    return fit["decode_overhead"] + read / fit["hbm_bandwidth"]
