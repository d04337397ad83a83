"""Model shapes for the cost model, built from HF-style configs.

A `ModelShape` keeps what recompute cost depends on: the linear layers (attention projections
and the MLP or the active experts of an MoE) and, per layer, the kind of attention (full,
sliding window, linear attention)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from penelope.costmodel.hf_configs import BUILTIN_CONFIGS
from penelope.errors import UsageError
from penelope.jsonfile import read_json

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


# Largest accepted value of each dimension: far beyond any published model (the largest have
# about 128 layers, 128 heads, hidden size 16K, 256 experts, 262K vocabulary), and small enough
# that per-layer work and the cost arithmetic stay quick and exact.
LIMITS = {
    "hidden_size": 1 << 20,
    "num_layers": 4096,
    "num_q_heads": 1 << 16,
    "num_kv_heads": 1 << 16,
    "head_dim": 1 << 16,
    "intermediate_size": 1 << 24,
    "sliding_window": 2**31 - 1,
    "num_experts": 1 << 20,
    "experts_per_token": 1 << 20,
    "expert_intermediate_size": 1 << 24,
    "shared_expert_intermediate_size": 1 << 24,
    "vocab_size": 1 << 24,
}
_POSITIVE = ("hidden_size", "num_layers", "num_q_heads", "num_kv_heads", "head_dim")


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of a decoder-only transformer, as far as the cost model needs them.

    `layer_kinds[i]` is `"full"`, `"sliding"` or `"linear"`; `sliding_window` is the window of
    sliding layers in tokens. MoE layers (`moe_layers[i]`) use `experts_per_token` experts of
    `expert_intermediate_size` plus a router over `num_experts`, and a shared expert of
    `shared_expert_intermediate_size` when it is non-zero; other layers use a dense SwiGLU MLP of
    `intermediate_size`. Every dimension is an integer within `LIMITS` (positive for `_POSITIVE`).
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
        for field, limit in LIMITS.items():
            value = getattr(self, field)
            low = 1 if field in _POSITIVE else 0
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= limit:
                raise UsageError(f"model {self.name!r}: {field} must be an integer in [{low}, {limit}], got {value!r}")
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
        if any(self.moe_layers) and self.experts_per_token > self.num_experts:
            raise UsageError(f"model {self.name!r}: {self.experts_per_token} experts per token exceed the "
                             f"{self.num_experts} experts")

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


def _integer(config: dict[str, Any], key: str, where: str, *, low: int = 0, high: int,
             default: int | None = None) -> int:
    """`config[key]` as an integer in [low, high]; `default` when absent or null (None: required).

    JSON integers written as floats (`36.0`) are accepted; `36.7`, strings, booleans and
    infinities are not, so nothing is truncated or guessed."""
    value = config.get(key)
    if value is None:
        if default is None:
            raise UsageError(f"{where}: '{key}' is {'null' if key in config else 'missing'}; it is required")
        return default
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(f"{where}: '{key}' must be an integer, got {value!r}")
    if not low <= value <= high:
        raise UsageError(f"{where}: '{key}' must be in [{low}, {high}], got {value}")
    return value


def _first_integer(config, keys, where, *, high: int) -> int:
    """The first of `keys` present (not null), as a non-negative integer; 0 when none is."""
    for key in keys:
        if config.get(key) is not None:
            return _integer(config, key, where, high=high)
    return 0


def _layer_kinds(config: dict[str, Any], num_layers: int, where: str) -> tuple[str, ...]:
    names = config.get("layer_types")
    if names:
        if not isinstance(names, list):
            raise UsageError(f"{where}: 'layer_types' must be a list, got {names!r}")
        if len(names) != num_layers:
            raise UsageError(f"{where}: layer_types has {len(names)} entries for {num_layers} layers")
        for name in names:
            if not isinstance(name, str) or name not in _LAYER_KIND_NAMES:
                raise UsageError(f"{where}: unknown layer type {name!r} in layer_types")
        return tuple(_LAYER_KIND_NAMES[name] for name in names)
    window = config.get("sliding_window")
    if config.get("sliding_window_pattern") is not None and window:
        # Gemma-3 style: every pattern-th layer is global, the others are local.
        pattern = _integer(config, "sliding_window_pattern", where, low=1, high=num_layers + 1)
        return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers))
    if config.get("use_sliding_window") and window:
        # Qwen-style switch: layers from max_window_layers on use the window.
        first = _integer(config, "max_window_layers", where, high=LIMITS["num_layers"], default=0)
        return tuple(SLIDING if i >= first else FULL for i in range(num_layers))
    return (FULL,) * num_layers


def _moe_layers(config: dict[str, Any], num_layers: int, num_experts: int, where: str) -> tuple[bool, ...]:
    if not num_experts:
        return (False,) * num_layers
    step = _integer(config, "decoder_sparse_step", where, low=1, high=LIMITS["num_layers"], default=1)
    dense_list = config.get("mlp_only_layers") or []
    if not isinstance(dense_list, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in dense_list):
        raise UsageError(f"{where}: 'mlp_only_layers' must be a list of layer numbers, got {dense_list!r}")
    outside = [i for i in dense_list if not 0 <= i < num_layers]
    if outside:
        raise UsageError(f"{where}: 'mlp_only_layers' names layer {outside[0]}, outside the model's "
                         f"{num_layers} layers")
    dense = set(dense_list)
    first_dense = _integer(config, "first_k_dense_replace", where, high=LIMITS["num_layers"], default=0)
    return tuple(
        i not in dense and i >= first_dense and (i + 1) % step == 0 for i in range(num_layers)
    )


def shape_from_config(config: dict[str, Any], name: str = "custom", where: str | None = None) -> ModelShape:
    """Build a `ModelShape` from an HF-style config dict (a nested `text_config` is used if present).

    `where` names the config in messages (default: the model's name). Absent or null optional
    fields take HF's defaults; present ones must be integers in range (see `LIMITS`)."""
    where = where or f"model config {name!r}"
    if not isinstance(config, dict):
        raise UsageError(f"{where}: a model config must be a JSON object")
    if "text_config" in config and "hidden_size" not in config:
        config = config["text_config"]
        where += " text_config"
        if not isinstance(config, dict):
            raise UsageError(f"{where}: must be a JSON object")
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads")
    missing = [key for key in required if key not in config]
    if missing:
        raise UsageError(f"{where} lacks {', '.join(missing)}")
    hidden = _integer(config, "hidden_size", where, low=1, high=LIMITS["hidden_size"])
    layers = _integer(config, "num_hidden_layers", where, low=1, high=LIMITS["num_layers"])
    q_heads = _integer(config, "num_attention_heads", where, low=1, high=LIMITS["num_q_heads"])
    num_experts = _first_integer(config, ("num_experts", "num_local_experts", "n_routed_experts"), where,
                                 high=LIMITS["num_experts"])
    intermediate = _integer(config, "intermediate_size", where, high=LIMITS["intermediate_size"], default=0)
    expert_size = _first_integer(config, ("moe_intermediate_size",), where, high=LIMITS["expert_intermediate_size"])
    fields = dict(
        name=name,
        hidden_size=hidden,
        num_layers=layers,
        num_q_heads=q_heads,
        num_kv_heads=_integer(config, "num_key_value_heads", where, low=1, high=LIMITS["num_kv_heads"],
                              default=q_heads),
        head_dim=_integer(config, "head_dim", where, low=1, high=LIMITS["head_dim"], default=hidden // q_heads),
        intermediate_size=intermediate,
        layer_kinds=_layer_kinds(config, layers, where),
        moe_layers=_moe_layers(config, layers, num_experts, where),
        sliding_window=_integer(config, "sliding_window", where, high=LIMITS["sliding_window"], default=0),
        num_experts=num_experts,
        experts_per_token=_first_integer(config, ("num_experts_per_tok", "experts_per_token"), where,
                                         high=LIMITS["experts_per_token"]),
        expert_intermediate_size=(expert_size or intermediate) if num_experts else 0,
        shared_expert_intermediate_size=_integer(config, "shared_expert_intermediate_size", where,
                                                 high=LIMITS["shared_expert_intermediate_size"], default=0),
        vocab_size=_integer(config, "vocab_size", where, high=LIMITS["vocab_size"], default=0),
    )
    try:
        return ModelShape(**fields)
    except UsageError as err:
        # The shape's own checks name the model; say which file it came from.
        raise UsageError(f"{where}: {err}") from None


KNOWN_MODELS = tuple(sorted(BUILTIN_CONFIGS))


# A config.json is a few KB; anything this large is not one.
MAX_CONFIG_BYTES = 16 * 2**20


def read_config_json(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """Read an HF `config.json` (or the one inside a checkpoint folder): (its path, its contents)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    config = read_json(path, "model config file", MAX_CONFIG_BYTES)
    if not isinstance(config, dict):
        raise UsageError(f"{path}: a model config must be a JSON object")
    return path, config


def model_path(spec: str | None) -> str | None:
    """The file a `--model` option reads (a config.json path), or None for a built-in name."""
    if spec is None or str(spec).lower() in BUILTIN_CONFIGS:
        return None
    path = Path(spec)
    return str(path / "config.json") if path.is_dir() else str(path)


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
        return shape_from_config(config, name=path.parent.name or path.stem, where=str(path))
    raise UsageError(f"`model` {text!r} is not a built-in model or a config.json path; known models: "
                     f"{', '.join(KNOWN_MODELS)}")
