"""The cost-curve microbenchmark's pieces: its CPU attention, its scaled set-up, the two requests it
times, the calibration fit and its outputs, on tiny shapes."""

import dataclasses
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from penelope.costmodel.recompute import CostModel, predict_speedup
from penelope.costmodel.shapes import get_model
from penelope.engine.attention import tiled_sdpa_attention
from penelope.engine.decoder import EngineBatch
from penelope.engine.decoder_config import BUILTIN_ENGINE_CONFIGS
from penelope.engine.kvpool import KVPool
from penelope.kernels.ragged_attention import naive_ragged_prefill_attention
from penelope.sim.calibration import fit_calibration
from penelope.sim.timemodel import TimeModel

MICROBENCH = Path(__file__).resolve().parents[2] / "microbench"
BENCH_PATH = MICROBENCH / "bench_cost_curve.py"
# The benchmark imports its sibling timing.py, as pytest does when it runs microbench/.
sys.path.insert(0, str(MICROBENCH))
_spec = importlib.util.spec_from_file_location("microbench_cost_curve", BENCH_PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench
_spec.loader.exec_module(bench)

# Positions / 256 of the GPU experiment: contexts 32..512, hole at 8, 2 new tokens.
TINY = dataclasses.replace(
    bench.SETUPS["cpu"], config=BUILTIN_ENGINE_CONFIGS["tiny"], scale=256, rounds=2, decode_rounds=2, threads=None
)


def _pool_and_table(num_slots, num_kv_heads, head_dim, rows, width, seed):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen)
    table = torch.stack([torch.randperm(num_slots, generator=gen)[:width] for _ in range(rows)]).to(torch.int32)
    return k, v, table


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("tile", [16, 128])
def test_tiled_sdpa_attention_matches_reference(group, tile):
    num_kv, head_dim = 2, 32
    k, v, table = _pool_and_table(600, num_kv, head_dim, rows=2, width=300, seed=group)
    # Request 0: a hole at position 0 and new tokens crossing tile boundaries; request 1: a hole
    # ending where its new tokens start, an empty segment, odd lengths.
    segments = torch.tensor(
        [[0, 0, 0, 37], [0, 37, 111, 65], [1, 102, 63, 1], [1, 103, 64, 111], [1, 214, 290, 0]], dtype=torch.int32
    )
    q = torch.randn(214, num_kv * group, head_dim, generator=torch.Generator().manual_seed(7))
    expected = naive_ragged_prefill_attention(q, k, v, table, segments, sm_scale=0.3)
    got = tiled_sdpa_attention(q, k, v, table, segments, sm_scale=0.3, tile=tile)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_scaled_cpu_setup_matches_the_gpu_experiment():
    cpu, gpu = bench.SETUPS["cpu"], bench.SETUPS["gpu"]
    cpu_cost, gpu_cost = CostModel(cpu.shape()), CostModel(gpu.shape())
    assert gpu_cost.c_lin == CostModel(get_model("qwen3-8b")).c_lin == 23_552
    assert cpu_cost.c_lin * bench.CPU_SCALE == gpu_cost.c_lin
    assert cpu.evict_start * bench.CPU_SCALE == gpu.evict_start == 2048
    assert cpu.append * bench.CPU_SCALE == gpu.append == 512
    assert cpu.config.num_q_heads // cpu.config.num_kv_heads == gpu.config.num_q_heads // gpu.config.num_kv_heads
    for cpu_n, gpu_n in zip(cpu.contexts, gpu.contexts, strict=True):
        assert cpu_cost.c_lin / cpu_n == gpu_cost.c_lin / gpu_n
        scaled = predict_speedup(cpu_cost, cpu_n, evict_start=cpu.evict_start, append=cpu.append)
        full = predict_speedup(gpu_cost, gpu_n, evict_start=gpu.evict_start, append=gpu.append)
        assert scaled.predicted_speedup == pytest.approx(full.predicted_speedup, rel=2e-3)
    # The paper's reference points, as the cost model issue states them.
    first = predict_speedup(gpu_cost, gpu.contexts[0]).predicted_speedup
    last = predict_speedup(gpu_cost, gpu.contexts[-1]).predicted_speedup
    assert 1.05 < first < 1.2 and 2.8 <= last <= 2.95


def test_next_requests_front_is_one_batch_of_two_segments():
    tokens = torch.arange(1000, 1300)
    front, tail = bench.next_requests(tokens, context=256, evicted=77, evict_start=8, append=2)
    assert front.segments.tolist() == [[0, 0, 8, 77], [0, 77, 256, 2]]
    assert tail.segments.tolist() == [[0, 0, 179, 79]]
    assert front.num_tokens == tail.num_tokens == 79
    assert front.positions.tolist() == [*range(8, 85), 256, 257]
    assert front.tokens.tolist() == [*range(1008, 1085), 1256, 1257]
    assert tail.tokens.tolist() == list(range(1179, 1258))
    # Slot = position: both write exactly the positions they recompute.
    assert torch.equal(front.slots, front.positions) and torch.equal(tail.slots, tail.positions)


def _full_prefill_logits(run, context, append):
    """Last-token logits of a prefill of the whole history + new tokens into a fresh pool."""
    pool = KVPool(run.setup.config, context + append)
    batch = EngineBatch.single_segment(run.tokens[: context + append], torch.arange(context + append))
    return run.model.forward(batch, pool, logits_rows=[context + append - 1])


@pytest.mark.parametrize("variant", ["front", "tail"])
def test_recomputed_request_reads_what_it_recomputes(variant):
    """After a prefill, the evicted span's K/V is destroyed; the next request must refill it in
    the same batch (the phantom for front) and then match a full prefill."""
    run = bench.CurveRun(TINY)
    context, append = 256, TINY.append
    evicted = round(bench.EVICT_FRAC * context)
    history = EngineBatch.single_segment(run.tokens[:context], torch.arange(context))
    run.model.forward(history, run.pool, logits_rows=[context - 1])
    front, tail = bench.next_requests(run.tokens, context, evicted, TINY.evict_start, append)
    batch = front if variant == "front" else tail
    expected = _full_prefill_logits(run, context, append)

    evicted_slots = batch.slots[: evicted]
    run.pool.fill_(float("nan"), evicted_slots)
    got = run.model.forward(batch, run.pool, logits_rows=[batch.num_tokens - 1])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)

    # Without the recomputed span (new tokens only) the NaN K/V poisons the output.
    new_only = EngineBatch.build(run.tokens[context : context + append], batch.req_to_token,
                                 [[0, 0, context, append]])
    run.pool.fill_(float("nan"), evicted_slots)
    assert torch.isnan(run.model.forward(new_only, run.pool, logits_rows=[append - 1])).all()


def test_measure_and_write_tiny_curve(tmp_path):
    run = bench.CurveRun(TINY)
    for gpu_context in bench.GPU_CONTEXTS:
        row = run.measure(gpu_context)
        assert row["context"] == gpu_context // 256
        assert len(row["front_seconds_all"]) == len(row["tail_seconds_all"]) == TINY.rounds
        assert row["front_seconds"] == min(row["front_seconds_all"])
        expected = predict_speedup(run.cost, row["context"], evict_start=8, append=2)
        assert row["predicted_speedup"] == expected.predicted_speedup
        assert row["relative_error"] == pytest.approx(row["measured_speedup"] / expected.predicted_speedup - 1)
        assert row["next_token_logit_diff"] < 1e-4
    assert run.estimate_seconds(512) > 0

    summary = run.write(tmp_path)
    data = json.loads((tmp_path / "cost_curve_cpu.json").read_text())
    assert [r["gpu_context"] for r in data["rows"]] == list(bench.GPU_CONTEXTS)
    assert data["c_lin"] == run.cost.c_lin and data["gpu_c_lin"] == 23_552
    assert data["max_abs_relative_error"] == max(abs(r["relative_error"]) for r in data["rows"])
    assert (tmp_path / "cost_curve_cpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (tmp_path / "cost_curve_cpu.txt").read_text()
    # Title, header, rule, one line per context, the largest error.
    assert text.count("\n") == len(bench.GPU_CONTEXTS) + 4 and "128K" in text

    # The calibration file is what the simulator reads.
    calibration = json.loads((tmp_path / "calibration_cpu.json").read_text())
    assert calibration == summary["calibration"] and calibration["model"] == "tiny"
    model = TimeModel.from_json(tmp_path / "calibration_cpu.json", model=TINY.shape(), gpu="h100")
    for key in ("sec_per_linear_unit", "sec_per_attention_pair", "batch_overhead"):
        if key in calibration:
            assert getattr(model, key) == calibration[key]


def test_fit_calibration_recovers_known_constants():
    shape = TINY.shape()
    cost = CostModel(shape)
    overhead, per_linear, per_pair = 2e-3, 3e-9, 5e-9
    rng = np.random.default_rng(0)
    points = []
    for _ in range(12):
        tokens, start = int(rng.integers(1, 5000)), int(rng.integers(0, 50_000))
        linear, pairs = cost.c_lin * tokens, cost.attention_pairs(start, start + tokens)
        points.append((linear, pairs, overhead + per_linear * linear + per_pair * pairs))
    fit = fit_calibration(points, model="tiny", gpu="h200", source="test")
    assert fit["model"] == "tiny" and fit["gpu"] == "h200" and fit["source"] == "test"
    assert fit["batch_overhead"] == pytest.approx(overhead, rel=1e-6)
    assert fit["sec_per_linear_unit"] == pytest.approx(per_linear, rel=1e-6)
    assert fit["sec_per_attention_pair"] == pytest.approx(per_pair, rel=1e-6)
    # Decode constants are bench_decode.py's to fit.
    assert not {"hbm_bandwidth", "decode_overhead", "weight_bytes"} & set(fit)


def test_fit_calibration_keeps_constants_non_negative():
    # Times that fall as work grows: no non-negative per-unit constant explains them.
    points = [(100.0, 10.0, 0.3), (200.0, 20.0, 0.2), (400.0, 40.0, 0.1)]
    fit = fit_calibration(points, model="tiny", gpu=None, source="test")
    assert "gpu" not in fit and "sec_per_linear_unit" not in fit and "sec_per_attention_pair" not in fit
    assert fit["batch_overhead"] > 0


class _FakeBenchmark:
    def __init__(self):
        self.extra_info = {}
        self.calls = 0

    def pedantic(self, fn, rounds, warmup_rounds, iterations):
        assert iterations == 1
        for _ in range(rounds + warmup_rounds):
            fn()
            self.calls += 1


def test_time_budget_reduces_rounds_then_skips():
    run = bench.CurveRun(dataclasses.replace(TINY, rounds=3))
    first = _FakeBenchmark()
    bench._measure_or_skip(run, first, bench.GPU_CONTEXTS[0])
    assert first.calls == 4 and first.extra_info["rounds"] == 3
    assert first.extra_info["query_tokens_exact"] == 10 + 2 and first.extra_info["measured_speedup"] > 0

    context = bench.GPU_CONTEXTS[-1] // TINY.scale
    full, reduced = run.estimate_seconds(context, 3, 1), run.estimate_seconds(context, 1, 0)
    assert full > reduced > 0
    run.setup = dataclasses.replace(run.setup, budget_s=(full + reduced) / 2)
    run.started = time.perf_counter()
    second = _FakeBenchmark()
    bench._measure_or_skip(run, second, bench.GPU_CONTEXTS[-1])
    assert second.calls == 1 and second.extra_info["rounds"] == 1

    reduced = run.estimate_seconds(context, 1, 0)  # now at the speed of the last context
    run.setup = dataclasses.replace(run.setup, budget_s=0.5 * reduced)
    run.started = time.perf_counter()
    with pytest.raises(pytest.skip.Exception, match="time budget"):
        bench._measure_or_skip(run, _FakeBenchmark(), bench.GPU_CONTEXTS[-1])


def test_gpu_setup_path_on_cpu_with_the_interpreted_kernel(tmp_path):
    """The GPU set-up's path (weights drawn on the device, random K/V, the Triton kernel through
    the engine, medians) on the tiny config: the kernel runs under TRITON_INTERPRET=1."""
    setup = dataclasses.replace(bench.SETUPS["gpu"], config=BUILTIN_ENGINE_CONFIGS["tiny"], dtype=torch.float32,
                                scale=512, rounds=1, decode_rounds=1)
    weights = bench.device_random_weights(setup.config, torch.float32, "cpu")
    assert torch.equal(weights.final_norm, torch.ones(setup.config.hidden_size))
    assert weights.layers[0].q_proj.std().item() == pytest.approx(setup.config.hidden_size**-0.5, rel=0.2)

    run = bench.CurveRun(setup)
    assert run.model.attention.name == "triton"
    assert float(run.pool.k_buffers[0].std()) == pytest.approx(1.0, rel=0.2)  # random K/V, no prefill
    row = run.measure(bench.GPU_CONTEXTS[0])
    assert row["context"] == 16 and row["evicted"] == 5 and row["append"] == 1
    assert row["prefill_seconds"] is None and row["next_token_logit_diff"] is None
    assert row["front_seconds"] == row["front_seconds_all"][0] > 0
    summary = run.write(tmp_path)
    assert summary["clock"] == "wall" and summary["fill"] == "random"
    assert json.loads((tmp_path / "calibration_gpu.json").read_text())["model"] == "tiny"
