"""Stage 3: the paper's cost curve: the next request after front eviction (phantom hole + new tokens,
one batch) against tail eviction (recomputed tail + new tokens), per context, with the cost
model's prediction and the paper's figures (1.14x at 8K, 2.93x at 128K on an H100).

``bench_cost_curve.CurveRun`` on its GPU setup (Qwen3-8B's shape, random bf16 weights, the Triton
kernel through the reference engine). 8K and 128K first, the paper's two points, then 16K, 32K and
64K; a context that would not finish before the stage's deadline gets one round, else is skipped.
Each context is one ``context`` point the moment it is measured, with its new tokens timed alone
too (``CurveRun.measure_new_tokens``: so that even the first context alone fits the calibration's
three prefill constants); ``cost_curve.png`` at the end, with ``PLOT_SECONDS`` kept for it (else
it is skipped).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch
from bench_cost_curve import SETUPS, CurveRun, plot_curve, rounds_within_budget

from penelope.engine.decoder_config import BUILTIN_ENGINE_CONFIGS

from .context import PASSED, StageContext
from .files import PLOT_FILE

ORDER = tuple(k * 1024 for k in (8, 128, 16, 32, 64))
# Seconds kept for the summary and the plot after the last context (matplotlib's import is most of
# it on a loaded CPU); without them the plot is skipped rather than drawn past the deadline.
PLOT_SECONDS = 12.0
# The CPU: the paper's two points and one between, enough for every code path.
REDUCED_ORDER = tuple(k * 1024 for k in (8, 128, 32))
FULL = SETUPS["gpu"]
# The CPU: the tiny model at positions / 512 (contexts 16, 256 and 64), the kernel interpreted.
REDUCED = dataclasses.replace(SETUPS["gpu"], config=BUILTIN_ENGINE_CONFIGS["tiny"], dtype=torch.float32, scale=512,
                              rounds=1, decode_rounds=1)


def run(ctx: StageContext) -> int:
    setup = dataclasses.replace(FULL if ctx.full else REDUCED, budget_s=max(0.0, ctx.left()))
    curve = CurveRun(setup, ctx.device)
    about = dict(model=setup.config.name, dtype=str(setup.dtype).removeprefix("torch."), scale=setup.scale,
                 attention=setup.attention, c_lin=curve.cost.c_lin)
    for gpu_context in ORDER if ctx.full else REDUCED_ORDER:
        # The estimate is the last context's speed times this one's work (the cost model's units).
        plan = rounds_within_budget(curve, gpu_context, left=ctx.left() - PLOT_SECONDS)
        if isinstance(plan, str):
            ctx.log.write("skipped", what="context", gpu_context=gpu_context, reason=plan)
            continue
        rounds, warmup = plan
        # Interpreted on the CPU there is nothing to warm up, and the times are not the point.
        row = curve.measure(gpu_context, rounds=rounds, warmup=warmup if ctx.full else 0)
        # A third fit point: a curve cut after its first context still gives the prefill constants.
        row.update(curve.measure_new_tokens(gpu_context, rounds=rounds, warmup=warmup if ctx.full else 0))
        ctx.log.write("context", **about, **row)
    if not curve.rows:
        return PASSED
    curve.rows.sort(key=lambda row: row["gpu_context"])
    summary = curve.summary()
    ctx.log.write("summary", **about, contexts=[row["gpu_context"] for row in curve.rows],
                  max_abs_relative_error=summary["max_abs_relative_error"],
                  speedup_grows_with_context=summary["speedup_grows_with_context"])
    if importlib.util.find_spec("matplotlib") is None:
        ctx.log.write("skipped", what="plot", reason="matplotlib is not installed")
    elif ctx.has_time(PLOT_SECONDS, what="plot"):
        plot_curve(summary, ctx.out / PLOT_FILE)
    return PASSED
