"""Ragged-position prefill attention: work efficiency and K/V traffic (CPU), TFLOP/s (GPU).

Shapes: the paper's cost-curve experiment on Qwen3-8B attention (32 q heads, 8 kv heads, head_dim
128, bf16): a context of n tokens, 30% of it evicted either as one hole starting at position 2K
(``front``: phantom hole + 512 new tokens, two segments of one request) or from the tail
(``tail``: recomputed tail + 512 new tokens, one segment).

- CPU (always): the host-side work counter on those shapes, no kernel run needed: efficiency
  (causal query-key pairs / score elements computed, target >= 0.9), tile pairs, and K/V bytes per
  query against a model of SGLang's extend kernel on the same batch. Plus a tiny interpreted run.
- GPU (skipped without CUDA): TFLOP/s counting ``4 * D * Hq * sum(pos + 1)`` on the front
  (phantom + new tokens) and tail (one segment) batches, side by side with SGLang's extend kernel
  on the same batch, and FlashInfer's paged prefill and FA3 when they import; our speedup against
  each. And a model layer's store + attention under CUDA's sync debug mode (no host sync).

Run: ``pytest microbench/bench_ragged_attention.py --benchmark-json out.json``; the figures are in
each result's ``extra_info``.
"""

import os
import subprocess

import torch

# The interpreter must be chosen before the kernels are imported; only without a GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import triton  # noqa: E402
from ragged_batches import (  # noqa: E402
    QWEN3_8B,
    causal_flops,
    cost_curve_segments,
    fa3_runner,
    flashinfer_runner,
    make_batch,
    penelope_runner,
    sglang_runner,
)

from penelope.kernels.ragged_attention import (  # noqa: E402
    naive_ragged_prefill_attention,
    plan_store_kv,
    ragged_attention_blocks,
    ragged_attention_work,
    ragged_prefill_attention,
    store_kv,
    target_of,
    warm_up_ragged_attention,
)

CONTEXTS = [8 * 1024, 16 * 1024, 32 * 1024, 64 * 1024, 128 * 1024]
# SGLang 0.5.23's extend kernel on Hopper at head_dim <= 128: one program per (request, q head,
# 128 queries), streaming the request's whole prefix and the extend keys up to its last query.
SGLANG_HOPPER_BLOCK_M = 128


def sglang_extend_kv_bytes(segments, num_q_heads: int, head_dim: int, elem_bytes: int,
                           block_m: int = SGLANG_HOPPER_BLOCK_M) -> int:
    """K/V bytes SGLang's extend kernel loads for the same batch laid out as one pseudo-request
    per segment (prefix = the positions before the segment, extend = the segment): every
    (q head, query block) program reads the prefix and the extend keys up to its block's end."""
    rows = 0
    for _, _, prefix, length in segments:
        block_ends = np.minimum(length, np.arange(1, -(-length // block_m) + 1) * block_m)
        rows += int((prefix + block_ends).sum())
    return rows * num_q_heads * head_dim * elem_bytes * 2


def environment() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=False).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (Triton interpreter)"
    return dict(device=device, torch=torch.__version__, triton=triton.__version__, commit=commit)


@pytest.mark.parametrize("layout", ["front", "tail"])
@pytest.mark.parametrize("context", CONTEXTS, ids=lambda n: f"{n // 1024}K")
def test_work_efficiency_cost_curve(benchmark, context, layout):
    segments = cost_curve_segments(context, layout)
    work = benchmark(ragged_attention_work, segments, **QWEN3_8B.heads(), elem_bytes=2)
    num_q_heads, head_dim = QWEN3_8B.num_q_heads, QWEN3_8B.head_dim
    group = num_q_heads // QWEN3_8B.num_kv_heads
    sglang_bytes = sglang_extend_kv_bytes(segments, num_q_heads, head_dim, 2)
    blocks = ragged_attention_blocks(head_dim, group)
    # Hopper's pinned BLOCK_N is 64; the other candidate's efficiency, for the record.
    other_n = ragged_attention_work(segments, **QWEN3_8B.heads(), elem_bytes=2, block_n=128)
    benchmark.extra_info.update(
        environment(),
        shape="qwen3-8b attention", dtype="bfloat16", context=context, layout=layout,
        segments=segments, block_m=blocks.block_m, block_n=blocks.block_n,
        efficiency=work.efficiency, efficiency_block_n_128=other_n.efficiency,
        tile_efficiency=work.tile_efficiency,
        tile_pairs_visited=work.tile_pairs_visited, tile_pairs_needed=work.tile_pairs_needed,
        tile_pairs_masked=work.tile_pairs_masked, tile_pairs_unskipped=work.tile_pairs_unskipped,
        causal_pairs=work.causal_pairs, computed_pairs=work.computed_pairs,
        kv_bytes=work.kv_bytes, kv_bytes_per_query=work.kv_bytes_per_query,
        sglang_kv_bytes_per_query=sglang_bytes / work.num_queries,
        kv_bytes_ratio_vs_sglang=work.kv_bytes / sglang_bytes,
        # The same query tiles with one program per q head, as without GQA packing.
        per_head_kv_bytes_per_query=work.kv_bytes_per_query * group,
    )
    assert work.efficiency >= 0.9
    assert work.tile_pairs_visited == work.tile_pairs_needed


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run: CPU only")
def test_interpreted_kernel_tiny(benchmark):
    """A small phantom + real batch through the interpreter, for regressions in the CPU path."""
    gen = torch.Generator().manual_seed(0)
    context, num_slots = 384, 512
    segments = torch.tensor([[0, 0, 64, 96], [0, 96, 320, 64]], dtype=torch.int32)
    req_to_token = torch.randperm(num_slots, generator=gen)[:context].to(torch.int32)[None]
    k_buffer = torch.randn(num_slots, 2, 128, generator=gen, dtype=torch.float16)
    v_buffer = torch.randn(num_slots, 2, 128, generator=gen, dtype=torch.float16)
    q = torch.randn(160, 8, 128, generator=gen, dtype=torch.float16)
    args = (q, k_buffer, v_buffer, req_to_token, segments)
    out = benchmark.pedantic(ragged_prefill_attention, args=args, rounds=3, iterations=1)
    torch.testing.assert_close(out.float(), naive_ragged_prefill_attention(*args).float(),
                               atol=2e-3, rtol=2e-3)
    benchmark.extra_info.update(environment(), dtype="float16", q_shape=list(q.shape),
                                segments=segments.tolist(), pool_slots=num_slots)


RUNNERS = {"penelope": penelope_runner, "sglang": sglang_runner, "flashinfer": flashinfer_runner,
           "fa3": fa3_runner}
# Goals: >= 1.3x SGLang's Triton extend kernel on phantom + new-token batches, >= 1.0x on
# single-segment batches.
GOAL_VS_SGLANG = {"front": 1.3, "tail": 1.0}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU throughput needs CUDA")
@pytest.mark.parametrize("layout", ["front", "tail"])
@pytest.mark.parametrize("context", CONTEXTS, ids=lambda n: f"{n // 1024}K")
def test_gpu_attention(benchmark, context, layout):
    """Our kernel on one batch (timed by pytest-benchmark with a sync per call), and every other
    provider that imports (SGLang's extend kernel, FlashInfer, FA3) on the SAME batch, kernel time
    by ``triton.testing.do_bench`` (median): TFLOP/s each and our speedup against each."""
    batch = make_batch(context, layout, "cuda")
    ours = penelope_runner(batch)
    reference = ours().float()
    torch.cuda.synchronize()

    def timed():
        ours()
        torch.cuda.synchronize()

    benchmark.pedantic(timed, rounds=10, iterations=1, warmup_rounds=2)
    segments = batch["segments"].tolist()
    flops = causal_flops(segments, QWEN3_8B.num_q_heads, QWEN3_8B.head_dim)
    work = ragged_attention_work(segments, **QWEN3_8B.heads(), elem_bytes=2)
    info = dict(environment(), dtype="bfloat16", context=context, layout=layout, segments=segments,
                blocks=ragged_attention_blocks(128, 4, target_of("cuda")).label,
                goal_speedup_vs_sglang=GOAL_VS_SGLANG[layout], lower_is_better=["median_ms_*"])
    times = {}
    for provider, make in RUNNERS.items():
        try:
            run = make(batch)
            out = run()
        except (ImportError, RuntimeError) as error:
            info[f"unavailable_{provider}"] = f"{type(error).__name__}: {error}"[:200]
            continue
        if provider != "penelope":
            torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=2e-2)
        times[provider] = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
        info[f"median_ms_{provider}"] = times[provider]
        info[f"tflops_{provider}"] = flops / (times[provider] * 1e-3) / 1e12
    for provider, ms in times.items():
        if provider != "penelope":
            info[f"speedup_vs_{provider}"] = ms / times["penelope"]
    info["kv_gb_per_s"] = work.kv_bytes / (times["penelope"] * 1e-3) / 1e9
    benchmark.extra_info.update(info)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_layer_path_does_not_sync(benchmark):
    """A model layer's store and attention with the batch planned: CUDA's sync debug mode turns any
    host synchronisation into an error."""
    batch = make_batch(8 * 1024, "front", "cuda")
    q = batch["q"]
    slots = np.concatenate([batch["req_to_token"][0, pos : pos + n].cpu().numpy()
                            for _, _, pos, n in batch["segments"].tolist()])
    store_plan = plan_store_kv(slots, batch["k_buffer"].shape[0], "cuda")
    attend = penelope_runner(batch)
    new_kv = torch.randn(len(slots), 8, 128, device="cuda", dtype=q.dtype)
    torch.cuda.synchronize()

    def layer():
        torch.cuda.set_sync_debug_mode("error")
        try:
            store_kv(batch["k_buffer"], batch["v_buffer"], store_plan.slots, new_kv, new_kv, plan=store_plan)
            attend()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()

    benchmark.pedantic(layer, rounds=5, iterations=1, warmup_rounds=1)
    benchmark.extra_info.update(environment(), host_syncs_per_layer_exact=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_warm_up_covers_the_first_batch(benchmark):
    """After ``warm_up_ragged_attention`` (what the SGLang backend calls when it is created), the
    first batch compiles nothing: the kernels' compile caches do not grow."""
    from penelope.kernels.ragged_attention import kernel as ragged_kernel
    from penelope.kernels.ragged_attention import slot_check

    batch = make_batch(8 * 1024, "front", "cuda")
    device = batch["q"].device.index or 0

    def cached():
        return sum(len(fn.device_caches[device][0]) for fn in (ragged_kernel._ragged_prefill_fwd_kernel,
                                                                slot_check._check_slots_kernel)
                   if device in fn.device_caches)

    blocks = benchmark.pedantic(warm_up_ragged_attention, args=(batch["k_buffer"], batch["req_to_token"],
                                                                QWEN3_8B.num_q_heads), rounds=1, iterations=1)
    before = cached()
    penelope_runner(batch)()
    torch.cuda.synchronize()
    benchmark.extra_info.update(environment(), blocks=blocks.label, kernels_compiled_by_warm_up=before,
                                compiles_after_warm_up_exact=cached() - before)
    assert cached() == before
