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

from penelope.kernels.ragged_attention import (  # noqa: E402
    naive_ragged_prefill_attention,
    plan_ragged_prefill,
    plan_store_kv,
    ragged_attention_blocks,
    ragged_attention_work,
    ragged_prefill_attention,
    store_kv,
    target_of,
    warm_up_ragged_attention,
)

QWEN3_8B = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)
CONTEXTS = [8 * 1024, 16 * 1024, 32 * 1024, 64 * 1024, 128 * 1024]
EVICT_FRAC, EVICT_START, APPEND, BLOCK_SIZE = 0.3, 2048, 512, 64
# SGLang 0.5.23's extend kernel on Hopper at head_dim <= 128: one program per (request, q head,
# 128 queries), streaming the request's whole prefix and the extend keys up to its last query.
SGLANG_HOPPER_BLOCK_M = 128


def cost_curve_segments(context: int, layout: str) -> list[list[int]]:
    """Segments ``(req_row, q_start, pos_start, length)`` of the next request after eviction."""
    evicted = int(EVICT_FRAC * context) // BLOCK_SIZE * BLOCK_SIZE
    if layout == "front":
        return [[0, 0, EVICT_START, evicted], [0, evicted, context, APPEND]]
    return [[0, 0, context - evicted, evicted + APPEND]]


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


def causal_flops(segments, num_q_heads: int, head_dim: int) -> int:
    """``4 * D * Hq * sum(pos + 1)``: QK^T and PV, 2 FLOPs per multiply-add."""
    pairs = sum((start + 1) * length + length * (length - 1) // 2 for _, _, start, length in segments)
    return 4 * head_dim * num_q_heads * pairs


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
    work = benchmark(ragged_attention_work, segments, **QWEN3_8B, elem_bytes=2)
    num_q_heads, head_dim = QWEN3_8B["num_q_heads"], QWEN3_8B["head_dim"]
    group = num_q_heads // QWEN3_8B["num_kv_heads"]
    sglang_bytes = sglang_extend_kv_bytes(segments, num_q_heads, head_dim, 2)
    blocks = ragged_attention_blocks(head_dim, group)
    # Hopper's pinned BLOCK_N is 64; the other candidate's efficiency, for the record.
    other_n = ragged_attention_work(segments, **QWEN3_8B, elem_bytes=2, block_n=128)
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


def _gpu_batch(context: int, layout: str, dtype=torch.bfloat16):
    """A cost-curve batch on the GPU (``front``: phantom hole + new tokens, ``tail``: one segment),
    scattered pool slots; segments stay on the host, as the SGLang hooks hand them over."""
    gen = torch.Generator(device="cuda").manual_seed(context)
    segments = cost_curve_segments(context, layout)
    total = context + APPEND
    num_slots = total + 4096
    num_kv, head_dim, num_q = QWEN3_8B["num_kv_heads"], QWEN3_8B["head_dim"], QWEN3_8B["num_q_heads"]
    num_tokens = sum(seg[3] for seg in segments)
    return dict(
        q=torch.randn(num_tokens, num_q, head_dim, device="cuda", dtype=dtype, generator=gen),
        k_buffer=torch.randn(num_slots, num_kv, head_dim, device="cuda", dtype=dtype, generator=gen),
        v_buffer=torch.randn(num_slots, num_kv, head_dim, device="cuda", dtype=dtype, generator=gen),
        req_to_token=torch.randperm(num_slots, device="cuda", generator=gen)[:total].to(torch.int32)[None],
        segments=np.array(segments, dtype=np.int32),
    )


def _penelope_runner(batch):
    """The layer's call with the batch planned once, as every layer of a model runs it."""
    q = batch["q"]
    plan = plan_ragged_prefill(batch["req_to_token"], batch["segments"], num_tokens=q.shape[0],
                               num_slots=batch["k_buffer"].shape[0], num_q_heads=q.shape[1],
                               num_kv_heads=batch["k_buffer"].shape[1], head_dim=q.shape[2], check=True)
    out = torch.empty_like(q)

    def run():
        return ragged_prefill_attention(q, batch["k_buffer"], batch["v_buffer"], batch["req_to_token"],
                                        batch["segments"], out=out, plan=plan)

    return run


def _pseudo_requests(batch):
    """The batch as one pseudo-request per segment, the way a stock engine would run it: prefix =
    the row's positions before the segment, extend = the segment."""
    slots = batch["req_to_token"][0].long()
    segments = batch["segments"].tolist()
    lengths = torch.tensor([n for *_, n in segments], device="cuda")
    prefixes = torch.tensor([pos for _, _, pos, _ in segments], device="cuda")
    return slots, segments, lengths, prefixes


def _sglang_runner(batch):
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    q, k_buffer, v_buffer = batch["q"], batch["k_buffer"], batch["v_buffer"]
    slots, segments, lengths, prefixes = _pseudo_requests(batch)
    ext_slots = torch.cat([slots[pos : pos + n] for _, _, pos, n in segments])
    k_ext, v_ext = k_buffer[ext_slots].contiguous(), v_buffer[ext_slots].contiguous()
    prefix_slots = torch.cat([slots[:pos] for _, _, pos, _ in segments])
    zero = torch.zeros(1, dtype=torch.int64, device="cuda")
    qo_indptr = torch.cat([zero, lengths.cumsum(0)]).to(torch.int32)
    kv_indptr = torch.cat([zero, prefixes.cumsum(0)]).to(torch.int32)
    out = torch.empty_like(q)
    max_len = int(lengths.max())
    scale = q.shape[2] ** -0.5

    def run():
        extend_attention_fwd(q, k_ext, v_ext, out, k_buffer, v_buffer, qo_indptr, kv_indptr, prefix_slots,
                             None, True, None, max_len, 1.0, 1.0, sm_scale=scale)
        return out

    return run


def _flashinfer_runner(batch):
    import flashinfer

    q, k_buffer, v_buffer = batch["q"], batch["k_buffer"], batch["v_buffer"]
    slots, segments, lengths, _ = _pseudo_requests(batch)
    # Page size 1, so a pseudo-request's pages are the slots of positions 0..end.
    pages = torch.cat([slots[: pos + n] for _, _, pos, n in segments]).to(torch.int32)
    zero = torch.zeros(1, dtype=torch.int64, device="cuda")
    qo_indptr = torch.cat([zero, lengths.cumsum(0)])
    kv_indptr = torch.cat([zero, torch.tensor([p + n for _, _, p, n in segments], device="cuda").cumsum(0)])
    last_page_len = torch.ones(len(segments), dtype=torch.int32, device="cuda")
    workspace = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="NHD")
    wrapper.plan(qo_indptr.to(torch.int32), kv_indptr.to(torch.int32), pages, last_page_len,
                 q.shape[1], k_buffer.shape[1], q.shape[2], 1, causal=True,
                 q_data_type=q.dtype, kv_data_type=k_buffer.dtype)
    cache = (k_buffer.unsqueeze(1), v_buffer.unsqueeze(1))  # [pages, page_size 1, Hkv, D]

    def run():
        return wrapper.run(q, cache)

    return run


def _fa3_runner(batch):
    """FlashAttention 3 through SGLang's wrapper (needs sgl_kernel's CUDA build), page size 1."""
    from sglang.kernels.ops.attention.flash_attention import flash_attn_with_kvcache

    q, k_buffer, v_buffer = batch["q"], batch["k_buffer"], batch["v_buffer"]
    slots, segments, lengths, prefixes = _pseudo_requests(batch)
    ends = [pos + n for _, _, pos, n in segments]
    page_table = torch.zeros(len(segments), max(ends), dtype=torch.int32, device="cuda")
    for i, end in enumerate(ends):
        page_table[i, :end] = slots[:end].to(torch.int32)
    zero = torch.zeros(1, dtype=torch.int64, device="cuda")
    cu_seqlens_q = torch.cat([zero, lengths.cumsum(0)]).to(torch.int32)
    cache_seqlens = (prefixes + lengths).to(torch.int32)
    max_len = int(lengths.max())

    def run():
        return flash_attn_with_kvcache(q, k_buffer.unsqueeze(1), v_buffer.unsqueeze(1), cache_seqlens=cache_seqlens,
                                       page_table=page_table, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_len,
                                       softmax_scale=q.shape[2] ** -0.5, causal=True)

    return run


RUNNERS = {"penelope": _penelope_runner, "sglang": _sglang_runner, "flashinfer": _flashinfer_runner,
           "fa3": _fa3_runner}
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
    batch = _gpu_batch(context, layout)
    ours = _penelope_runner(batch)
    reference = ours().float()
    torch.cuda.synchronize()

    def timed():
        ours()
        torch.cuda.synchronize()

    benchmark.pedantic(timed, rounds=10, iterations=1, warmup_rounds=2)
    segments = batch["segments"].tolist()
    flops = causal_flops(segments, QWEN3_8B["num_q_heads"], QWEN3_8B["head_dim"])
    work = ragged_attention_work(segments, **QWEN3_8B, elem_bytes=2)
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
    batch = _gpu_batch(8 * 1024, "front")
    q = batch["q"]
    slots = np.concatenate([batch["req_to_token"][0, pos : pos + n].cpu().numpy()
                            for _, _, pos, n in batch["segments"].tolist()])
    store_plan = plan_store_kv(slots, batch["k_buffer"].shape[0], "cuda")
    attend = _penelope_runner(batch)
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

    batch = _gpu_batch(8 * 1024, "front")
    device = batch["q"].device.index or 0

    def cached():
        return sum(len(fn.device_caches[device][0]) for fn in (ragged_kernel._ragged_prefill_fwd_kernel,
                                                                slot_check._check_slots_kernel)
                   if device in fn.device_caches)

    blocks = benchmark.pedantic(warm_up_ragged_attention, args=(batch["k_buffer"], batch["req_to_token"],
                                                                QWEN3_8B["num_q_heads"]), rounds=1, iterations=1)
    before = cached()
    _penelope_runner(batch)()
    torch.cuda.synchronize()
    benchmark.extra_info.update(environment(), blocks=blocks.label, kernels_compiled_by_warm_up=before,
                                compiles_after_warm_up_exact=cached() - before)
    assert cached() == before
