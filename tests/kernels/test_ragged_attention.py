"""Ragged-position prefill attention under the Triton interpreter, against the fp32 reference."""

import os

# Kernels are decorated at import time: the interpreter must be chosen before the first import.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from kernel_helpers import PHANTOM_BATCH, make_batch, plan_for, run_kernel
from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd  # noqa: E402

from penelope.engine.attention import AttentionBackend, get_attention_backend  # noqa: E402
from penelope.engine.decoder import EngineBatch, Qwen3Decoder  # noqa: E402
from penelope.engine.decoder_config import BUILTIN_ENGINE_CONFIGS  # noqa: E402
from penelope.engine.kvpool import KVPool  # noqa: E402
from penelope.engine.weights import random_weights  # noqa: E402
from penelope.kernels.ragged_attention import (  # noqa: E402
    naive_ragged_prefill_attention,
    plan_ragged_prefill,
    ragged_attention_blocks,
    ragged_attention_work,
    ragged_prefill_attention,
    store_kv,
)
from penelope.kernels.ragged_attention import plan as plan_module  # noqa: E402
from penelope.kernels.ragged_attention.kernel import _ragged_prefill_fwd_kernel, ragged_launch  # noqa: E402

# One tolerance table per dtype: outputs (rounded to the dtype) and LSE (always fp32).
# fp16 loses most in P cast to fp16 for the P @ V dot; bf16 runs fp32 dots under the interpreter
# and loses only the final rounding of o to bf16 (2**-8 relative).
TOLERANCES = {
    torch.float32: dict(out=dict(atol=2e-5, rtol=1e-5), lse=dict(atol=2e-5, rtol=1e-5)),
    torch.float16: dict(out=dict(atol=2e-3, rtol=2e-3), lse=dict(atol=1e-4, rtol=1e-5)),
    torch.bfloat16: dict(out=dict(atol=8e-3, rtol=8e-3), lse=dict(atol=1e-4, rtol=1e-5)),
}







def assert_matches_reference(batch, **kwargs):
    out, lse = run_kernel(batch, **kwargs)
    ref_out, ref_lse = naive_ragged_prefill_attention(**batch, return_lse=True, **kwargs)
    tol = TOLERANCES[batch["q"].dtype]
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.float(), ref_out.float(), **tol["out"])
    torch.testing.assert_close(lse, ref_lse, **tol["lse"])
    return out, lse


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Every dtype x GROUP 1/4/8 at head_dim 64; head_dim 128 at GROUP 1 and 8 (interpreter time).
SHAPES = [(dtype, group, 64) for dtype in DTYPES for group in (1, 4, 8)] + [
    (dtype, group, 128) for dtype in DTYPES for group in (1, 8)
]


@pytest.mark.parametrize("dtype, group, head_dim", SHAPES, ids=lambda x: str(x).replace("torch.", ""))
def test_phantom_batch_matches_reference(dtype, group, head_dim):
    batch = make_batch(PHANTOM_BATCH, 2 * group, 2, head_dim, dtype, seed=group + head_dim, order_seed=1)
    assert_matches_reference(batch)


@pytest.mark.parametrize("length", [1, 63, 65, 111])
def test_new_token_lengths_after_hole(length):
    # A hole [40, 97) refilled in the same batch as `length` new tokens starting at 97.
    batch = make_batch([(97 + length, [(40, 57), (97, length)])], 8, 2, 64, torch.float16, seed=length)
    assert_matches_reference(batch)


def test_segments_starting_and_ending_at_kv_tile_edges():
    # Interpreter tiles: BLOCK_N 32, BLOCK_M 16 here. Starts and ends on both sides of each edge.
    requests = [(ctx, [(start, ctx - start)]) for start, ctx in
                [(30, 40), (31, 40), (32, 64), (33, 63), (62, 70), (63, 65), (64, 96), (95, 97), (15, 17), (16, 33)]]
    batch = make_batch(requests, 8, 2, 64, torch.float32, seed=37, order_seed=0)
    assert_matches_reference(batch)


def test_group_not_power_of_two_and_odd_head_dim():
    # 3 q heads per kv head are padded to 4 rows; head_dim 40 is padded to 64 lanes.
    batch = make_batch([(130, [(0, 30), (70, 60)])], 6, 2, 40, torch.float32, seed=3)
    assert_matches_reference(batch)


@pytest.mark.parametrize("group", [1, 3, 5, 6, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_gqa_groups_that_are_not_powers_of_two(group, dtype):
    # Row 0 of PHANTOM_BATCH has a hole at position 0; outputs start as NaN (run_kernel).
    batch = make_batch(PHANTOM_BATCH, 2 * group, 2, 64, dtype, seed=50 + group, order_seed=group)
    assert_matches_reference(batch)


@pytest.mark.parametrize("target", ["interpreter", "sm_80", "sm_90a", "sm_100a"])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8, 12, 16])
def test_tile_rows_waste_less_than_one_group(target, group):
    """A tile holds block_m positions x group heads in a power-of-two number of rows, with fewer
    than `group` rows of padding (a group of 5 in 128 rows: 25 positions, 3 rows unused)."""
    for head_dim in (64, 128, 256):
        for dtype in (None, torch.float32):
            blocks = ragged_attention_blocks(head_dim, group, target, dtype)
            assert blocks.rows & (blocks.rows - 1) == 0
            assert blocks.rows - group < blocks.block_m * group <= blocks.rows


def test_fp32_inputs_get_their_own_small_tiles_on_gpu_targets():
    # Every 16-bit tile shape spills with fp32 operands (compile report); the interpreter's are small.
    assert ragged_attention_blocks(128, 4, "sm_90a", torch.float32) == (8, 16, 32, 8, 1)
    assert ragged_attention_blocks(128, 4, "sm_90a", torch.bfloat16) == ragged_attention_blocks(128, 4, "sm_90a")
    assert ragged_attention_blocks(128, 4, "interpreter", torch.float32) == ragged_attention_blocks(128, 4,
                                                                                                    "interpreter")


@pytest.mark.parametrize("group", [3, 5, 6, 7])
def test_work_efficiency_of_groups_that_are_not_powers_of_two(group):
    # A 4K-token segment after 8K cached tokens, Hopper tiles: few score elements wasted (padding a
    # group of 5 to 8 would cap the efficiency at 5 / 8).
    work = ragged_attention_work([[0, 0, 8192, 4096]], 8 * group, 8, 128)
    assert work.efficiency >= 0.95


def test_several_requests_with_several_holes_random_layouts():
    gen = torch.Generator().manual_seed(7)
    for trial in range(3):
        requests = []
        for _ in range(int(torch.randint(1, 4, (1,), generator=gen))):
            ctx = int(torch.randint(20, 200, (1,), generator=gen))
            cuts = sorted(set(torch.randint(0, ctx, (6,), generator=gen).tolist()) | {ctx})
            # Alternate computed and cached ranges; the last range holds the new tokens.
            ranges = [(a, b - a) for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)) if i % 2 == 0]
            requests.append((ctx, ranges or [(0, ctx)]))
        batch = make_batch(requests, 4, 2, 64, torch.float32, seed=trial, order_seed=trial)
        assert_matches_reference(batch)


def test_strided_q_and_custom_scale():
    batch = make_batch(PHANTOM_BATCH[:2], 4, 2, 64, torch.float32, seed=5)
    # q as a view into a fused qkv projection output: token stride larger than Hq * D.
    fused = torch.randn(batch["q"].shape[0], 4 + 2 + 2, 64)
    fused[:, :4] = batch["q"]
    batch["q"] = fused[:, :4]
    assert batch["q"].stride(0) == 8 * 64
    assert_matches_reference(batch, sm_scale=0.3)


def test_empty_segments_and_empty_batch():
    batch = make_batch([(90, [(0, 0), (10, 50), (60, 0)])], 4, 2, 64, torch.float32, seed=2)
    assert_matches_reference(batch)

    empty = make_batch([(10, [(0, 0)])], 4, 2, 64, torch.float32)
    out, lse = ragged_prefill_attention(**empty, return_lse=True)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)


@pytest.mark.parametrize("group", [4, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_batch_invariance(dtype, group):
    """A segment's rows are bitwise identical alone and inside a larger batch."""
    big = make_batch(PHANTOM_BATCH, 2 * group, 2, 64, dtype, seed=11, order_seed=4)
    out, lse = run_kernel(big)
    for row, q_start, pos_start, length in big["segments"].tolist():
        alone = dict(big, q=big["q"][q_start : q_start + length],
                     segments=torch.tensor([[row, 0, pos_start, length]], dtype=torch.int32))
        alone_out, alone_lse = run_kernel(alone)
        assert torch.equal(alone_out, out[q_start : q_start + length])
        assert torch.equal(alone_lse, lse[q_start : q_start + length])


def test_result_does_not_depend_on_how_the_batch_was_cut():
    """Phantom recomputation is bit-reproducible: positions 0..200 computed in one segment, in
    odd pieces (tiles cut at other offsets, other KV tiles masked) or beside other requests."""
    whole = make_batch([(201, [(0, 201)])], 8, 2, 64, torch.float16, seed=13)
    out, lse = run_kernel(whole)
    assert_matches_reference(whole)
    for pieces in ([(0, 37), (37, 64), (101, 100)], [(0, 1), (1, 130), (131, 70)]):
        cut = make_batch([(201, pieces), (50, [(0, 50)])], 8, 2, 64, torch.float16, seed=13, order_seed=2)
        # Same pool content and slots for row 0 as in `whole`.
        cut["k_buffer"][: whole["k_buffer"].shape[0]] = whole["k_buffer"]
        cut["v_buffer"][: whole["v_buffer"].shape[0]] = whole["v_buffer"]
        cut["req_to_token"][0, :201] = whole["req_to_token"][0, :201]
        for row, q_start, pos_start, length in cut["segments"].tolist():
            if row == 0:
                q_rows = slice(q_start, q_start + length)
                pos_rows = slice(pos_start, pos_start + length)
                cut["q"][q_rows] = whole["q"][pos_rows]
        cut_out, cut_lse = run_kernel(cut)
        for row, q_start, pos_start, length in cut["segments"].tolist():
            if row == 0:
                assert torch.equal(cut_out[q_start : q_start + length], out[pos_start : pos_start + length])
                assert torch.equal(cut_lse[q_start : q_start + length], lse[pos_start : pos_start + length])


def sglang_extend(batch, sm_scale):
    """SGLang 0.5.23's extend attention on the same batch, one pseudo-request per segment:
    prefix = the row's positions before the segment (read from the pool), extend = the segment."""
    q, k_buffer, v_buffer = batch["q"], batch["k_buffer"], batch["v_buffer"]
    req_to_token = batch["req_to_token"].long()
    segments = [s for s in batch["segments"].tolist() if s[3] > 0]
    q_rows = torch.cat([torch.arange(q_start, q_start + length) for _, q_start, _, length in segments])
    ext_slots = torch.cat([req_to_token[row, pos : pos + length] for row, _, pos, length in segments])
    prefix_slots = torch.cat([req_to_token[row, :pos] for row, _, pos, _ in segments])
    lengths = torch.tensor([length for *_, length in segments])
    prefixes = torch.tensor([pos for _, _, pos, _ in segments])
    zero = torch.zeros(1, dtype=torch.int64)
    out = torch.zeros_like(q)
    lse = torch.zeros(q.shape[:2], dtype=torch.float32)
    extend_attention_fwd(
        q[q_rows].contiguous(), k_buffer[ext_slots].contiguous(), v_buffer[ext_slots].contiguous(),
        out, k_buffer, v_buffer,
        torch.cat([zero, lengths.cumsum(0)]).to(torch.int32),  # qo_indptr
        torch.cat([zero, prefixes.cumsum(0)]).to(torch.int32),  # kv_indptr
        prefix_slots,  # kv_indices
        None, True, None, int(lengths.max()), 1.0, 1.0,
        sm_scale=sm_scale, lse_extend=lse,
    )
    result_out, result_lse = torch.empty_like(out), torch.empty_like(lse)
    result_out[q_rows], result_lse[q_rows] = out, lse
    return result_out, result_lse


# SGLang's kernel takes log(0) on padding rows of its LSE; the rows it stores are finite.
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_matches_sglang_extend_attention(dtype):
    """Cross-check against SGLang's extend kernel (interpreted) on a phantom + real batch; its
    bf16 dot is wrong under the interpreter, so bf16 is checked against the reference only."""
    batch = make_batch(PHANTOM_BATCH[:2], 8, 2, 64, dtype, seed=17, order_seed=3)
    out, lse = run_kernel(batch)
    sg_out, sg_lse = sglang_extend(batch, 64**-0.5)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), sg_out.float(), **tol["out"])
    torch.testing.assert_close(lse, sg_lse, **tol["lse"])


def test_work_counter_matches_kernel_loops():
    batch = make_batch(PHANTOM_BATCH, 8, 2, 64, torch.float32, seed=19)
    blocks = ragged_attention_blocks(64, 4, "interpreter")
    segs = batch["segments"].numpy().astype("int64")
    work = ragged_attention_work(batch["segments"], 8, 2, 64, elem_bytes=4,
                                 block_m=blocks.block_m, block_n=blocks.block_n)
    counts = torch.zeros(work.query_tiles * 2, 2, dtype=torch.int32)
    out = torch.empty_like(batch["q"])
    plan = plan_for(batch)
    grid, args, kwargs = ragged_launch(batch["q"], batch["k_buffer"], batch["v_buffer"], batch["req_to_token"],
                                       plan.tiles, plan.status.value, 0.125, out, None, blocks, "interpreter",
                                       work=counts)
    _ragged_prefill_fwd_kernel[grid](*args, **kwargs)
    assert int(counts[:, 0].sum()) == work.tile_pairs_visited
    assert int(counts[:, 1].sum()) == work.tile_pairs_masked
    # The loop stops exactly where causality does: every visited tile pair is needed.
    assert work.tile_pairs_needed == work.tile_pairs_visited
    assert work.tile_pairs_masked < work.tile_pairs_visited < work.tile_pairs_unskipped

    # Causal pairs by brute force over query positions.
    pairs = sum(pos + 1 for _, _, start, length in segs.tolist() for pos in range(start, start + length))
    assert work.causal_pairs == pairs * 8
    assert 0 < work.efficiency <= 1
    assert work.num_queries == batch["q"].shape[0]


def test_work_counter_hand_computed():
    # One segment, positions 100..139, BLOCK_M 16 -> aligned tiles 100..111, 112..127, 128..139.
    # BLOCK_N 32: last KV tiles 3, 3, 4 -> visits 4 + 4 + 5; first tiles 3, 3, 4 -> masked 1 + 1 + 1.
    work = ragged_attention_work([[0, 0, 100, 40]], 4, 1, 64, block_m=4, block_n=32)
    assert work.query_tiles == 10
    work = ragged_attention_work([[0, 0, 100, 40]], 1, 1, 64, block_m=16, block_n=32)
    assert (work.query_tiles, work.tile_pairs_visited, work.tile_pairs_masked) == (3, 13, 3)
    assert work.tile_pairs_unskipped == 3 * 5
    assert work.causal_pairs == sum(range(101, 141))
    assert work.computed_pairs == 13 * 16 * 32
    assert work.kv_bytes == (112 + 128 + 140) * 64 * 2 * 2


VALIDATION_CASES = {
    "q not 3-D": (lambda b: b.update(q=b["q"][:, 0]), "q must be 3-D"),
    "int q": (lambda b: b.update(q=b["q"].to(torch.int32)), "dtype"),
    "k dtype": (lambda b: b.update(k_buffer=b["k_buffer"].half()), "k_buffer dtype"),
    "v shape": (lambda b: b.update(v_buffer=b["v_buffer"][:, :1]), "v_buffer shape"),
    "head dim": (lambda b: b.update(q=b["q"][..., :32]), "head_dim"),
    "gqa": (lambda b: b.update(q=b["q"][:, :3]), "multiple of kv heads"),
    "int64 table": (lambda b: b.update(req_to_token=b["req_to_token"].long()), "req_to_token must be int32"),
    "int64 segments": (lambda b: b.update(segments=b["segments"].long()), "segments must be int32"),
    "segments shape": (lambda b: b.update(segments=b["segments"][:, :3]), r"shape \[N, 4\]"),
    "stride": (lambda b: b.update(q=b["q"].transpose(1, 2).contiguous().transpose(1, 2)), "unit stride"),
    "negative length": (lambda b: b["segments"].__setitem__((0, 3), -1), "negative length"),
    "bad row": (lambda b: b["segments"].__setitem__((0, 0), 5), "req_row 5"),
    "past q": (lambda b: b["segments"].__setitem__((1, 1), 30), "beyond q"),
    "past table": (lambda b: b["segments"].__setitem__((1, 2), 95), "beyond req_to_token"),
    "query overlap": (lambda b: b["segments"].__setitem__((1, 1), 10), "overlap in query rows"),
    "uncovered": (lambda b: b.update(q=torch.cat([b["q"], b["q"][:1]])), "cover"),
    "position overlap": (lambda b: b["segments"].__setitem__((1, 2), 15), "overlap in positions"),
    "slot range": (lambda b: b["req_to_token"].__setitem__((0, 5), 10_000), r"req_to_token\[0, 5\]"),
    "negative slot": (lambda b: b["req_to_token"].__setitem__((0, 0), -1), "outside the pool"),
    "scale": (lambda b: b.update(sm_scale=0.0), "sm_scale"),
}


@pytest.mark.parametrize("case", list(VALIDATION_CASES))
@pytest.mark.parametrize("fn", [ragged_prefill_attention, naive_ragged_prefill_attention],
                         ids=["kernel", "naive"])
def test_validation_errors(case, fn):
    batch = make_batch([(96, [(0, 20), (40, 20)])], 4, 2, 64, torch.float32)
    mutate, message = VALIDATION_CASES[case]
    mutate(batch)
    with pytest.raises(ValueError, match=message):
        fn(**batch)


def test_slot_beyond_what_queries_read_is_not_an_error():
    # Positions past the last query of a row are never read, so their slots may be garbage.
    batch = make_batch([(96, [(0, 20), (40, 20)])], 4, 2, 64, torch.float32)
    batch["req_to_token"][0, 60:] = 10_000
    assert_matches_reference(batch)


def test_output_buffer_validation():
    batch = make_batch([(30, [(0, 30)])], 4, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="out must be"):
        ragged_prefill_attention(**batch, out=torch.empty(30, 4, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="lse_out must be"):
        ragged_prefill_attention(**batch, return_lse=True, lse_out=torch.empty(30, 2))


def int_view(tensor):
    return tensor.view(torch.int16) if tensor.element_size() == 2 else tensor.view(torch.int32)


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_store_kv_is_bit_exact(impl, dtype):
    gen = torch.Generator().manual_seed(23)
    k_buffer = torch.randn(300, 3, 40, generator=gen).to(dtype)
    v_buffer = torch.randn(300, 3, 40, generator=gen).to(dtype)
    expected_k, expected_v = k_buffer.clone(), v_buffer.clone()
    slots = torch.randperm(300, generator=gen)[:77]  # unsorted, scattered
    k = torch.randn(77, 3, 40, generator=gen).to(dtype)
    v = torch.randn(77, 3, 40, generator=gen).to(dtype)
    expected_k[slots], expected_v[slots] = k, v
    store_kv(k_buffer, v_buffer, slots.to(torch.int32), k, v, impl=impl)
    assert torch.equal(int_view(k_buffer), int_view(expected_k))
    assert torch.equal(int_view(v_buffer), int_view(expected_v))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(slots=torch.tensor([0, 1, 1])), "duplicates"),
        (dict(slots=torch.tensor([0, 1, 50])), r"\[0, 50\)"),
        (dict(slots=torch.tensor([0, 1])), "k must be"),
        (dict(k=torch.zeros(3, 2, 8, dtype=torch.float16)), "k must be"),
        (dict(slots=torch.tensor([0.0, 1.0, 2.0])), "int32/int64"),
        (dict(impl="cuda"), "impl"),
    ],
)
def test_store_kv_validation(change, message):
    args = dict(k_buffer=torch.zeros(50, 2, 8), v_buffer=torch.zeros(50, 2, 8), slots=torch.tensor([0, 1, 2]),
                k=torch.ones(3, 2, 8), v=torch.ones(3, 2, 8))
    args.update(change)
    with pytest.raises(ValueError, match=message):
        store_kv(**args)


def test_store_then_attend_one_layer():
    """What a model layer does: write the batch's K/V to its slots, then attend over the pool."""
    batch = make_batch(PHANTOM_BATCH[:2], 4, 2, 64, torch.float16, seed=29)
    segs = batch["segments"].tolist()
    slots = torch.cat([batch["req_to_token"][row, pos : pos + n] for row, _, pos, n in segs])
    new_k = torch.randn(len(slots), 2, 64).half()
    new_v = torch.randn(len(slots), 2, 64).half()
    store_kv(batch["k_buffer"], batch["v_buffer"], slots, new_k, new_v, impl="triton")
    assert torch.equal(batch["k_buffer"][slots.long()], new_k)
    assert_matches_reference(batch)




@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_plan_gives_bitwise_the_same_results(dtype):
    batch = make_batch(PHANTOM_BATCH, 8, 2, 64, dtype, seed=41, order_seed=6)
    out, lse = run_kernel(batch)
    plan_out, plan_lse = run_kernel(batch, plan=plan_for(batch))
    assert not out.isnan().any()
    assert torch.equal(plan_out, out) and torch.equal(plan_lse, lse)


def test_one_plan_serves_several_layers():
    """Layers share req_to_token and segments but not q, the pool or the scale; a bigger pool
    than the plan was checked against is fine."""
    batch = make_batch(PHANTOM_BATCH, 4, 2, 64, torch.float16, seed=43, order_seed=7)
    plan = plan_for(batch)
    gen = torch.Generator().manual_seed(44)
    for layer, extra_slots in enumerate((0, 5, 0)):
        shape = (batch["k_buffer"].shape[0] + extra_slots, 2, 64)
        layer_batch = dict(batch, q=torch.randn(batch["q"].shape, generator=gen).half(),
                           k_buffer=torch.randn(shape, generator=gen).half(),
                           v_buffer=torch.randn(shape, generator=gen).half())
        scale = 0.1 * (layer + 1)
        alone = run_kernel(layer_batch, sm_scale=scale)
        planned = run_kernel(layer_batch, sm_scale=scale, plan=plan)
        assert torch.equal(planned[0], alone[0]) and torch.equal(planned[1], alone[1])
        assert_matches_reference(layer_batch, sm_scale=scale)


PLAN_MISMATCHES = {
    "fewer q rows": (lambda b: b.update(q=b["q"][:-1]), "plan covers 40 query rows but q has 39"),
    "more q rows": (lambda b: b.update(q=torch.cat([b["q"], b["q"][:1]])), "q has 41"),
    "small pool": (lambda b: b.update(k_buffer=b["k_buffer"][:-1], v_buffer=b["v_buffer"][:-1]),
                   "k_buffer has 124 slots, fewer than the 125"),
    "other segments": (lambda b: b.update(segments=b["segments"].clone()), "other req_to_token or segments"),
    "other table": (lambda b: b.update(req_to_token=b["req_to_token"].clone()), "other req_to_token"),
    "other tiles": (lambda b: b.update(q=b["q"].repeat(1, 4, 1)), "do not fit head_dim 64 with 8 q heads"),
    "layer check": (lambda b: b.update(k_buffer=b["k_buffer"].half()), "k_buffer dtype"),
}


@pytest.mark.parametrize("case", list(PLAN_MISMATCHES))
def test_plan_that_does_not_fit_the_call_raises(case):
    batch = make_batch([(96, [(0, 20), (40, 20)])], 4, 2, 64, torch.float32)
    plan = plan_for(batch)
    mutate, message = PLAN_MISMATCHES[case]
    mutate(batch)
    with pytest.raises(ValueError, match=message):
        ragged_prefill_attention(**batch, plan=plan)


@pytest.mark.parametrize("case", ["bad row", "past q", "position overlap", "slot range", "int64 segments"])
def test_plan_checks_the_batch_as_a_call_does(case):
    batch = make_batch([(96, [(0, 20), (40, 20)])], 4, 2, 64, torch.float32)
    mutate, message = VALIDATION_CASES[case]
    mutate(batch)
    with pytest.raises(ValueError, match=message):
        plan_for(batch)
    with pytest.raises(ValueError, match="kv heads"):
        plan_ragged_prefill(batch["req_to_token"], batch["segments"], num_tokens=40, num_slots=125,
                            num_q_heads=3, num_kv_heads=2, head_dim=64)


def test_engine_plans_once_per_batch_not_per_layer(monkeypatch):
    """Through a 3-layer engine forward on the "triton" backend, the kernel's batch checks and
    tile construction run once; a backend without a plan runs them in every layer, with bitwise
    the same logits."""
    calls = {"check_segments": 0, "build_query_tiles": 0}
    for name in calls:
        original = getattr(plan_module, name)

        def counted(*args, name=name, original=original):
            calls[name] += 1
            return original(*args)

        monkeypatch.setattr(plan_module, name, counted)
    config = BUILTIN_ENGINE_CONFIGS["tiny-untied"]
    assert config.num_layers == 3
    weights = random_weights(config, seed=3)
    tokens = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    triton_backend = get_attention_backend("triton")
    unplanned = AttentionBackend("triton-unplanned", triton_backend.store_kv, triton_backend.attend)
    logits = {}
    for backend, expected_calls in ((triton_backend, 1), (unplanned, config.num_layers)):
        for name in calls:
            calls[name] = 0
        model = Qwen3Decoder(config, weights, attention=backend)
        logits[backend.name] = model(EngineBatch.single_segment(tokens, torch.arange(40)), KVPool(config, 64))
        assert calls == {"check_segments": expected_calls, "build_query_tiles": expected_calls}
    assert torch.equal(logits["triton"], logits["triton-unplanned"])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_longer_contexts_and_group_16(dtype):
    requests = [(700, [(0, 130), (300, 211), (600, 100)]), (520, [(257, 263)])]
    batch = make_batch(requests, 32, 2, 128, dtype, seed=31, order_seed=5)
    assert_matches_reference(batch)
