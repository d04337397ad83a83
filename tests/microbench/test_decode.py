"""The decode-calibration microbenchmark on CPU: its decode step against the reference engine, the
fit of overhead and bandwidth against synthetic timings, and the calibration file the simulator
reads. (Its GPU run, CUDA graphs and the fitted figures need a GPU: not exercised here.)"""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from penelope.costmodel.shapes import get_model
from penelope.engine.decoder import EngineBatch
from penelope.engine.decoder_config import BUILTIN_ENGINE_CONFIGS
from penelope.kernels.ragged_attention import naive_ragged_prefill_attention
from penelope.sim.timemodel import TimeModel

MICROBENCH = Path(__file__).resolve().parents[2] / "microbench"
# bench_decode imports its sibling bench_cost_curve, as pytest does when it runs microbench/.
sys.path.insert(0, str(MICROBENCH))
_spec = importlib.util.spec_from_file_location("microbench_decode", MICROBENCH / "bench_decode.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench
_spec.loader.exec_module(bench)

TINY = BUILTIN_ENGINE_CONFIGS["tiny"]


@pytest.mark.parametrize("group", [1, 4])
def test_decode_attention_matches_the_reference(group):
    gen = torch.Generator().manual_seed(group)
    batch, context, num_kv, head_dim = 3, 77, 2, 16
    pool_k = torch.randn(batch * context, num_kv, head_dim, generator=gen)
    pool_v = torch.randn(batch * context, num_kv, head_dim, generator=gen)
    q = torch.randn(batch, num_kv * group, head_dim, generator=gen)
    view = (batch, context, num_kv, head_dim)
    got = bench.decode_attention(q, pool_k.view(view), pool_v.view(view), sm_scale=0.25)
    # Request r: one query at position context - 1 over slots r * context ...
    table = torch.arange(batch * context, dtype=torch.int32).view(batch, context)
    segments = torch.tensor([[r, r, context - 1, 1] for r in range(batch)], dtype=torch.int32)
    expected = naive_ragged_prefill_attention(q, pool_k, pool_v, table, segments, sm_scale=0.25)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_decode_step_gives_the_engine_forward_logits(one_torch_thread):
    run = bench.DecodeRun(TINY, torch.float32, "cpu", capacity=4 * 100, rounds=2)
    for buffer in run.pool.buffers():
        buffer.normal_(generator=torch.Generator().manual_seed(3))
    batch, context = 3, 99
    step = bench.DecodeStep(run.model, run.pool, batch, context, run.tokens[:batch])
    with torch.inference_mode():
        logits = step()
    span = context + 1
    table = torch.arange(batch * span, dtype=torch.int32).view(batch, span)
    segments = [[r, r, context, 1] for r in range(batch)]
    engine = run.model.forward(EngineBatch.build(run.tokens[:batch], table, segments), run.pool)
    torch.testing.assert_close(logits, engine, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="need 800 slots"):
        bench.DecodeStep(run.model, run.pool, 8, context, run.tokens)


def synthetic_points(read, overhead, bandwidth, noise=0.0, seed=0):
    """Steps of the grid timed by the simulator's formula, bytes written out by hand."""
    rng = np.random.default_rng(seed)
    points = []
    for batch in bench.BATCHES:
        for context in bench.CONTEXTS:
            kv = batch * (context + 1)
            seconds = overhead + (read.weights + read.embedding_row * batch + read.kv_per_token * kv) / bandwidth
            points.append((batch, kv, seconds * (1 + noise * rng.standard_normal())))
    return points


def test_fit_recovers_overhead_and_bandwidth_from_synthetic_steps():
    read = bench.DecodeBytes.of(get_model("qwen3-8b"), 2)
    # Qwen3-8B: 15.1 GB of weights a step, 8 KB of embedding per request, 144 KB of KV per token.
    assert read.weights == pytest.approx(15.136e9, rel=1e-3)
    assert (read.embedding_row, read.kv_per_token) == (8192, 147456)
    assert read.step(4, 1000) == read.weights + 4 * 8192 + 1000 * 147456
    exact = bench.fit_decode(synthetic_points(read, 4e-4, 3.2e12), read)
    assert exact["decode_overhead"] == pytest.approx(4e-4, rel=1e-6)
    assert exact["hbm_bandwidth"] == pytest.approx(3.2e12, rel=1e-9)
    assert exact["max_relative_error"] < 1e-9
    # 2% timing noise: the constants within a few percent.
    noisy = bench.fit_decode(synthetic_points(read, 6e-4, 2.5e12, noise=0.02), read)
    assert noisy["decode_overhead"] == pytest.approx(6e-4, rel=0.25)
    assert noisy["hbm_bandwidth"] == pytest.approx(2.5e12, rel=0.03)
    assert 0.01 < noisy["max_relative_error"] < 0.1


def test_fit_never_reports_a_negative_overhead():
    read = bench.DecodeBytes.of(get_model("qwen3-8b"), 2)
    # Steps faster than their bytes at the bandwidth of the big ones: the intercept would be negative.
    points = [(1, 1025, 2e-3), (1, 131073, 9e-3), (4, 4 * 131073, 0.02)]
    fit = bench.fit_decode(points, read)
    assert fit["decode_overhead"] == 0.0 and fit["hbm_bandwidth"] > 0
    with pytest.raises(ValueError, match="two points"):
        bench.fit_decode([(1, 1025, 2e-3)], read)


def test_a_cpu_run_writes_a_calibration_the_simulator_reads(tmp_path, one_torch_thread):
    # The cost curve wrote its prefill constants first; the decode run merges its own.
    (tmp_path / "calibration_cpu.json").write_text(json.dumps(
        {"model": "tiny", "source": "bench_cost_curve", "batch_overhead": 0.002}))
    run = bench.DecodeRun(TINY, torch.float32, "cpu", capacity=4 * 257, rounds=2)
    for batch, context in ((1, 64), (4, 64), (1, 256), (4, 256), (8, 256)):
        run.measure(batch, context)
    assert len(run.rows) == 4 and run.skipped == [{"batch": 8, "context": 256, "reason": "KV pool too small"}]
    assert all(row["graph"] is False and row["seconds"] > 0 for row in run.rows)
    summary = run.write(tmp_path, "cpu")
    calibration = json.loads((tmp_path / "calibration_cpu.json").read_text())
    assert calibration["batch_overhead"] == 0.002
    assert calibration["source"].startswith("bench_cost_curve; microbench/bench_decode.py (tiny, float32)")
    assert calibration["decode_overhead"] == summary["fit"]["decode_overhead"] >= 0
    assert calibration["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    model = TimeModel.from_json(tmp_path / "calibration_cpu.json", model=run.shape, gpu="h100")
    assert model.decode_overhead == calibration["decode_overhead"] and model.batch_overhead == 0.002
    assert model.embedding_row_bytes == 64 * 4
    text = (tmp_path / "decode_cpu.txt").read_text()
    # Title and header, 4 timed points, the skipped one, the fit.
    assert "  256 skipped: KV pool too small" in text and text.count("\n") == 2 + 4 + 1 + 1
    assert json.loads((tmp_path / "decode_cpu.json").read_text())["rows"][0]["batch"] == 1
