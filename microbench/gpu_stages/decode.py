"""Stage 5: decode calibration: decode steps of batch 1, 4 and 8 at contexts 1K..128K, each
captured in a CUDA graph and replayed (``bench_decode.DecodeRun``), for the simulator's
``decode_overhead`` and ``hbm_bandwidth``.

The corners of the grid come first (the smallest and largest bytes read at batch 1, then batch 8
and 4), so a stage stopped early still leaves points the fit can use; a point that the last
one's time says would pass the deadline is skipped, and so is one whose KV does not fit the GPU
beside the weights (batch 8 at 128K needs 155 GB). Each step is one ``step`` point, with the bytes
the fit needs; the fit itself is the calibration stage's. The next point's time is estimated as
the last one's scaled by the bytes each reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from bench_cost_curve import _qwen3_8b_engine_config
from bench_decode import BATCHES, CONTEXTS, DecodeRun, gpu_pool_capacity

from penelope.engine.decoder_config import BUILTIN_ENGINE_CONFIGS, EngineModelConfig

from .context import PASSED, Pace, StageContext


@dataclass(frozen=True)
class DecodeSetup:
    config: EngineModelConfig
    dtype: torch.dtype
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    rounds: int


FULL = DecodeSetup(_qwen3_8b_engine_config(), torch.bfloat16, BATCHES, CONTEXTS, rounds=10)
REDUCED = DecodeSetup(BUILTIN_ENGINE_CONFIGS["tiny"], torch.float32, BATCHES, (64, 128, 256), rounds=2)


def value_order(batches: tuple[int, ...], contexts: tuple[int, ...]) -> list[tuple[int, int]]:
    """Every (batch, context), the grid's corners first: they alone determine both constants."""
    small, large = min(batches), max(batches)
    first = [(small, contexts[0]), (small, contexts[-1]), (large, contexts[0])]
    first += [(batch, contexts[-1]) for batch in sorted(batches, reverse=True) if batch != small]
    rest = [(batch, context) for batch in batches for context in contexts if (batch, context) not in first]
    return list(dict.fromkeys(first)) + rest


def run(ctx: StageContext) -> int:
    setup = FULL if ctx.full else REDUCED
    if ctx.full:
        capacity = gpu_pool_capacity(setup.config, torch.cuda.mem_get_info()[0])
    else:
        capacity = max(setup.batches) * (max(setup.contexts) + 1)
    decode = DecodeRun(setup.config, setup.dtype, ctx.device, capacity, rounds=setup.rounds)
    read = decode.read
    about = dict(model=setup.config.name, dtype=str(setup.dtype).removeprefix("torch."), weight_bytes=read.weights,
                 embedding_row_bytes=read.embedding_row, kv_bytes_per_token=read.kv_per_token)
    pace = Pace(ctx)
    for batch, context in value_order(setup.batches, setup.contexts):
        if not decode.fits(batch, context):
            ctx.log.write("skipped", batch=batch, context=context, reason="KV pool too small", pool_slots=capacity)
            continue
        # A step's time follows the bytes it reads (the weights, then the KV).
        if not pace.has_time(read.step(batch, batch * (context + 1)), batch=batch, context=context):
            continue
        ctx.log.write("step", **about, **decode.measure(batch, context))
        pace.done()
    return PASSED
