"""Weights of the reference decoder: random from a seed, or a local HF Qwen3 checkpoint.

A checkpoint folder holds `config.json` and one or more `*.safetensors` files with the tensor
names of transformers' `Qwen3ForCausalLM` (`model.embed_tokens.weight`,
`model.layers.{i}.self_attn.q_proj.weight`, ..., `model.norm.weight`, `lm_head.weight`).
With tied embeddings `lm_head.weight` is absent (or ignored) and the LM head is the embedding.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from penelope.engine.decoder_config import EngineModelConfig
from penelope.errors import UsageError

# Field of LayerWeights -> tensor name under `model.layers.{i}.` in a Qwen3 checkpoint.
_LAYER_TENSORS = {
    "input_norm": "input_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "post_attention_norm": "post_attention_layernorm.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
}
_BIAS_TENSORS = {
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "o_bias": "self_attn.o_proj.bias",
}
_EMBED, _FINAL_NORM, _LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


@dataclass
class LayerWeights:
    """One decoder layer. Linear weights are `[out_features, in_features]` (torch layout):
    q_proj `[Hq*D, H]`, k_proj/v_proj `[Hkv*D, H]`, o_proj `[H, Hq*D]`, gate/up `[I, H]`,
    down `[H, I]`; norms are `[H]` (hidden) or `[D]` (per head). Biases only with
    `attention_bias`."""

    input_norm: torch.Tensor
    q_proj: torch.Tensor
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    o_proj: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    gate_proj: torch.Tensor
    up_proj: torch.Tensor
    down_proj: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None


@dataclass
class ModelWeights:
    """All weights: `embed` `[V, H]`, `layers`, `final_norm` `[H]`, `lm_head` `[V, H]` (the
    same tensor object as `embed` when the embeddings are tied)."""

    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device


def expected_shapes(config: EngineModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape for `config` (no `lm_head.weight` when tied)."""
    hidden, head_dim = config.hidden_size, config.head_dim
    per_layer = {
        "input_norm": (hidden,),
        "q_proj": (config.q_size, hidden),
        "k_proj": (config.kv_size, hidden),
        "v_proj": (config.kv_size, hidden),
        "o_proj": (hidden, config.q_size),
        "q_norm": (head_dim,),
        "k_norm": (head_dim,),
        "post_attention_norm": (hidden,),
        "gate_proj": (config.intermediate_size, hidden),
        "up_proj": (config.intermediate_size, hidden),
        "down_proj": (hidden, config.intermediate_size),
    }
    if config.attention_bias:
        per_layer.update(
            q_bias=(config.q_size,), k_bias=(config.kv_size,), v_bias=(config.kv_size,), o_bias=(hidden,)
        )
    names = {**_LAYER_TENSORS, **_BIAS_TENSORS}
    shapes = {_EMBED: (config.vocab_size, hidden), _FINAL_NORM: (hidden,)}
    for layer in range(config.num_layers):
        for field, shape in per_layer.items():
            shapes[f"model.layers.{layer}.{names[field]}"] = shape
    if not config.tie_word_embeddings:
        shapes[_LM_HEAD] = (config.vocab_size, hidden)
    return shapes


def random_weights(
    config: EngineModelConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    init_std: float | None = None,
) -> ModelWeights:
    """Random weights, identical for the same (config, seed, init_std) on every machine.

    Drawn in fp32 on the CPU, then cast and moved. By default linear weights have std
    1/sqrt(fan_in) and norm weights are 1 + 0.1 * N(0, 1), so activations stay of order one
    through the layers and every weight visibly matters (an implementation that skipped a norm
    weight would not match). With `init_std`, every matrix (embedding included) is N(0, init_std)
    and norms are 1, as transformers initializes a model with `initializer_range`: a large value
    (0.5) gives sharp attention, so outputs depend on tokens far back in the prompt.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    state = {}
    for name, shape in expected_shapes(config).items():
        if init_std is not None:
            tensor = torch.ones(shape) if name.endswith("norm.weight") else init_std * torch.randn(shape, generator=gen)
        elif name == _EMBED:
            tensor = 0.5 * torch.randn(shape, generator=gen)
        elif len(shape) == 2:
            tensor = torch.randn(shape, generator=gen) / shape[1] ** 0.5
        elif name.endswith("norm.weight"):
            tensor = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            tensor = 0.1 * torch.randn(shape, generator=gen)
        state[name] = tensor
    return from_state_dict(config, state, dtype=dtype, device=device)


def from_state_dict(
    config: EngineModelConfig,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> ModelWeights:
    """Weights from tensors named as in an HF Qwen3 checkpoint; checks names and shapes.

    `dtype` defaults to the embedding's dtype (every tensor is cast to one dtype). With tied
    embeddings an `lm_head.weight` entry is ignored, as transformers does.
    """
    expected = expected_shapes(config)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise UsageError(f"checkpoint lacks {len(missing)} tensors for {config.name!r}, e.g. {missing[:3]}")
    ignorable = {_LM_HEAD} if config.tie_word_embeddings else set()
    unexpected = sorted(
        name for name in set(state) - set(expected) - ignorable if not name.endswith("rotary_emb.inv_freq")
    )
    if unexpected:
        raise UsageError(
            f"checkpoint has {len(unexpected)} tensors a Qwen3 {config.name!r} does not use, e.g. {unexpected[:3]}"
        )
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise UsageError(f"checkpoint tensor {name} has shape {tuple(state[name].shape)}, expected {shape}")

    dtype = dtype or state[_EMBED].dtype
    device = device if device is not None else state[_EMBED].device

    def get(name: str) -> torch.Tensor:
        return state[name].to(device=device, dtype=dtype).contiguous()

    layers = []
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        fields = {field: get(prefix + name) for field, name in _LAYER_TENSORS.items()}
        if config.attention_bias:
            fields.update({field: get(prefix + name) for field, name in _BIAS_TENSORS.items()})
        layers.append(LayerWeights(**fields))
    embed = get(_EMBED)
    lm_head = embed if config.tie_word_embeddings else get(_LM_HEAD)
    return ModelWeights(embed=embed, layers=layers, final_norm=get(_FINAL_NORM), lm_head=lm_head)


def to_state_dict(config: EngineModelConfig, weights: ModelWeights) -> dict[str, torch.Tensor]:
    """HF Qwen3 tensor names -> tensors (no `lm_head.weight` when tied)."""
    state = {_EMBED: weights.embed, _FINAL_NORM: weights.final_norm}
    names = {**_LAYER_TENSORS, **(_BIAS_TENSORS if config.attention_bias else {})}
    for layer, lw in enumerate(weights.layers):
        for field, name in names.items():
            state[f"model.layers.{layer}.{name}"] = getattr(lw, field)
    if not config.tie_word_embeddings:
        state[_LM_HEAD] = weights.lm_head
    return state


def load_checkpoint(
    folder: str | Path,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> tuple[EngineModelConfig, ModelWeights]:
    """Config and weights of a local HF Qwen3 checkpoint folder (`config.json` + `*.safetensors`,
    one file or several shards). Raises `UsageError` on missing files, duplicate tensors across
    shards, missing or extra tensors and wrong shapes."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not folder.is_dir():
        raise UsageError(f"checkpoint folder {folder} does not exist")
    config = EngineModelConfig.from_hf(folder / "config.json", name=folder.name)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UsageError(f"no *.safetensors files in {folder}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file), device="cpu").items():
            if name in state:
                raise UsageError(f"tensor {name} appears in more than one file of {folder}")
            state[name] = tensor
    return config, from_state_dict(config, state, dtype=dtype, device=device)


def save_checkpoint(folder: str | Path, config: EngineModelConfig, weights: ModelWeights) -> Path:
    """Write `config.json` and `model.safetensors` in HF Qwen3 layout; returns the folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hf_config = config.to_hf()
    hf_config["torch_dtype"] = str(weights.dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    state = {name: t.detach().to("cpu").contiguous() for name, t in to_state_dict(config, weights).items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
