"""The cost model: the 23,552 derivation, MoE and sliding-window accounting, the paper's numbers."""
import json

import numpy as np
import pytest

from penelope.costmodel.recompute import CostModel, predict_speedup
from penelope.costmodel.shapes import KNOWN_MODELS, get_model, shape_from_config
from penelope.errors import UsageError


def cost(name):
    return CostModel(get_model(name))


def test_qwen3_8b_linear_cost_is_derived_from_the_shape():
    shape = get_model("qwen3-8b")
    per_layer = 2 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 12288)
    assert shape.linear_flops_per_token() == per_layer * 36
    assert CostModel(shape).c_lin == 23552
    assert CostModel(shape).flops_per_unit == 4 * 128 * 32 * 36


def test_moe_counts_only_active_experts_and_router():
    moe = get_model("qwen3-235b-a22b")
    hidden, layers = 4096, 94
    attn = hidden * (64 * 128 + 2 * 4 * 128) + 64 * 128 * hidden
    experts = 8 * 3 * hidden * 1536 + hidden * 128
    assert moe.linear_flops_per_token() == 2 * layers * (attn + experts)
    # Making every expert active must raise the cost by exactly the inactive experts' FLOPs.
    dense_all = dict(moe_config := {**_qwen3_moe_config()}, num_experts_per_tok=128)
    all_active = shape_from_config(dense_all).linear_flops_per_token()
    one_config = shape_from_config(moe_config).linear_flops_per_token()
    assert all_active - one_config == pytest.approx(2 * layers * 120 * 3 * hidden * 1536)


def _qwen3_moe_config():
    from penelope.costmodel.hf_configs import BUILTIN_CONFIGS

    return dict(BUILTIN_CONFIGS["qwen3-235b-a22b"])


def test_mlp_only_layers_and_sparse_step_are_dense():
    config = {**_qwen3_moe_config(), "num_hidden_layers": 4, "mlp_only_layers": [0], "decoder_sparse_step": 1}
    shape = shape_from_config(config)
    assert shape.moe_layers == (False, True, True, True)
    stepped = shape_from_config({**config, "mlp_only_layers": [], "decoder_sparse_step": 2})
    assert stepped.moe_layers == (False, True, False, True)


def test_position_cost_is_monotone_and_linear_for_full_attention():
    model = cost("qwen3-8b")
    positions = np.arange(0, 200_000, 997)
    values = model.position_cost(positions)
    assert np.all(np.diff(values) > 0)
    assert model.position_cost(1000) == model.c_lin + 1000


def test_span_cost_matches_the_sum_of_position_costs():
    for name in ("qwen3-8b", "gemma-3-27b", "gpt-oss-20b"):
        model = cost(name)
        for start, end in ((0, 1), (0, 3000), (1000, 1500), (5000, 9000)):
            expected = float(np.sum(model.position_cost(np.arange(start, end))))
            assert model.span_cost(start, end) == pytest.approx(expected, rel=1e-12)


def test_sliding_window_layers_stop_growing_after_the_window():
    gemma = get_model("gemma-3-27b")
    assert gemma.layer_kinds.count("full") == 10 and gemma.layer_kinds.count("sliding") == 52
    model = CostModel(gemma)
    w = gemma.sliding_window
    slope_inside = model.position_cost(w - 1) - model.position_cost(w - 2)
    slope_outside = model.position_cost(10 * w + 1) - model.position_cost(10 * w)
    assert slope_inside == pytest.approx(1.0)
    assert slope_outside == pytest.approx(10 / 62)


def test_linear_attention_layers_have_no_position_term():
    config = {
        "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 512, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    }
    model = CostModel(shape_from_config(config))
    assert model.position_cost(1000) - model.position_cost(0) == pytest.approx(1000 / 4)


def test_sliding_window_model_has_a_much_smaller_front_advantage():
    qwen = predict_speedup(cost("qwen3-8b"), 128 * 1024).predicted_speedup
    gemma = predict_speedup(cost("gemma-3-27b"), 128 * 1024).predicted_speedup
    assert gemma < 1.3 < 2.5 < qwen


@pytest.mark.parametrize("context, low, high", [(8 * 1024, 1.08, 1.15), (128 * 1024, 2.8, 2.95)])
def test_reference_predictions_of_the_paper(context, low, high):
    # The paper measured 1.14x at 8K and 2.93x at 128K on an H100 (Qwen3-8B, 30% from 2K, +512).
    speedup = predict_speedup(cost("qwen3-8b"), context, 0.3, 2048, 512).predicted_speedup
    assert low < speedup < high


def test_speedup_grows_with_context():
    model = cost("qwen3-8b")
    speedups = [predict_speedup(model, k * 1024).predicted_speedup for k in (8, 16, 32, 64, 128)]
    assert speedups == sorted(speedups)


def test_shared_prefix_illustration_is_about_2_3x():
    # 16K shared + 100K private, free 30K: tail eviction recomputes ~2.3x the cost of the front.
    p = predict_speedup(cost("qwen3-8b"), 116 * 1024, None, 16 * 1024, 0, evicted=30 * 1024)
    assert p.predicted_speedup == pytest.approx(2.3, abs=0.05)


def test_bad_experiment_inputs_raise_usage_errors():
    model = cost("qwen3-8b")
    for kwargs in (
        {"context": 0},
        {"context": 8192, "evict_frac": 0.0},
        {"context": 8192, "evict_frac": 1.0},
        {"context": 8192, "evict_start": 8192},
        {"context": 8192, "evict_start": 7000},
        {"context": 8192, "append": -1},
    ):
        with pytest.raises(UsageError):
            predict_speedup(model, **kwargs)
    with pytest.raises(UsageError):
        model.span_cost(10, 5)


def test_builtin_models_and_config_paths(tmp_path):
    assert {"qwen3-8b", "qwen3-32b", "qwen3-235b-a22b", "gpt-oss-20b", "gemma-3-27b"} <= set(KNOWN_MODELS)
    for name in KNOWN_MODELS:
        assert CostModel(get_model(name)).c_lin > 0
    from penelope.costmodel.hf_configs import BUILTIN_CONFIGS

    path = tmp_path / "config.json"
    path.write_text(json.dumps(BUILTIN_CONFIGS["qwen3-8b"]))
    assert CostModel(get_model(path)).c_lin == 23552
    assert CostModel(get_model(tmp_path)).c_lin == 23552
    nested = tmp_path / "gemma.json"
    nested.write_text(json.dumps({"text_config": BUILTIN_CONFIGS["gemma-3-27b"]}))
    assert get_model(nested).layer_kinds == get_model("gemma-3-27b").layer_kinds


def test_bad_models_raise_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="known models: .*qwen3-8b"):
        get_model("qwen9-1t")
    with pytest.raises(UsageError, match="not found"):
        get_model(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(UsageError, match="not valid JSON"):
        get_model(broken)
    with pytest.raises(UsageError, match="lacks"):
        get_model({"hidden_size": 64})
    with pytest.raises(UsageError, match="multiple"):
        get_model({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 3, "num_key_value_heads": 2})


def _exact_units(c_lin: int, positions: range, full: int, sliding: int, window: int, layers: int):
    """Recompute units of `positions`, summed token by token in exact rational arithmetic: c_lin
    plus, averaged over layers, p for a full-attention layer and min(p, window) for a sliding one."""
    from fractions import Fraction

    attention = sum(full * p + sliding * min(p, window) for p in positions)
    return c_lin * len(positions) + Fraction(attention, layers)


# The README's table (`penelope cost --model M`: 30% evicted from position 2K, plus 512 new tokens).
README_SPEEDUPS = {
    "qwen3-8b": (23_552, [1.110, 1.292, 1.624, 2.161, 2.897]),
    "qwen3-32b": (29_760, [1.090, 1.241, 1.522, 1.993, 2.675]),
    "qwen3-235b-a22b": (13_600, [1.172, 1.443, 1.909, 2.591, 3.412]),
    "gemma-3-27b": (50_400, [1.009, 1.026, 1.061, 1.129, 1.260]),
}


@pytest.mark.parametrize("name", list(README_SPEEDUPS))
def test_predicted_speedups_equal_a_token_by_token_sum(name):
    """Exact values, not bands: the closed forms against a sum over every recomputed token, and
    the README's published table to its last digit."""
    c_lin, published = README_SPEEDUPS[name]
    shape = get_model(name)
    model = CostModel(shape)
    assert model.c_lin == c_lin
    full = sum(kind == "full" for kind in shape.layer_kinds)
    sliding = shape.num_layers - full
    for k, want in zip((8, 16, 32, 64, 128), published, strict=True):
        context = k * 1024
        evicted = round(0.3 * context)
        p = predict_speedup(model, context, 0.3, 2048, 512)

        def units(start, end):
            return _exact_units(c_lin, range(start, end), full, sliding, shape.sliding_window, shape.num_layers)

        new = units(context, context + 512)
        front = units(2048, 2048 + evicted) + new
        tail = units(context - evicted, context) + new
        assert p.front_cost == pytest.approx(float(front), rel=1e-12)
        assert p.tail_cost == pytest.approx(float(tail), rel=1e-12)
        assert round(float(tail / front), 3) == want


def test_mlp_only_layers_outside_the_model_are_refused():
    config = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "intermediate_size": 128, "num_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 32, "mlp_only_layers": [5, -1]}
    with pytest.raises(UsageError, match="'mlp_only_layers' names layer 5, outside the model's 2 layers"):
        shape_from_config(config)
