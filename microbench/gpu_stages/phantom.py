"""Stage 6: phantom batching at 32K: the hole's refill and the new tokens in ONE batch against the
phantom and the real request as two batches (``bench_engine_phantom.PhantomBatching`` on its GPU
setup: Qwen3-8B's layer shape, 4 layers, the Triton kernel). The paper found the two within 1%.
Each round runs only when the last (first: the warm-up) says it fits before the deadline.
"""

from __future__ import annotations

import dataclasses
import statistics

import torch
from bench_engine_phantom import SETUPS, PhantomBatching

from penelope.engine.decoder_config import BUILTIN_ENGINE_CONFIGS

from .context import PASSED, StageContext

CONTEXT = 32 * 1024
FULL = SETUPS["gpu"]
# The CPU: the tiny model, context 256 (a 64-token hole from 16, 8 new tokens), one round (its
# figures are not the point), the engine's naive attention: the interpreted Triton kernel would
# take most of the stage's time, and its engine path (a hole and new tokens in one request) is
# the cost curve's too.
REDUCED = dataclasses.replace(SETUPS["gpu"], config=BUILTIN_ENGINE_CONFIGS["tiny"], contexts=(256,), hole_start=16,
                              append=8, dtype=torch.float32, rounds=1, attention="naive")


def run(ctx: StageContext) -> int:
    setup = FULL if ctx.full else REDUCED
    context = CONTEXT if ctx.full else setup.contexts[0]
    if not ctx.has_time(0.0, what="phantom batching", context=context):
        return PASSED
    batching = PhantomBatching(setup, context, ctx.device)
    figures = batching.compare(setup.rounds, statistics.median,
                               fits=lambda seconds: ctx.has_time(seconds, what="phantom round", context=context))
    if figures is None:
        return PASSED
    ctx.log.write("phantom", model=setup.config.name, context=context, hole_start=setup.hole_start,
                  hole_tokens=batching.tokens["phantom"], new_tokens=batching.tokens["real"],
                  attention=setup.attention, dtype=str(setup.dtype).removeprefix("torch."), rounds_asked=setup.rounds,
                  rounds=len(figures["one_batch_rounds_s"]), unit="ratio one batch / two batches (1.0 = same cost)",
                  **figures)
    return PASSED
