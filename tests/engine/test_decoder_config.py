"""Reference engine decoder configuration (`penelope.engine.decoder_config`): the built-in tiny
configs, reading a Hugging Face Qwen3 config (dict, file or folder), and rejecting what the
engine does not implement."""
import json

import pytest
from engine_helpers import TINY, UNTIED

from penelope.engine.decoder_config import BUILTIN_ENGINE_CONFIGS, EngineModelConfig, get_engine_config
from penelope.errors import UsageError

# Qwen3-8B's config.json (the fields the engine reads).
QWEN3_8B_HF = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "hidden_act": "silu",
    "rope_theta": 1000000,
    "rope_scaling": None,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "max_position_embeddings": 40960,
    "use_sliding_window": False,
    "sliding_window": None,
}


def test_builtin_configs_are_tiny_gqa_shapes():
    for config in BUILTIN_ENGINE_CONFIGS.values():
        assert config.group_size > 1
        assert 2 <= config.num_layers <= 4 and 64 <= config.hidden_size <= 128
        assert 16 <= config.head_dim <= 32 and 256 <= config.vocab_size <= 512
    assert TINY.tie_word_embeddings and not UNTIED.tie_word_embeddings
    assert get_engine_config("tiny") is TINY


def test_from_hf_reads_qwen3_8b():
    config = EngineModelConfig.from_hf(QWEN3_8B_HF, name="qwen3-8b")
    assert (config.hidden_size, config.num_layers, config.num_q_heads, config.num_kv_heads) == (4096, 36, 32, 8)
    assert (config.head_dim, config.intermediate_size, config.vocab_size) == (128, 12288, 151936)
    assert config.rope_theta == 1e6 and config.rms_norm_eps == 1e-6 and config.group_size == 4
    assert not config.tie_word_embeddings


def test_from_hf_reads_rope_parameters_and_defaults_head_dim():
    hf = {k: v for k, v in QWEN3_8B_HF.items() if k not in ("rope_theta", "head_dim", "num_key_value_heads")}
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    config = EngineModelConfig.from_hf(hf)
    assert config.rope_theta == 5e5 and config.head_dim == 4096 // 32 and config.num_kv_heads == 32


def test_from_hf_json_file_and_folder_round_trip(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(UNTIED.to_hf()))
    for source in (tmp_path, tmp_path / "config.json", str(tmp_path / "config.json")):
        config = EngineModelConfig.from_hf(source, name="tiny-untied")
        assert config == UNTIED
    assert get_engine_config(str(tmp_path)).hidden_size == UNTIED.hidden_size


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_key_value_heads": 5}, "multiple"),
        ({"head_dim": 127}, "even"),
        ({"num_hidden_layers": 0}, "num_layers"),
        ({"rope_theta": -1.0}, "rope_theta"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
        ({"use_sliding_window": True, "sliding_window": 4096}, "sliding"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"model_type": "llama"}, "llama"),
        ({"vocab_size": None}, "vocab_size"),
    ],
)
def test_config_rejects_unsupported_or_bad_values(change, message):
    hf = {**QWEN3_8B_HF, **change}
    hf = {k: v for k, v in hf.items() if not (k == "vocab_size" and v is None)}
    with pytest.raises(UsageError, match=message):
        EngineModelConfig.from_hf(hf)


def test_unknown_config_name_lists_builtins(tmp_path):
    with pytest.raises(UsageError, match="tiny"):
        get_engine_config("no-such-model")
    with pytest.raises(UsageError, match="config.json"):
        EngineModelConfig.from_hf(tmp_path)
