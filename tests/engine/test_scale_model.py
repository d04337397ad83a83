"""The scale model of Qwen3-8B: its cost model's c_lin is Qwen3-8B's divided by the scale, so the
cost model predicts at context / scale the front-vs-tail ratios it predicts for Qwen3-8B at full
context; the written checkpoint loads with real (non-constant) weights of that shape."""
import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from penelope.costmodel.recompute import CostModel, predict_speedup
from penelope.costmodel.shapes import get_model
from penelope.engine.scale_model import save_scale_model, scale_model_config
from penelope.engine.weights import load_checkpoint
from penelope.errors import UsageError

QWEN3_8B = CostModel(get_model("qwen3-8b"))


@pytest.mark.parametrize("scale", [1, 2, 3, 5, 8, 10, 16, 32, 100])
def test_c_lin_is_qwen3_8bs_divided_by_the_scale(scale):
    model = CostModel(get_model(scale_model_config(scale).to_hf()))
    assert QWEN3_8B.c_lin == 23_552
    assert model.c_lin == pytest.approx(QWEN3_8B.c_lin / scale, rel=0.02)


@pytest.mark.parametrize(("scale", "context"), [(8, 65_536), (8, 262_144), (16, 131_072), (4, 32_768)])
def test_predicts_qwen3_8bs_ratios_at_the_scaled_context(scale, context):
    model = CostModel(get_model(scale_model_config(scale).to_hf()))
    full = predict_speedup(QWEN3_8B, context, evict_start=2048, append=512)
    scaled = predict_speedup(model, context // scale, evict_start=2048 // scale, append=512 // scale)
    assert scaled.predicted_speedup == pytest.approx(full.predicted_speedup, rel=0.01)


def test_widths_at_scale_8_are_qwen3_8bs_divided_by_8():
    config = scale_model_config(8, num_layers=3)
    assert (config.hidden_size, config.intermediate_size, config.num_q_heads, config.num_kv_heads,
            config.head_dim, config.num_layers) == (512, 1536, 4, 1, 128, 3)


def test_the_checkpoint_loads_with_its_shape(tmp_path):
    run = subprocess.run([sys.executable, "-m", "penelope.engine.scale_model", str(tmp_path), "--scale", "16",
                          "--layers", "1"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "c_lin 1472 (target 1472" in run.stdout
    assert json.loads((tmp_path / "config.json").read_text())["hidden_size"] == 256
    config, weights = load_checkpoint(tmp_path)
    assert replace(config, name="") == replace(scale_model_config(16, num_layers=1), name="")
    assert weights.layers[0].q_proj.std() > 0
    assert CostModel(get_model(tmp_path)).c_lin == 1472
    # The seed decides the weights.
    _, again = load_checkpoint(save_scale_model(tmp_path / "again", 16, num_layers=1))
    assert torch.equal(again.layers[0].q_proj, weights.layers[0].q_proj)


@pytest.mark.parametrize("scale", [0.5, 300, "8", True])
def test_bad_scales_are_refused(scale):
    with pytest.raises(UsageError, match="scale must be a number in"):
        scale_model_config(scale)


def test_the_cli_refuses_a_bad_scale_in_one_line(tmp_path):
    run = subprocess.run([sys.executable, "-m", "penelope.engine.scale_model", str(tmp_path), "--scale", "0"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == ["penelope: scale must be a number in [1, 256], got 0.0"]
