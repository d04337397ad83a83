"""Serving-time model: estimates derived from the model shape, formulas by hand, calibration files."""

import dataclasses
import json

import numpy as np
import pytest

from penelope.costmodel.recompute import CostModel, predict_speedup
from penelope.costmodel.shapes import get_model
from penelope.errors import UsageError
from penelope.sim.server import decode_step_times
from penelope.sim.timemodel import CALIBRATION_KEYS, TimeModel


def round_numbers(model="qwen3-8b", **extra):
    """The estimate with round constants, so results can be computed by hand."""
    return dataclasses.replace(
        TimeModel.estimate(model),
        sec_per_linear_unit=1e-9,
        sec_per_attention_pair=2e-9,
        batch_overhead=1e-3,
        decode_overhead=0.5e-3,
        hbm_bandwidth=1e12,
        load_bandwidth=1e10,
        **extra,
    )


def test_qwen3_8b_h100_estimate_is_derived_from_the_shape():
    model = TimeModel.estimate("qwen3-8b", "h100")
    shape = get_model("qwen3-8b")
    assert model.c_lin == 23552 and model.num_gpus == 1
    # One unit = 4 * head_dim * q_heads * layers FLOPs at half of 989 TFLOP/s.
    assert model.sec_per_linear_unit == pytest.approx(4 * 128 * 32 * 36 / (989e12 * 0.5), rel=1e-12)
    assert model.sec_per_attention_pair == model.sec_per_linear_unit
    assert model.batch_overhead == 3e-3 and model.decode_overhead == 0.5e-3
    assert model.hbm_bandwidth == pytest.approx(3.35e12 * 0.7)
    # A decode step reads every weight but the input-embedding table (151,936 x 4,096), whose
    # rows it looks up one per token: the table is 7.6% of all parameters.
    embedding = 151936 * 4096
    assert model.weight_bytes == pytest.approx(2 * (shape.active_params() - embedding))
    assert 1 - model.weight_bytes / (2 * shape.active_params()) == pytest.approx(0.076, abs=5e-4)
    assert model.embedding_row_bytes == 2 * 4096
    assert model.expert_bytes == 0 and model.num_experts == 0
    assert model.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2 == 147456
    assert model.window_kv_bytes_per_token == 0
    assert model.phantom_kernel == "fa3" and model.triton_pair_ratio == 1.5
    h200 = TimeModel.estimate("qwen3-8b", "h200")
    assert h200.hbm_bandwidth == pytest.approx(4.8e12 * 0.7)
    assert h200.sec_per_linear_unit == model.sec_per_linear_unit


@pytest.mark.parametrize(
    "model, gpu, gpus",
    [
        ("qwen3-8b", "h100", 1),
        ("qwen3-8b", "h200", 1),
        ("qwen3-32b", "h100", 2),
        ("qwen3-32b", "h200", 1),
        ("qwen3-235b-a22b", "h100", 8),
        ("qwen3-235b-a22b", "h200", 8),
    ],
)
def test_gpu_count_holds_weights_and_the_papers_cache(model, gpu, gpus):
    estimate = TimeModel.estimate(model, gpu)
    assert estimate.num_gpus == gpus
    single = TimeModel.estimate(model, gpu, num_gpus=1)
    # Tensor parallelism multiplies FLOP/s and bandwidth.
    assert estimate.sec_per_linear_unit * gpus == pytest.approx(single.sec_per_linear_unit)
    assert estimate.hbm_bandwidth == pytest.approx(gpus * single.hbm_bandwidth)


def test_moe_estimate_reads_dense_weights_plus_routed_experts():
    model = TimeModel.estimate("qwen3-235b-a22b")
    shape = get_model("qwen3-235b-a22b")
    one_expert = 94 * 3 * 4096 * 1536 * 2
    assert model.expert_bytes == one_expert
    embedding = 2 * shape.vocab_size * shape.hidden_size
    assert model.weight_bytes + 8 * model.expert_bytes + embedding == pytest.approx(2 * shape.active_params())
    assert model.expected_experts(1) == pytest.approx(8)
    assert model.expected_experts(2) == pytest.approx(128 * (1 - (120 / 128) ** 2))
    assert model.expected_experts(10_000) == pytest.approx(128)


def test_prefill_time_by_hand():
    model = round_numbers()
    # 1e-3 + 1e-9 * 23552 * 1000 + 2e-9 * 5e5
    assert model.prefill_time(1000, 5e5) == pytest.approx(1e-3 + 23552e-6 + 1e-3)
    # A batch of segments is the sum of its work, with one overhead.
    assert model.prefill_time([600, 400], [2e5, 3e5]) == pytest.approx(model.prefill_time(1000, 5e5))
    assert model.prefill_time(0, 0) == 0.0 and model.prefill_time([], []) == 0.0
    with pytest.raises(UsageError):
        model.prefill_time(-1, 0)


def test_prefill_times_reproduce_the_cost_model_speedup():
    # With no overhead and equal per-unit seconds, time ratios are cost ratios.
    model = dataclasses.replace(TimeModel.estimate("qwen3-8b"), batch_overhead=0.0)
    cost = CostModel(get_model("qwen3-8b"))
    context, evicted, start, append = 128 * 1024, 39322, 2048, 512

    def time_of(spans):
        return model.prefill_time([e - s for s, e in spans], [cost.attention_pairs(s, e) for s, e in spans])

    new = (context, context + append)
    front = time_of([(start, start + evicted), new])
    tail = time_of([(context - evicted, context), new])
    predicted = predict_speedup(cost, context, evicted=evicted, evict_start=start, append=append)
    assert tail / front == pytest.approx(predicted.predicted_speedup, rel=1e-12)
    assert 2.7 < tail / front < 3.0


def test_prefill_of_a_hole_batch_on_the_triton_kernel_pays_more_attention_only():
    fa3 = round_numbers()
    triton = dataclasses.replace(fa3, phantom_kernel="triton", triton_pair_ratio=1.5)
    contiguous = fa3.prefill_time(1000, 5e5)
    # Without holes both cost the FA3 speed; with holes FA3 is unchanged by default.
    assert triton.prefill_time(1000, 5e5) == contiguous == fa3.prefill_time(1000, 5e5, holes=True)
    assert (fa3.prefill_kernel(True), triton.prefill_kernel(True), triton.prefill_kernel(False)) == (
        "fa3", "triton", "fa3")
    # 1e-3 + 1e-9 * 23552 * 1000 + 1.5 * 2e-9 * 5e5: only the attention term grows.
    assert triton.prefill_time(1000, 5e5, holes=True) == pytest.approx(1e-3 + 23552e-6 + 1.5e-3)
    with pytest.raises(UsageError, match="unknown phantom kernel 'cuda'"):
        dataclasses.replace(fa3, phantom_kernel="cuda")
    with pytest.raises(UsageError, match="triton_pair_ratio must be positive"):
        dataclasses.replace(fa3, triton_pair_ratio=0.0)


def test_decode_step_time_by_hand():
    model = round_numbers()
    # Its own overhead (not the prefill batch's), the weights, two embedding rows, the KV.
    expected = 0.5e-3 + (model.weight_bytes + 2 * 8192 + 147456 * 50_000) / 1e12
    assert model.decode_step_time(2, 50_000) == pytest.approx(expected, rel=1e-12)
    assert model.decode_step_time(0, 0) == 0.0
    with pytest.raises(UsageError):
        model.decode_step_time(1, -5)


def test_decode_reads_only_routed_experts():
    model = round_numbers("qwen3-235b-a22b")
    one = model.decode_step_time(1, 0)
    rows = model.embedding_row_bytes
    assert one == pytest.approx(0.5e-3 + (model.weight_bytes + rows + 8 * model.expert_bytes) / 1e12)
    many = model.decode_step_time(1000, 0)
    assert many == pytest.approx(
        0.5e-3 + (model.weight_bytes + 1000 * rows + 128 * model.expert_bytes) / 1e12, rel=1e-6
    )


def test_decode_sliding_window_layers_read_at_most_their_window():
    model = round_numbers("gemma-3-27b")
    shape = get_model("gemma-3-27b")
    per_layer = 2 * shape.num_kv_heads * shape.head_dim * 2
    full_layers = sum(kind == "full" for kind in shape.layer_kinds)
    assert model.kv_bytes_per_token == full_layers * per_layer
    assert model.window_kv_bytes_per_token == (shape.num_layers - full_layers) * per_layer
    window = shape.sliding_window
    base = model.decode_step_time(1, 0)
    short = model.decode_step_time(1, window // 2) - base
    long = model.decode_step_time(1, 10 * window) - base
    assert short == pytest.approx(
        window // 2 * (model.kv_bytes_per_token + model.window_kv_bytes_per_token) / 1e12
    )
    assert long == pytest.approx(
        (10 * window * model.kv_bytes_per_token + window * model.window_kv_bytes_per_token) / 1e12
    )


def test_load_time_by_hand():
    model = round_numbers()
    assert model.load_time(1000) == pytest.approx(1000 * 147456 / 1e10)
    assert model.load_time(0) == 0.0
    with pytest.raises(UsageError):
        model.load_time(-1)


def test_calibration_json_overrides_estimates(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text(
        json.dumps(
            {
                "model": "qwen3-8b",
                "gpu": "h200",
                "source": "bench_cost_curve",
                "sec_per_linear_unit": 1.5e-9,
                "batch_overhead": 0.004,
                "decode_overhead": 0.0004,
                "triton_pair_ratio": 1.2,
            }
        )
    )
    model = TimeModel.from_json(path, "qwen3-8b", "h200")
    base = TimeModel.estimate("qwen3-8b", "h200")
    assert model.sec_per_linear_unit == 1.5e-9 and model.batch_overhead == 0.004
    assert model.decode_overhead == 0.0004 and model.triton_pair_ratio == 1.2
    assert model.sec_per_attention_pair == base.sec_per_attention_pair
    assert model.hbm_bandwidth == base.hbm_bandwidth and model.c_lin == base.c_lin
    assert set(CALIBRATION_KEYS) <= set(dataclasses.asdict(model))


@pytest.mark.parametrize(
    "content, message",
    [
        ({"sec_per_linear_unit": 1e-9, "tflops": 500}, "unknown calibration keys tflops"),
        ({"model": "qwen3-32b"}, "calibrated for model 'qwen3-32b'"),
        ({"gpu": "h200"}, "calibrated for gpu 'h200'"),
        ({"batch_overhead": "3ms"}, "'batch_overhead' must be a number"),
        ({"hbm_bandwidth": 0}, "hbm_bandwidth must be positive"),
        ({"batch_overhead": -1e-3}, "batch_overhead must be >= 0"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_calibration_json_errors(tmp_path, content, message):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(content))
    with pytest.raises(UsageError, match=message):
        TimeModel.from_json(path, "qwen3-8b", "h100")


def test_calibration_file_problems_and_unknown_gpu(tmp_path):
    with pytest.raises(UsageError, match="not found"):
        TimeModel.from_json(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(UsageError, match="not valid JSON"):
        TimeModel.from_json(bad)
    with pytest.raises(UsageError, match="unknown GPU 'a100'"):
        TimeModel.estimate("qwen3-8b", "a100")


def test_write_calibration_merges_files_of_the_same_model_and_gpu(tmp_path):
    from penelope.sim.timemodel import write_calibration

    path = tmp_path / "calibration.json"
    write_calibration(path, {"model": "qwen3-8b", "gpu": "h200", "source": "cost curve", "batch_overhead": 0.002})
    merged = write_calibration(path, {"model": "qwen3-8b", "gpu": "h200", "source": "decode",
                                      "decode_overhead": 4e-4, "hbm_bandwidth": 3.3e12})
    assert json.loads(path.read_text()) == merged == {
        "model": "qwen3-8b", "gpu": "h200", "source": "cost curve; decode", "batch_overhead": 0.002,
        "decode_overhead": 4e-4, "hbm_bandwidth": 3.3e12}
    # Writing the same constants again names its source once.
    assert write_calibration(path, {"model": "qwen3-8b", "gpu": "h200", "source": "decode"})["source"] == (
        "cost curve; decode")
    # Another GPU's constants replace the file rather than mix with it.
    assert write_calibration(path, {"model": "qwen3-8b", "gpu": "h100", "source": "x", "decode_overhead": 1e-3}) == {
        "model": "qwen3-8b", "gpu": "h100", "source": "x", "decode_overhead": 1e-3}
    with pytest.raises(UsageError, match="unknown calibration keys tflops"):
        write_calibration(path, {"tflops": 1})


def test_a_kv_read_growth_charges_each_kv_token_by_its_requests_context():
    base = TimeModel.estimate("qwen3-8b")
    model = dataclasses.replace(base, kv_read_growth=1 / 8192)
    # Four requests of 16,384 tokens: each KV token read at (1 + 2) times the cost.
    extra = base.kv_bytes_per_token * 65536 * 2 / base.hbm_bandwidth
    assert model.decode_step_time(4, 65536) == pytest.approx(base.decode_step_time(4, 65536) + extra, rel=1e-12)
    # The same KV held by 16 requests of 4,096 tokens grows by a half.
    extra = base.kv_bytes_per_token * 65536 * 0.5 / base.hbm_bandwidth
    assert model.decode_step_time(16, 65536) == pytest.approx(base.decode_step_time(16, 65536) + extra, rel=1e-12)
    # The simulator's runs of decode steps charge it step by step.
    times = decode_step_times(model, 3, 20_000, 50)
    np.testing.assert_allclose(times, [model.decode_step_time(3, 20_000 + 3 * k) for k in range(50)], rtol=1e-12)
    assert model.decode_step_time(0, 0) == 0.0
