"""Configuration of the reference engine's Qwen3-architecture decoder.

`EngineModelConfig` holds exactly what the forward pass needs. It is built from a Hugging Face
Qwen3 config (a dict or a `config.json` path) or taken from the built-in tiny configs used by
the CPU tests. Features of the HF config that the engine does not implement (sliding-window
layers, RoPE scaling, activations other than SiLU) are rejected rather than silently ignored.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from penelope.costmodel.shapes import read_config_json
from penelope.errors import UsageError


@dataclass(frozen=True)
class EngineModelConfig:
    """Shape and constants of a Qwen3 decoder.

    `num_q_heads` query heads share `num_kv_heads` key/value heads (GQA, group size
    `num_q_heads // num_kv_heads`), each `head_dim` wide. `rope_theta` is the RoPE base;
    `rms_norm_eps` the epsilon of every RMSNorm (hidden and per-head q/k norms).
    With `tie_word_embeddings` the LM head is the embedding matrix.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 40_960
    name: str = "custom"

    def __post_init__(self) -> None:
        for field in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_q_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
        ):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise UsageError(f"engine config {self.name!r}: {field} must be a positive int, got {value!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise UsageError(
                f"engine config {self.name!r}: num_q_heads {self.num_q_heads} is not a multiple of "
                f"num_kv_heads {self.num_kv_heads}"
            )
        # RoPE rotates the two halves of each head against each other.
        if self.head_dim % 2:
            raise UsageError(f"engine config {self.name!r}: head_dim must be even, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise UsageError(f"engine config {self.name!r}: rope_theta must be positive, got {self.rope_theta}")
        if not self.rms_norm_eps > 0:
            raise UsageError(
                f"engine config {self.name!r}: rms_norm_eps must be positive, got {self.rms_norm_eps}"
            )

    @property
    def group_size(self) -> int:
        """Query heads per key/value head."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        """Width of the q projection's output: num_q_heads * head_dim."""
        return self.num_q_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the k (or v) projection's output: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, source: dict[str, Any] | str | Path, name: str | None = None) -> EngineModelConfig:
        """Build from an HF Qwen3 config: a dict, a `config.json` path or a checkpoint folder."""
        if isinstance(source, dict):
            hf = source
            default_name = str(hf.get("_name_or_path") or hf.get("model_type") or "hf-config")
        else:
            path, hf = read_config_json(source)
            default_name = path.parent.name or "hf-config"
        return cls(**_fields_from_hf(hf, name or default_name))

    def to_hf(self) -> dict[str, Any]:
        """The equivalent HF `config.json` contents (`model_type` "qwen3")."""
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_q_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "use_sliding_window": False,
            "torch_dtype": "float32",
        }

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _fields_from_hf(hf: dict[str, Any], name: str) -> dict[str, Any]:
    model_type = hf.get("model_type", "qwen3")
    if model_type != "qwen3":
        raise UsageError(f"engine config {name!r}: model_type {model_type!r} is not supported (only qwen3)")
    if hf.get("use_sliding_window"):
        raise UsageError(f"engine config {name!r}: sliding-window attention is not supported by the engine")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UsageError(f"engine config {name!r}: hidden_act {act!r} is not supported (only silu)")
    rope_theta, rope_type = _rope_from_hf(hf)
    if rope_type not in (None, "default"):
        raise UsageError(f"engine config {name!r}: RoPE scaling {rope_type!r} is not supported")

    required = {
        "vocab_size": "vocab_size",
        "hidden_size": "hidden_size",
        "num_layers": "num_hidden_layers",
        "num_q_heads": "num_attention_heads",
        "intermediate_size": "intermediate_size",
    }
    missing = [hf_key for hf_key in required.values() if hf_key not in hf]
    if missing:
        raise UsageError(f"engine config {name!r}: missing keys {missing}")
    fields: dict[str, Any] = {ours: hf[theirs] for ours, theirs in required.items()}
    fields["num_kv_heads"] = hf.get("num_key_value_heads") or fields["num_q_heads"]
    head_dim = hf.get("head_dim")
    if head_dim is None:
        if fields["hidden_size"] % fields["num_q_heads"]:
            raise UsageError(f"engine config {name!r}: no head_dim and hidden_size not divisible by heads")
        head_dim = fields["hidden_size"] // fields["num_q_heads"]
    fields["head_dim"] = head_dim
    fields["rope_theta"] = float(rope_theta)
    fields["rms_norm_eps"] = float(hf.get("rms_norm_eps", 1e-6))
    fields["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", False))
    fields["attention_bias"] = bool(hf.get("attention_bias", False))
    fields["max_position_embeddings"] = hf.get("max_position_embeddings", 40_960)
    fields["name"] = name
    return fields


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, str | None]:
    """RoPE base and type, from either the classic keys (`rope_theta`, `rope_scaling`) or the
    `rope_parameters` dict of newer transformers versions."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        return params.get("rope_theta", hf.get("rope_theta", 1_000_000.0)), params.get("rope_type")
    scaling = hf.get("rope_scaling")
    rope_type = None
    if isinstance(scaling, dict):
        rope_type = scaling.get("rope_type", scaling.get("type"))
    return hf.get("rope_theta", 1_000_000.0), rope_type


# Tiny shapes for CPU tests: a few hundred tokens run in well under a second. Both have a GQA
# group > 1; "tiny" ties its embeddings, "tiny-untied" has its own LM head, three layers and a
# larger RoPE base.
BUILTIN_ENGINE_CONFIGS: dict[str, EngineModelConfig] = {
    "tiny": EngineModelConfig(
        vocab_size=256,
        hidden_size=64,
        num_layers=2,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        rope_theta=10_000.0,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        name="tiny",
    ),
    "tiny-untied": EngineModelConfig(
        vocab_size=384,
        hidden_size=96,
        num_layers=3,
        num_q_heads=6,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=160,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
        name="tiny-untied",
    ),
}


def get_engine_config(name_or_path: str | Path | dict[str, Any]) -> EngineModelConfig:
    """A built-in config by name, or one read from an HF config (dict, config.json, folder)."""
    if isinstance(name_or_path, str) and name_or_path in BUILTIN_ENGINE_CONFIGS:
        return BUILTIN_ENGINE_CONFIGS[name_or_path]
    if isinstance(name_or_path, dict) or Path(name_or_path).exists():
        return EngineModelConfig.from_hf(name_or_path)
    raise UsageError(
        f"unknown engine config {name_or_path!r}; built in: {sorted(BUILTIN_ENGINE_CONFIGS)}, "
        "or give a config.json path"
    )
