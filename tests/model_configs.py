"""Config folders of models for SGLang's start-up (a config.json and nothing else): what the
launching process reads before any weights."""
from __future__ import annotations

import json

# Tiny configs of models Penelope's cache refuses: name -> (config.json, the flags SGLang needs to
# resolve it on CPU, what the refusal names).
UNSERVABLE_MODELS = {
    "swa": (dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=1000, hidden_size=64,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=128,
                 layer_types=["sliding_attention", "full_attention"], torch_dtype="bfloat16"),
            ["--attention-backend", "triton"], "a hybrid sliding-window model"),
    "mamba": (dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=1000, hidden_size=64,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   intermediate_size=64, full_attention_interval=4, linear_num_value_heads=4,
                   linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                   linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=32, torch_dtype="bfloat16"),
              ["--attention-backend", "torch_native", "--mamba-radix-cache-strategy", "no_buffer",
               "--disable-overlap-schedule"], "a model with mamba state"),
    "dsa": (dict(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", vocab_size=1000, hidden_size=64,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
                 moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16,
                 q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, index_topk=64,
                 index_head_dim=16, index_n_heads=2, torch_dtype="bfloat16"),
            None, "a DSA model"),  # SGLang's resolution of a DSA model needs CUDA
}


# Qwen3-8B's config.json (as on the hub).
QWEN3_8B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", torch_dtype="bfloat16", head_dim=128,
                vocab_size=151936, rope_theta=1000000.0, hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=40960)


def config_folder(path, config: dict) -> str:
    """A checkpoint folder holding only its config.json: no weights, no tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)
