"""Fit of the time model's prefill constants to timed prefill batches.

The simulator charges a prefill batch ``batch_overhead + sec_per_linear_unit * c_lin * tokens +
sec_per_attention_pair * pairs`` (``penelope.sim.timemodel``). ``fit_calibration`` fits those three
constants to measured batches and returns them with ``model``/``gpu``/``source``, the keys of a
calibration file (``timemodel.write_calibration`` merges them into one; ``TimeModel.from_json``
reads it). ``microbench/bench_cost_curve.py`` measures the batches.
"""

from __future__ import annotations

import itertools

import numpy as np


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
