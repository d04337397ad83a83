"""Reference engine decoder: config, weights and loader, batches, and the forward pass.

The decoder is checked against transformers' `Qwen3ForCausalLM` on the same random weights, and
its ragged batches (cached prefix + new tokens, phantom hole + new tokens, several requests) are
checked against one full prefill. Attention here is a private fp32 per-query reference, so these
tests do not depend on the kernel package; it is batch-invariant (each query's result depends only
on its own keys), which the deterministic-mode tests rely on. The engine's named backends
("naive", "triton") are checked against it at the end.
"""
import json
import os

# The "triton" backend runs the kernel under the interpreter on CPU; it must be chosen before
# the kernel package is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from penelope.engine.attention import (  # noqa: E402
    ALIGNED_TILE,
    AttentionBackend,
    aligned_ragged_attention,
    get_attention_backend,
    torch_store_kv,
)
from penelope.engine.config import BUILTIN_ENGINE_CONFIGS, EngineModelConfig, get_engine_config  # noqa: E402
from penelope.engine.kvpool import KVPool  # noqa: E402
from penelope.engine.model import EngineBatch, Qwen3Decoder, apply_rope, rope_inv_freq  # noqa: E402
from penelope.engine.weights import (  # noqa: E402
    expected_shapes,
    load_checkpoint,
    random_weights,
    save_checkpoint,
    to_state_dict,
)
from penelope.errors import UsageError  # noqa: E402

TINY = BUILTIN_ENGINE_CONFIGS["tiny"]
UNTIED = BUILTIN_ENGINE_CONFIGS["tiny-untied"]
NUM_TOKENS = 300

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


def reference_attend(q, k_buffer, v_buffer, req_to_token, segments, sm_scale=None):
    """fp32 ragged attention, one query at a time: the query at position p of request r attends
    to the keys at `req_to_token[r, 0..p]`. Rows of no segment stay NaN."""
    group = q.shape[1] // k_buffer.shape[1]
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    out = torch.full_like(q, float("nan"))
    for req_row, q_start, pos_start, length in segments.tolist():
        for i in range(length):
            slots = req_to_token[req_row, : pos_start + i + 1].long()
            keys = k_buffer[slots].float().repeat_interleave(group, dim=1)
            values = v_buffer[slots].float().repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,khd->hk", q[q_start + i].float(), keys) * scale
            out[q_start + i] = torch.einsum("hk,khd->hd", scores.softmax(-1), values).to(q.dtype)
    return out


REFERENCE = AttentionBackend("reference", torch_store_kv, reference_attend)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def random_tokens(config, n, seed=0):
    return torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def nan_pool(config, capacity=1024):
    """A pool whose every row is NaN, so reading a row nobody wrote poisons the output."""
    pool = KVPool(config, capacity)
    pool.fill_(float("nan"))
    return pool


def full_prefill(model, tokens, slots=None):
    """Logits `[T, V]` of one request prefilled from position 0, and the pool it wrote."""
    pool = nan_pool(model.config)
    slots = torch.arange(len(tokens)) if slots is None else slots
    return model(EngineBatch.single_segment(tokens, slots), pool), pool


def hf_model(config, weights):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(Qwen3Config(**config.to_hf(), attn_implementation="eager")).eval()
    missing, unexpected = model.load_state_dict(to_state_dict(config, weights), strict=False)
    assert not unexpected
    assert missing == (["lm_head.weight"] if config.tie_word_embeddings else [])
    return model


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens[None]).logits[0]


# ---------------------------------------------------------------------------------------------
# Config


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


# ---------------------------------------------------------------------------------------------
# Weights and the checkpoint loader


def test_random_weights_are_seeded_and_tied_head_is_the_embedding():
    a, b, c = random_weights(TINY, seed=3), random_weights(TINY, seed=3), random_weights(TINY, seed=4)
    pairs = zip(to_state_dict(TINY, a).values(), to_state_dict(TINY, b).values(), strict=True)
    assert all(torch.equal(x, y) for x, y in pairs)
    assert not torch.equal(a.layers[0].q_proj, c.layers[0].q_proj)
    assert a.lm_head is a.embed
    untied = random_weights(UNTIED, seed=3)
    assert untied.lm_head is not untied.embed and untied.lm_head.shape == (UNTIED.vocab_size, UNTIED.hidden_size)
    assert set(to_state_dict(UNTIED, untied)) == set(expected_shapes(UNTIED))


@pytest.mark.parametrize("config", [TINY, UNTIED], ids=lambda c: c.name)
def test_matches_transformers_qwen3_loaded_from_its_checkpoint(config, tmp_path):
    """HF saves the checkpoint (its own names, its own handling of tied embeddings); our loader
    reads it; our decoder's full prefill matches HF's logits within 1e-4 in fp32."""
    weights = random_weights(config, seed=1)
    reference = hf_model(config, weights)
    reference.save_pretrained(tmp_path)
    loaded_config, loaded = load_checkpoint(tmp_path)
    assert loaded_config.as_dict() | {"name": config.name} == config.as_dict()
    for name, tensor in to_state_dict(config, weights).items():
        assert torch.equal(to_state_dict(loaded_config, loaded)[name], tensor), name

    tokens = random_tokens(config, NUM_TOKENS)
    expected = hf_logits(reference, tokens)
    ours, _ = full_prefill(Qwen3Decoder(loaded_config, loaded, attention=REFERENCE), tokens)
    # Logits are of order one or more, so 1e-4 is a tight bound, not a vacuous one.
    assert expected.std() > 0.5
    assert (ours - expected).abs().max() < 1e-4


def test_matches_transformers_with_attention_bias():
    config = EngineModelConfig(**{**UNTIED.as_dict(), "attention_bias": True, "name": "bias"})
    weights = random_weights(config, seed=2)
    assert weights.layers[0].q_bias is not None and weights.layers[0].q_bias.abs().max() > 0
    tokens = random_tokens(config, 64)
    ours, _ = full_prefill(Qwen3Decoder(config, weights, attention=REFERENCE), tokens)
    assert (ours - hf_logits(hf_model(config, weights), tokens)).abs().max() < 1e-4


def test_saved_checkpoint_loads_in_transformers_and_round_trips(tmp_path):
    from transformers import Qwen3ForCausalLM

    weights = random_weights(TINY, seed=5)
    save_checkpoint(tmp_path, TINY, weights)
    _, loaded = load_checkpoint(tmp_path)
    assert loaded.lm_head is loaded.embed
    assert all(
        torch.equal(x, y)
        for x, y in zip(to_state_dict(TINY, weights).values(), to_state_dict(TINY, loaded).values(), strict=True)
    )
    reference = Qwen3ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    tokens = random_tokens(TINY, 48)
    ours, _ = full_prefill(Qwen3Decoder(TINY, loaded, attention=REFERENCE), tokens)
    assert (ours - hf_logits(reference, tokens)).abs().max() < 1e-4


def test_loader_splits_across_shards_and_converts_dtype(tmp_path):
    state = {k: v.contiguous() for k, v in to_state_dict(UNTIED, random_weights(UNTIED)).items()}
    names = sorted(state)
    save_file({n: state[n] for n in names[::2]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({n: state[n] for n in names[1::2]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(UNTIED.to_hf()))
    _, loaded = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert loaded.dtype == torch.bfloat16 and loaded.lm_head.dtype == torch.bfloat16
    assert torch.equal(loaded.layers[2].down_proj, state["model.layers.2.mlp.down_proj.weight"].bfloat16())


def _break_checkpoint(folder, how):
    file = folder / "model.safetensors"
    state = load_file(str(file))
    if how == "missing tensor":
        del state["model.layers.1.self_attn.k_norm.weight"]
    elif how == "wrong shape":
        state["model.norm.weight"] = torch.ones(3)
    elif how == "unexpected tensor":
        state["model.layers.0.mlp.extra.weight"] = torch.ones(3)
    elif how == "duplicate across shards":
        save_file({"model.norm.weight": state["model.norm.weight"]}, str(folder / "extra.safetensors"))
    save_file(state, str(file))


@pytest.mark.parametrize(
    "how, message",
    [
        ("no folder", "does not exist"),
        ("no config", "config.json"),
        ("no safetensors", "safetensors"),
        ("missing tensor", "k_norm"),
        ("wrong shape", "shape"),
        ("unexpected tensor", "extra"),
        ("duplicate across shards", "more than one file"),
        ("bad json", "JSON"),
    ],
)
def test_loader_errors(tmp_path, how, message):
    folder = save_checkpoint(tmp_path / "ckpt", UNTIED, random_weights(UNTIED))
    if how == "no folder":
        folder = tmp_path / "missing"
    elif how == "no config":
        (folder / "config.json").unlink()
    elif how == "no safetensors":
        (folder / "model.safetensors").unlink()
    elif how == "bad json":
        (folder / "config.json").write_text("{not json")
    else:
        _break_checkpoint(folder, how)
    with pytest.raises(UsageError, match=message):
        load_checkpoint(folder)


# ---------------------------------------------------------------------------------------------
# RoPE


def test_rope_rotates_pairs_by_absolute_position_with_config_theta():
    head_dim, theta = 16, 10_000.0
    inv_freq = rope_inv_freq(head_dim, theta)
    assert torch.allclose(inv_freq, torch.tensor([theta ** (-2 * i / head_dim) for i in range(head_dim // 2)]))
    positions = torch.tensor([0, 1, 7, 4095, 40_000])
    x = torch.randn(len(positions), 2, head_dim, dtype=torch.float64).float()
    out = apply_rope(x, positions, inv_freq)
    half = head_dim // 2
    for t, p in enumerate(positions.tolist()):
        for i in range(half):
            # Angle computed the way the model does (fp32 product), rotation done in float64.
            angle = torch.tensor(p, dtype=torch.float32) * inv_freq[i]
            c, s = torch.cos(angle.double()), torch.sin(angle.double())
            a, b = x[t, :, i].double(), x[t, :, i + half].double()
            assert torch.allclose(out[t, :, i].double(), a * c - b * s, atol=1e-5)
            assert torch.allclose(out[t, :, i + half].double(), b * c + a * s, atol=1e-5)
    assert torch.equal(out[0], x[0])


def test_model_uses_config_theta_and_absolute_positions():
    model = Qwen3Decoder(UNTIED, random_weights(UNTIED), attention=REFERENCE)
    assert torch.equal(model.inv_freq, rope_inv_freq(UNTIED.head_dim, 1e6))
    tokens = random_tokens(UNTIED, 40)
    expected, pool = full_prefill(model, tokens)
    # The last 8 tokens alone in the batch (row 0..7) at positions 32..39: correct only if RoPE
    # and the causal limit use the absolute positions, not the rows.
    batch = EngineBatch.single_segment(tokens[32:], torch.arange(40), pos_start=32)
    assert torch.allclose(model(batch, pool), expected[32:], atol=1e-5, rtol=0)
    # The same tokens given the wrong positions (shifted) give different logits.
    pool2 = nan_pool(UNTIED)
    model(EngineBatch.single_segment(tokens[:32], torch.arange(32)), pool2)
    shifted = EngineBatch.build(tokens[32:], torch.arange(48, dtype=torch.int32)[None], [[0, 0, 40, 8]])
    for layer in range(UNTIED.num_layers):
        pool2.k_buffers[layer][32:40] = pool.k_buffers[layer][32:40]
        pool2.v_buffers[layer][32:40] = pool.v_buffers[layer][32:40]
    assert (model(shifted, pool2) - expected[32:]).abs().max() > 1e-2


# ---------------------------------------------------------------------------------------------
# Ragged batches against one full prefill


@pytest.mark.parametrize("deterministic", [False, True])
def test_cached_prefix_plus_new_tokens_equals_full_prefill(deterministic):
    model = Qwen3Decoder(UNTIED, random_weights(UNTIED, seed=7), attention=REFERENCE, deterministic=deterministic)
    tokens = random_tokens(UNTIED, NUM_TOKENS, seed=1)
    expected, _ = full_prefill(model, tokens)
    # Slots are scattered (not equal to positions) to catch slot/position mix-ups.
    slots = torch.randperm(1024, generator=torch.Generator().manual_seed(0))[:NUM_TOKENS]
    pool = nan_pool(UNTIED)
    split = 173
    first = model(EngineBatch.single_segment(tokens[:split], slots[:split]), pool)
    second = model(EngineBatch.single_segment(tokens[split:], slots, pos_start=split), pool)
    got = torch.cat((first, second))
    if deterministic:
        assert torch.equal(got, expected)
    else:
        assert (got - expected).abs().max() < 1e-5


def _phantom_setup(model, tokens, hole, cached_end):
    """Pool state after evicting `hole` from a cached prefix of `cached_end` tokens.

    Positions outside the hole keep their slots (KV from a full prefill); the hole's old slots are
    poisoned and the hole gets fresh slots, still NaN: only the phantom can fill them."""
    pool = nan_pool(model.config)
    model(EngineBatch.single_segment(tokens[:cached_end], torch.arange(cached_end)), pool)
    pool.fill_(float("nan"), torch.arange(*hole))
    slots = torch.arange(len(tokens), dtype=torch.int32)
    slots[hole[0] : hole[1]] = torch.arange(600, 600 + hole[1] - hole[0], dtype=torch.int32)
    return pool, slots


@pytest.mark.parametrize("deterministic", [False, True])
def test_phantom_hole_and_new_tokens_in_one_batch_equal_full_prefill(deterministic):
    model = Qwen3Decoder(UNTIED, random_weights(UNTIED, seed=8), attention=REFERENCE, deterministic=deterministic)
    tokens = random_tokens(UNTIED, NUM_TOKENS, seed=2)
    expected, _ = full_prefill(model, tokens)
    # Few new tokens: their rows are computed in much smaller matmuls than in the full prefill,
    # which only deterministic mode makes bitwise equal.
    hole, cached_end = (64, 128), NUM_TOKENS - 5
    pool, slots = _phantom_setup(model, tokens, hole, cached_end)
    new = NUM_TOKENS - cached_end
    # The real request's new tokens first, the phantom's hole after them: order must not matter.
    batch_tokens = torch.cat((tokens[cached_end:], tokens[hole[0] : hole[1]]))
    segments = [[0, 0, cached_end, new], [0, new, hole[0], hole[1] - hole[0]]]
    logits = model(EngineBatch.build(batch_tokens, slots[None], segments), pool)
    real, phantom = logits[:new], logits[new:]
    if deterministic:
        assert torch.equal(real, expected[cached_end:])
        assert torch.equal(phantom, expected[hole[0] : hole[1]])
    else:
        assert (real - expected[cached_end:]).abs().max() < 1e-5
        assert (phantom - expected[hole[0] : hole[1]]).abs().max() < 1e-5


def test_real_request_reads_hole_kv_written_in_the_same_layer():
    """Skipping the phantom, or corrupting the hole's K/V between store and attention in one
    layer, changes the real request's output."""
    weights = random_weights(UNTIED, seed=8)
    tokens = random_tokens(UNTIED, NUM_TOKENS, seed=2)
    hole, cached_end = (64, 128), 200
    new = NUM_TOKENS - cached_end
    segments = [[0, 0, cached_end, new], [0, new, hole[0], hole[1] - hole[0]]]
    batch_tokens = torch.cat((tokens[cached_end:], tokens[hole[0] : hole[1]]))
    model = Qwen3Decoder(UNTIED, weights, attention=REFERENCE)
    expected, _ = full_prefill(model, tokens)

    pool, slots = _phantom_setup(model, tokens, hole, cached_end)
    pool.fill_(0.0, slots[hole[0] : hole[1]].long())
    skipped = model(EngineBatch.single_segment(tokens[cached_end:], slots, pos_start=cached_end), pool)
    assert (skipped - expected[cached_end:]).abs().max() > 1e-2

    calls = []

    def corrupting_store(k_buffer, v_buffer, batch_slots, k, v):
        torch_store_kv(k_buffer, v_buffer, batch_slots, k, v)
        calls.append(1)
        if len(calls) == 2:
            v_buffer[slots[hole[0] : hole[1]].long()] += 1.0

    backend = AttentionBackend("corrupt", corrupting_store, reference_attend)
    corrupting = Qwen3Decoder(UNTIED, weights, attention=backend)
    pool, slots = _phantom_setup(model, tokens, hole, cached_end)
    corrupted = corrupting(EngineBatch.build(batch_tokens, slots[None], segments), pool)[:new]
    assert len(calls) == UNTIED.num_layers
    assert torch.isfinite(corrupted).all()
    assert (corrupted - expected[cached_end:]).abs().max() > 1e-3


@pytest.mark.parametrize(
    "attention, row_chunk",
    [(REFERENCE, 1), (REFERENCE, 16), ("naive", 1), ("triton", 1)],
    ids=["reference-rows1", "reference-rows16", "naive-rows1", "triton-rows1"],
)
def test_deterministic_segment_is_bitwise_independent_of_the_batch(attention, row_chunk):
    """A request's last 3 tokens computed alone after its cached prefix, and the same 3 tokens
    between two segments of another request (so they sit at odd rows of a 69-row batch), give
    logits and K/V bitwise equal to one full prefill. Without deterministic mode a 3-row matmul
    rounds differently from a 150-row one on CPU, so this test would fail."""
    model = Qwen3Decoder(
        UNTIED, random_weights(UNTIED, seed=9), attention=attention, deterministic=True, row_chunk=row_chunk
    )
    tokens = random_tokens(UNTIED, 150, seed=3)
    expected, expected_pool = full_prefill(model, tokens)
    cached = 147

    pool = nan_pool(UNTIED)
    model(EngineBatch.single_segment(tokens[:cached], torch.arange(cached)), pool)
    alone = model(EngineBatch.single_segment(tokens[cached:], torch.arange(150), pos_start=cached), pool)
    assert torch.equal(alone, expected[cached:])

    pool = nan_pool(UNTIED)
    model(EngineBatch.single_segment(tokens[:cached], torch.arange(cached)), pool)
    other = random_tokens(UNTIED, 37 + 29, seed=4)
    table = torch.full((2, 150), -1, dtype=torch.int32)
    table[0, :66] = torch.arange(400, 466, dtype=torch.int32)
    table[1] = torch.arange(150, dtype=torch.int32)
    segments = [[0, 0, 0, 37], [1, 37, cached, 3], [0, 40, 37, 29]]
    batch = EngineBatch.build(torch.cat((other[:37], tokens[cached:], other[37:])), table, segments)
    assert torch.equal(model(batch, pool)[37:40], expected[cached:])
    for layer in range(UNTIED.num_layers):
        assert torch.equal(pool.k_buffers[layer][:150], expected_pool.k_buffers[layer][:150])
        assert torch.equal(pool.v_buffers[layer][:150], expected_pool.v_buffers[layer][:150])


def test_deterministic_mode_computes_the_same_function():
    weights = random_weights(TINY, seed=10)
    tokens = random_tokens(TINY, 100)
    fast, _ = full_prefill(Qwen3Decoder(TINY, weights, attention=REFERENCE), tokens)
    chunked = Qwen3Decoder(TINY, weights, attention=REFERENCE, deterministic=True, row_chunk=7)
    slow, _ = full_prefill(chunked, tokens)
    # Tied logits reach ~10 here; 1e-4 is a few fp32 ulps of accumulated rounding, as for HF.
    assert (fast - slow).abs().max() < 1e-4


def test_logits_rows_and_hidden_states():
    # Deterministic, so that logits of 2 rows equal bitwise those of all 20 (a plain matmul of 2
    # rows may round differently from one of 20 on CPU).
    model = Qwen3Decoder(TINY, random_weights(TINY), attention=REFERENCE, deterministic=True)
    tokens = random_tokens(TINY, 20)
    everything, _ = full_prefill(model, tokens)
    batch = EngineBatch.single_segment(tokens, torch.arange(20))
    some = model(batch, nan_pool(TINY), logits_rows=[19, 3])
    assert torch.equal(some, everything[[19, 3]])
    hidden = model.hidden_states(batch, nan_pool(TINY))
    assert hidden.shape == (20, TINY.hidden_size)
    assert torch.equal(model.logits(hidden), everything)


# ---------------------------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize(
    "segments, message",
    [
        ([[0, 0, 0, 5]], "belongs to no segment"),
        ([[0, 0, 0, 6], [0, 5, 6, 5]], "another segment"),
        ([[0, 0, 0, 5], [0, 5, 3, 5]], "positions already"),
        ([[0, 0, 0, 10], [2, 10, 0, 0]], "request row"),
        ([[0, 0, 15, 10]], "width"),
        ([[0, 0, 0, 11]], "beyond the batch"),
        ([[0, 0, -1, 10]], "negative"),
    ],
)
def test_batch_validation(segments, message):
    table = torch.arange(20, dtype=torch.int32)[None]
    with pytest.raises(UsageError, match=message):
        EngineBatch.build(torch.zeros(10, dtype=torch.int64), table, segments)


def test_batch_rejects_shared_or_missing_slots_and_bad_table():
    table = torch.arange(20, dtype=torch.int32).repeat(2, 1)
    with pytest.raises(UsageError, match="same pool slot"):
        EngineBatch.build(torch.zeros(10), table, [[0, 0, 0, 5], [1, 5, 0, 5]])
    table[0, 3] = -1
    with pytest.raises(UsageError, match="negative slot"):
        EngineBatch.build(torch.zeros(5), table, [[0, 0, 0, 5]])
    with pytest.raises(UsageError, match="int32"):
        EngineBatch.build(torch.zeros(5), table.long(), [[0, 0, 0, 5]])
    with pytest.raises(UsageError, match="at least one"):
        EngineBatch.build(torch.zeros(0), table, [[0, 0, 0, 0]])


def test_forward_checks_pool_slots_tokens_and_cached_prefix():
    model = Qwen3Decoder(TINY, random_weights(TINY), attention=REFERENCE)
    tokens = random_tokens(TINY, 8)
    with pytest.raises(UsageError, match="outside"):
        model(EngineBatch.single_segment(tokens, torch.arange(8) + 60), KVPool(TINY, 64))
    cached_missing = torch.arange(16, dtype=torch.int32)
    cached_missing[2] = -1
    with pytest.raises(UsageError, match="missing slot"):
        model(EngineBatch.single_segment(tokens, cached_missing, pos_start=8), KVPool(TINY, 64))
    with pytest.raises(UsageError, match="token ids"):
        model(EngineBatch.single_segment(tokens + TINY.vocab_size, torch.arange(8)), KVPool(TINY, 64))
    with pytest.raises(UsageError, match="KV pool"):
        model(EngineBatch.single_segment(tokens, torch.arange(8)), KVPool(UNTIED, 64))
    with pytest.raises(UsageError, match="bfloat16"):
        model(EngineBatch.single_segment(tokens, torch.arange(8)), KVPool(TINY, 64, dtype=torch.bfloat16))


def test_pool_and_backend_selection():
    pool = KVPool(UNTIED, 100)
    assert pool.k_buffers[1].shape == (100, UNTIED.num_kv_heads, UNTIED.head_dim)
    assert pool.bytes_per_token() == 2 * UNTIED.num_layers * UNTIED.num_kv_heads * UNTIED.head_dim * 4
    for bad in (0, -5, 2.5, True):
        with pytest.raises(UsageError, match="capacity"):
            KVPool(UNTIED, bad)
    with pytest.raises(UsageError, match="naive"):
        get_attention_backend("flash")
    assert get_attention_backend("naive").name == "naive" and get_attention_backend("triton").name == "triton"
    assert get_attention_backend(REFERENCE) is REFERENCE
    with pytest.raises(UsageError, match="row_chunk"):
        Qwen3Decoder(TINY, random_weights(TINY), row_chunk=0)
    with pytest.raises(UsageError, match="do not match"):
        Qwen3Decoder(TINY, random_weights(UNTIED))


# ---------------------------------------------------------------------------------------------
# Named backends: the engine's aligned torch path and the Triton kernel (interpreted on CPU)


def _random_ragged_inputs(group, seed=0):
    """Two requests: request 0 has a hole at position 0 refilled next to new tokens crossing a
    tile boundary, and an empty segment; request 1 one segment from an odd position."""
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads, head_dim, capacity = 2, 16, 400
    k_buffer = torch.randn(capacity, num_kv_heads, head_dim, generator=gen)
    v_buffer = torch.randn(capacity, num_kv_heads, head_dim, generator=gen)
    table = torch.randperm(capacity, generator=gen)[:300].to(torch.int32).reshape(2, 150)
    segments = torch.tensor(
        [[0, 0, 0, 5], [0, 5, 60, 71], [0, 76, 140, 0], [1, 76, 33, 1], [1, 77, 97, 30]], dtype=torch.int32
    )
    q = torch.randn(107, num_kv_heads * group, head_dim, generator=gen)
    return q, k_buffer, v_buffer, table, segments


@pytest.mark.parametrize("group", [1, 3])
def test_aligned_attention_matches_references(group):
    from penelope.kernels.ragged_attention import naive_ragged_prefill_attention

    inputs = _random_ragged_inputs(group)
    ours = aligned_ragged_attention(*inputs, sm_scale=0.3)
    assert torch.isfinite(ours).all()
    assert (ours - reference_attend(*inputs, sm_scale=0.3)).abs().max() < 1e-5
    assert (ours - naive_ragged_prefill_attention(*inputs, sm_scale=0.3)).abs().max() < 1e-5
    assert ALIGNED_TILE < 71  # the long segment crosses a tile boundary


@pytest.mark.parametrize("attention", ["naive", "triton"])
def test_named_backends_run_phantom_batches_bitwise(attention):
    """With a named backend: full prefill agrees with the fp32 reference; in deterministic mode a
    phantom (hole 40..80) + 5 new tokens batch reproduces the full prefill bitwise."""
    weights = random_weights(UNTIED, seed=11)
    tokens = random_tokens(UNTIED, 150, seed=5)
    reference, _ = full_prefill(Qwen3Decoder(UNTIED, weights, attention=REFERENCE), tokens)
    model = Qwen3Decoder(UNTIED, weights, attention=attention, deterministic=True)
    expected, _ = full_prefill(model, tokens)
    assert (expected - reference).abs().max() < 1e-4

    hole, cached_end = (40, 80), 145
    pool, slots = _phantom_setup(model, tokens, hole, cached_end)
    batch_tokens = torch.cat((tokens[hole[0] : hole[1]], tokens[cached_end:]))
    segments = [[0, 0, hole[0], hole[1] - hole[0]], [0, hole[1] - hole[0], cached_end, 150 - cached_end]]
    logits = model(EngineBatch.build(batch_tokens, slots[None], segments), pool)
    assert torch.equal(logits[: hole[1] - hole[0]], expected[hole[0] : hole[1]])
    assert torch.equal(logits[hole[1] - hole[0] :], expected[cached_end:])
