"""A scale model of Qwen3-8B: a small Qwen3 checkpoint with real random weights on which the cost
model predicts, at context / scale, the front-vs-tail ratios it predicts for Qwen3-8B at full
context.

The cost model (``penelope.costmodel.recompute``) prices a token at position p as ``c_lin + p``
attention-pair units, so the ratio of two recomputations depends only on ``c_lin`` relative to
the positions involved. Dividing every position by `scale` and ``c_lin`` by the same factor
scales every cost by ``1 / scale`` (attention by ``1 / scale**2`` over ``scale`` fewer tokens),
and every predicted ratio stays the same. The widths are Qwen3-8B's divided by `scale` (hidden
4096 / scale, query width = hidden, 4 query heads per K/V head, head dim 128 while there are at
least 4 query heads, then 4 heads of hidden / 4), and the MLP width is solved so that ``c_lin``
is Qwen3-8B's divided by `scale`; the number of layers does not enter ``c_lin`` (the unit sums
over layers), so a few layers keep a CPU run cheap.

``python -m penelope.engine.scale_model DIR --scale 8`` writes one (``config.json`` +
``model.safetensors``, the layout ``save_checkpoint`` writes and SGLang loads).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from penelope.costmodel.recompute import CostModel
from penelope.costmodel.shapes import get_model, shape_from_config
from penelope.engine.decoder_config import EngineModelConfig
from penelope.errors import UsageError

BASE_MODEL = "qwen3-8b"
# Qwen3-8B's head dim and query heads per K/V head.
HEAD_DIM, GROUP = 128, 4
# Scales whose widths stay at least a few lanes: hidden 4096 / 256 = 16, 4 heads of 4.
MAX_SCALE = 256


def target_c_lin(scale: float) -> float:
    """Qwen3-8B's linear cost per token (attention-pair units) divided by `scale`."""
    return CostModel(get_model(BASE_MODEL)).c_lin / scale


def scale_model_config(scale: float, num_layers: int = 2, vocab_size: int = 4096,
                       max_position_embeddings: int = 65536) -> EngineModelConfig:
    """The scale model's shape for `scale` (a number in [1, 256]); its ``c_lin`` is within 0.1% of
    ``target_c_lin(scale)`` (the MLP width is an integer)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 1 <= scale <= MAX_SCALE:
        raise UsageError(f"scale must be a number in [1, {MAX_SCALE}], got {scale!r}")
    base = get_model(BASE_MODEL)
    q_heads_at_128 = base.num_q_heads / scale
    if q_heads_at_128 >= GROUP:
        head_dim, q_heads = HEAD_DIM, GROUP * max(1, round(q_heads_at_128 / GROUP))
    else:
        # Fewer than 4 heads of 128: keep 4 heads (one K/V head), narrower; RoPE needs an even dim.
        head_dim, q_heads = max(2, 2 * round(base.hidden_size / scale / GROUP / 2)), GROUP
    hidden = q_heads * head_dim
    name = f"{BASE_MODEL}-scale-{scale:g}"
    config = EngineModelConfig(vocab_size=vocab_size, hidden_size=hidden, num_layers=num_layers,
                               num_q_heads=q_heads, num_kv_heads=q_heads // GROUP, head_dim=head_dim,
                               intermediate_size=1, max_position_embeddings=max_position_embeddings, name=name)
    # c_lin is linear in the MLP width: solve for it with the cost model's own formula.
    at_one, at_two = (_c_lin(config, width) for width in (1, 2))
    width = round(1 + (target_c_lin(scale) - at_one) / (at_two - at_one))
    if width < 1:
        raise UsageError(f"scale {scale:g}: no MLP width gives c_lin {target_c_lin(scale):.0f}")
    return _with_width(config, width)


def save_scale_model(folder: str | Path, scale: float, num_layers: int = 2, seed: int = 0) -> Path:
    """Write the scale model for `scale` with random weights (``random_weights(seed)``: std
    1/sqrt(fan_in), activations of order one) to `folder`; returns the folder."""
    from penelope.engine.weights import random_weights, save_checkpoint

    config = scale_model_config(scale, num_layers)
    return save_checkpoint(folder, config, random_weights(config, seed=seed))


def _with_width(config: EngineModelConfig, width: int) -> EngineModelConfig:
    return EngineModelConfig(**{**config.as_dict(), "intermediate_size": width})


def _c_lin(config: EngineModelConfig, width: int) -> float:
    return CostModel(shape_from_config(_with_width(config, width).to_hf(), name=config.name)).c_lin


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="where to write config.json and model.safetensors")
    parser.add_argument("--scale", type=float, default=8.0, help="positions and c_lin divided by this (default 8)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2; c_lin does not depend on it)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        folder = save_scale_model(args.folder, args.scale, args.layers, args.seed)
    except UsageError as error:
        print(f"penelope: {error}", file=sys.stderr)
        return 2
    config = scale_model_config(args.scale, args.layers)
    c_lin = _c_lin(config, config.intermediate_size)
    print(f"{folder}: {config.name}, hidden {config.hidden_size}, {config.num_layers} layers, "
          f"{config.num_q_heads}/{config.num_kv_heads} heads of {config.head_dim}, intermediate "
          f"{config.intermediate_size}; c_lin {c_lin:.0f} (target {target_c_lin(args.scale):.0f}, "
          f"{100 * abs(c_lin / target_c_lin(args.scale) - 1):.2f}% off)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
