"""Stage 2: ragged prefill attention in bf16: correct first, then how fast against FA-class kernels.

1. Correctness: our kernel's output (``out`` pre-filled with NaN, so unwritten rows fail) against
   the fp32 reference (``naive_ragged_prefill_attention``) on front and tail batches, and every
   other provider against ours on each timed batch. A check passes when the largest absolute
   difference is within ``TOLERANCE`` times the largest absolute reference value.
2. Speed at the setup's contexts (the GPU's: 32K and 128K), ``front`` (phantom hole + 512 new
   tokens) and ``tail`` (recomputed tail + new tokens) batches (``ragged_batches.py``): ours with
   its pinned configuration and with ``num_stages`` 3, torch's SDPA on gathered K/V with the flash
   and cuDNN backends (the FA-class reference), SGLang's Triton extend kernel when it imports.
   TFLOP/s count the causal work, ``4 * D * Hq * sum(pos + 1)``, for every provider; a provider
   that cannot run is recorded as ``unavailable`` with the reason.

Before each batch, checked or timed, the stage asks whether it still fits before its deadline: the
last batch's seconds scaled by the ratio of their causal work (128K is about 16 times 32K).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from ragged_batches import (
    QWEN3_8B,
    AttentionShape,
    causal_flops,
    cost_curve_segments,
    make_batch,
    penelope_plan,
    sdpa_output,
    sdpa_runner,
    sglang_runner,
)
from timing import bench_seconds

from penelope.kernels.ragged_attention import naive_ragged_prefill_attention, ragged_prefill_attention
from penelope.kernels.ragged_attention.kernel import run_ragged_prefill

from .context import CHECK_FAILED, PASSED, Pace, StageContext

# Largest |difference| allowed, as a share of the largest |reference value|, per input dtype.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}
LAYOUTS = ("front", "tail")
# On the CPU (reduced shapes): one timed call, the call that checked the provider's output being the
# warm-up; the interpreter's times say nothing of a GPU's, so more calls would only cost time.
CPU_TIMING = dict(cpu_rounds=1, cpu_warmup=0)


@dataclass(frozen=True)
class AttentionSetup:
    shape: AttentionShape
    check_contexts: tuple[int, ...]  # checked against the fp32 reference
    contexts: tuple[int, ...]  # timed
    references: tuple[str, ...]  # providers beside ours
    dtype: torch.dtype = torch.bfloat16


FULL = AttentionSetup(QWEN3_8B, check_contexts=(4096, 32 * 1024), contexts=(32 * 1024, 128 * 1024),
                      references=("sdpa_flash", "sdpa_cudnn", "sglang"))
# The CPU: the interpreter runs the kernels, SDPA's math backend stands in for the GPU's backends
# (which are tried too, and recorded as unavailable where they cannot run). fp16: the interpreter
# computes SGLang's bf16 dots wrongly (see tests/kernels/test_ragged_attention.py). Two q heads
# per KV head, as on the GPU, but the fewest heads: the interpreter's time grows with them.
REDUCED = AttentionSetup(AttentionShape(2, 1, 32, evict_start=64, append=16), check_contexts=(256,),
                         contexts=(256, 320), references=("sdpa_math", "sdpa_flash", "sdpa_cudnn", "sglang"),
                         dtype=torch.float16)


def max_error(got: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """Largest |got - reference| (NaN where ``got`` has any NaN) and largest |reference|."""
    diff = (got.float() - reference.float()).abs().max()
    return float(diff), float(reference.float().abs().max())


def within(error: float, scale: float, dtype: torch.dtype) -> bool:
    # NaN compares False: an unwritten row fails.
    return error <= TOLERANCE[dtype] * scale


class Ours:
    """Our kernel on one batch, planned once; ``stages`` overrides the pinned ``num_stages`` (the
    plan's tiles depend only on the rows, so the same plan serves both)."""

    def __init__(self, batch: dict, stages: int | None = None):
        self.batch = batch
        self.plan = penelope_plan(batch)
        self.blocks = self.plan.blocks if stages is None else self.plan.blocks._replace(num_stages=stages)
        self.out = torch.full_like(batch["q"], float("nan"))

    def __call__(self) -> torch.Tensor:
        b, plan = self.batch, self.plan
        if self.blocks == plan.blocks:
            return ragged_prefill_attention(b["q"], b["k_buffer"], b["v_buffer"], b["req_to_token"], b["segments"],
                                            out=self.out, plan=plan)
        run_ragged_prefill(b["q"], b["k_buffer"], b["v_buffer"], b["req_to_token"], plan.tiles, plan.status.value,
                           b["q"].shape[2] ** -0.5, self.out, None, self.blocks, plan.target)
        return self.out


def batch_work(context: int, layout: str, shape: AttentionShape) -> int:
    """The causal work of a batch, before it is made."""
    return causal_flops(cost_curve_segments(context, layout, shape), shape.num_q_heads, shape.head_dim)


def check_against_reference(ctx: StageContext, setup: AttentionSetup) -> bool:
    ok = True
    pace = Pace(ctx)
    for context in setup.check_contexts:
        for layout in LAYOUTS:
            if not pace.has_time(batch_work(context, layout, setup.shape), what="check", context=context,
                                 layout=layout):
                continue
            batch = make_batch(context, layout, ctx.device, setup.dtype, setup.shape)
            got = Ours(batch)()
            reference = naive_ragged_prefill_attention(batch["q"].float(), batch["k_buffer"].float(),
                                                       batch["v_buffer"].float(), batch["req_to_token"],
                                                       batch["segments"])
            error, scale = max_error(got, reference)
            passed = within(error, scale, setup.dtype)
            ctx.log.write("check", against="fp32 reference", context=context, layout=layout,
                          dtype=str(setup.dtype), max_abs_error=error, max_abs_reference=scale,
                          tolerance=TOLERANCE[setup.dtype], passed=passed)
            ok &= passed
            del batch, got, reference
            pace.done()
    return ok


def reference_runner(batch: dict, provider: str):
    """A reference provider's callable and the function that turns its result into ``[T, Hq, D]``;
    SDPA falls back to K/V repeated per q head when its backend refuses ``enable_gqa``."""
    if provider == "sglang":
        return sglang_runner(batch), lambda out: out, {}
    run = sdpa_runner(batch, provider)
    try:
        run()
        return run, sdpa_output, {"gqa": "enable_gqa"}
    except RuntimeError:
        run = sdpa_runner(batch, provider, expand_kv=True)
        return run, sdpa_output, {"gqa": "K/V repeated per q head"}


def time_batch(ctx: StageContext, setup: AttentionSetup, context: int, layout: str) -> bool:
    batch = make_batch(context, layout, ctx.device, setup.dtype, setup.shape)
    segments = batch["segments"].tolist()
    flops = causal_flops(segments, setup.shape.num_q_heads, setup.shape.head_dim)
    common = dict(context=context, layout=layout, segments=segments, dtype=str(setup.dtype), causal_flops=flops)
    ours = Ours(batch)
    expected = ours().clone()
    ok = True
    seconds = {}
    variants = [("penelope", None), ("penelope_stages_3", 3)]
    for name, stages in variants:
        try:
            run = ours if stages is None else Ours(batch, stages)
            out = expected if stages is None else run()
        except Exception as error:  # a configuration Triton cannot compile here (OutOfResources, ...)
            ctx.log.write("unavailable", provider=name, reason=f"{type(error).__name__}: {error}"[:300], **common)
            continue
        seconds[name] = bench_seconds(run, ctx.device, **CPU_TIMING)
        extra = {"equal_to_pinned": bool(torch.equal(out, expected))} if stages else {}
        ctx.log.write("speed", provider=name, blocks=run.blocks.label, seconds=seconds[name],
                      tflops=flops / seconds[name] / 1e12, **extra, **common)
    for provider in setup.references:
        try:
            run, as_output, extra = reference_runner(batch, provider)
            error, scale = max_error(as_output(run()), expected)
        except (ImportError, RuntimeError, ValueError) as error:
            ctx.log.write("unavailable", provider=provider, reason=f"{type(error).__name__}: {error}"[:300], **common)
            continue
        passed = within(error, scale, setup.dtype)
        ok &= passed
        seconds[provider] = bench_seconds(run, ctx.device, **CPU_TIMING)
        ctx.log.write("speed", provider=provider, seconds=seconds[provider], tflops=flops / seconds[provider] / 1e12,
                      max_abs_diff_vs_ours=error, matches_ours=passed,
                      ours_speedup=seconds[provider] / seconds["penelope"] if "penelope" in seconds else None,
                      **extra, **common)
        del run
    return ok


def import_providers() -> None:
    """What the providers import, imported before anything is paced: a first batch that carried
    the imports (SGLang's take seconds) would make every later batch look too long to fit."""
    import torch.nn.attention.bias  # noqa: F401

    try:
        import sglang.kernels.ops.attention.extend_attention  # noqa: F401
    except Exception:  # noqa: BLE001 - whatever stops it is recorded as unavailable at each timed batch
        pass


def run(ctx: StageContext) -> int:
    setup = FULL if ctx.full else REDUCED
    import_providers()
    ok = check_against_reference(ctx, setup)
    # Timed batches are paced by timed batches only: a check is one call, a timed batch many.
    pace = Pace(ctx)
    for context in setup.contexts:
        for layout in LAYOUTS:
            if not pace.has_time(batch_work(context, layout, setup.shape), what="timed batch", context=context,
                                 layout=layout):
                continue
            ok &= time_batch(ctx, setup, context, layout)
            pace.done()
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
    return PASSED if ok else CHECK_FAILED
