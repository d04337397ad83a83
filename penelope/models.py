"""Model shapes for the cost model, built from HF-style configs.

A `ModelShape` keeps what recompute cost depends on: the linear layers (attention projections
and the MLP or the active experts of an MoE) and, per layer, the kind of attention (full,
sliding window, linear attention)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from penelope.errors import UsageError
from penelope.model_configs import BUILTIN_CONFIGS

FULL, SLIDING, LINEAR = "full", "sliding", "linear"
_LAYER_KIND_NAMES = {
    "full_attention": FULL,
    "attention": FULL,
    "global": FULL,
    "sliding_attention": SLIDING,
    "sliding_window": SLIDING,
    "local": SLIDING,
    "linear_attention": LINEAR,
    "mamba": LINEAR,
}


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of a decoder-only transformer, as far as the cost model needs them.

    `layer_kinds[i]` is `"full"`, `"sliding"` or `"linear"`; `sliding_window` is the window of
    sliding layers in tokens. MoE layers (`moe_layers[i]`) use `experts_per_token` experts of
    `expert_intermediate_size` plus a router over `num_experts`, and a shared expert of
    `shared_expert_intermediate_size` when it is non-zero; other layers use a dense SwiGLU MLP of
    `intermediate_size`.
    """

    name: str
    hidden_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    layer_kinds: tuple[str, ...]
    moe_layers: tuple[bool, ...]
    sliding_window: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    vocab_size: int = 0

    def __post_init__(self) -> None:
        for field in ("hidden_size", "num_layers", "num_q_heads", "num_kv_heads", "head_dim"):
            if getattr(self, field) <= 0:
                raise UsageError(f"model {self.name!r}: {field} must be positive, got {getattr(self, field)}")
        if self.num_q_heads % self.num_kv_heads:
            raise UsageError(
                f"model {self.name!r}: num_q_heads {self.num_q_heads} is not a multiple of "
                f"num_kv_heads {self.num_kv_heads}"
            )
        if len(self.layer_kinds) != self.num_layers or len(self.moe_layers) != self.num_layers:
            raise UsageError(f"model {self.name!r}: per-layer lists must have {self.num_layers} entries")
        unknown = set(self.layer_kinds) - {FULL, SLIDING, LINEAR}
        if unknown:
            raise UsageError(f"model {self.name!r}: unknown layer kinds {sorted(unknown)}")
        if SLIDING in self.layer_kinds and self.sliding_window <= 0:
            raise UsageError(f"model {self.name!r}: sliding layers need a positive sliding_window")
        if any(self.moe_layers) and (self.experts_per_token <= 0 or self.expert_intermediate_size <= 0):
            raise UsageError(f"model {self.name!r}: MoE layers need experts_per_token and expert size")

    @property
    def is_moe(self) -> bool:
        return any(self.moe_layers)

    def linear_flops_per_token(self) -> float:
        """FLOPs of the linear layers for one token, all layers (2 FLOPs per multiply-add).

        Attention projections and MLP or active experts plus router; embeddings, norms and the
        LM head are left out (the LM head runs only for the last token of a prefill)."""
        q_dim = self.num_q_heads * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        attn = self.hidden_size * (q_dim + 2 * kv_dim) + q_dim * self.hidden_size
        dense_mlp = 3 * self.hidden_size * self.intermediate_size
        moe_mlp = (
            self.experts_per_token * 3 * self.hidden_size * self.expert_intermediate_size
            + 3 * self.hidden_size * self.shared_expert_intermediate_size
            + self.hidden_size * self.num_experts
        )
        total = 0
        for is_moe in self.moe_layers:
            total += attn + (moe_mlp if is_moe else dense_mlp)
        return 2.0 * total

    def active_params(self) -> float:
        """Parameters read per decode step (active experts only), embeddings and LM head included."""
        return self.linear_flops_per_token() / 2.0 + 2 * self.vocab_size * self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes of K and V one token keeps in the cache over all attention layers."""
        attn_layers = sum(kind != LINEAR for kind in self.layer_kinds)
        return 2 * attn_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def _layer_kinds(config: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    if config.get("layer_types"):
        names = list(config["layer_types"])
        if len(names) != num_layers:
            raise UsageError(f"layer_types has {len(names)} entries for {num_layers} layers")
        try:
            return tuple(_LAYER_KIND_NAMES[str(name)] for name in names)
        except KeyError as err:
            raise UsageError(f"unknown layer type {err.args[0]!r} in layer_types") from None
    pattern = config.get("sliding_window_pattern")
    if pattern and config.get("sliding_window"):
        # Gemma-3 style: every pattern-th layer is global, the others are local.
        return tuple(FULL if (i + 1) % int(pattern) == 0 else SLIDING for i in range(num_layers))
    if config.get("use_sliding_window") and config.get("sliding_window"):
        # Qwen-style switch: layers from max_window_layers on use the window.
        first = int(config.get("max_window_layers", 0))
        return tuple(SLIDING if i >= first else FULL for i in range(num_layers))
    return (FULL,) * num_layers


def _moe_layers(config: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    num_experts = _num_experts(config)
    if not num_experts:
        return (False,) * num_layers
    step = int(config.get("decoder_sparse_step", 1) or 1)
    dense = set(config.get("mlp_only_layers") or [])
    first_dense = int(config.get("first_k_dense_replace", 0) or 0)
    return tuple(
        i not in dense and i >= first_dense and (i + 1) % step == 0 for i in range(num_layers)
    )


def _num_experts(config: dict[str, Any]) -> int:
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if config.get(key):
            return int(config[key])
    return 0


def shape_from_config(config: dict[str, Any], name: str = "custom") -> ModelShape:
    """Build a `ModelShape` from an HF-style config dict (a nested `text_config` is used if present)."""
    if "text_config" in config and "hidden_size" not in config:
        config = config["text_config"]
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads")
    missing = [key for key in required if key not in config]
    if missing:
        raise UsageError(f"model config {name!r} lacks {', '.join(missing)}")
    hidden = int(config["hidden_size"])
    layers = int(config["num_hidden_layers"])
    q_heads = int(config["num_attention_heads"])
    num_experts = _num_experts(config)
    moe_layers = _moe_layers(config, layers)
    expert_size = int(config.get("moe_intermediate_size") or config.get("intermediate_size") or 0)
    return ModelShape(
        name=name,
        hidden_size=hidden,
        num_layers=layers,
        num_q_heads=q_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or q_heads),
        head_dim=int(config.get("head_dim") or hidden // q_heads),
        intermediate_size=int(config.get("intermediate_size") or 0),
        layer_kinds=_layer_kinds(config, layers),
        moe_layers=moe_layers,
        sliding_window=int(config.get("sliding_window") or 0),
        num_experts=num_experts,
        experts_per_token=int(config.get("num_experts_per_tok") or config.get("experts_per_token") or 0),
        expert_intermediate_size=expert_size if num_experts else 0,
        shared_expert_intermediate_size=int(config.get("shared_expert_intermediate_size") or 0),
        vocab_size=int(config.get("vocab_size") or 0),
    )


KNOWN_MODELS = tuple(sorted(BUILTIN_CONFIGS))


def read_config_json(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """Read an HF `config.json` (or the one inside a checkpoint folder): (its path, its contents)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise UsageError(f"model config file not found: {path}")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UsageError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(config, dict):
        raise UsageError(f"{path}: a model config must be a JSON object")
    return path, config


def get_model(spec: str | Path | dict[str, Any]) -> ModelShape:
    """A model shape from a built-in name (see `KNOWN_MODELS`), a config.json path, or a dict."""
    if isinstance(spec, dict):
        return shape_from_config(spec)
    text = str(spec)
    key = text.lower()
    if key in BUILTIN_CONFIGS:
        return shape_from_config(BUILTIN_CONFIGS[key], name=key)
    path = Path(text)
    if path.is_dir() or path.suffix == ".json" or path.exists():
        path, config = read_config_json(path)
        return shape_from_config(config, name=path.parent.name or path.stem)
    raise UsageError(f"unknown model {text!r}; known models: {', '.join(KNOWN_MODELS)}, or a config.json path")
