"""Reference engine decoder (`penelope.engine.decoder`): the forward pass against transformers'
`Qwen3ForCausalLM` on the same random weights, RoPE, ragged batches, and batch validation.

Ragged batches (cached prefix + new tokens, phantom hole + new tokens, several requests) are
checked against one full prefill. Attention here is a private fp32 per-query reference
(`engine_helpers.reference_attend`), so these tests do not depend on the kernel package; it is
batch-invariant (each query's result depends only on its own keys), which the deterministic-mode
tests rely on. The named backends ("naive", "triton") are checked against it in
test_engine_attention.py, and in the batch-invariance test here.
"""
import os

# The "triton" backend runs the kernel under the interpreter on CPU; it must be chosen before
# the kernel package is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from engine_helpers import (  # noqa: E402
    NUM_TOKENS,
    REFERENCE,
    TINY,
    UNTIED,
    full_prefill,
    hf_logits,
    hf_model,
    nan_pool,
    phantom_setup,
    random_tokens,
    reference_attend,
)

from penelope.engine.attention import AttentionBackend, torch_store_kv  # noqa: E402
from penelope.engine.decoder import EngineBatch, Qwen3Decoder, apply_rope, rope_inv_freq  # noqa: E402
from penelope.engine.decoder_config import EngineModelConfig  # noqa: E402
from penelope.engine.kvpool import KVPool  # noqa: E402
from penelope.engine.weights import load_checkpoint, random_weights, to_state_dict  # noqa: E402
from penelope.errors import UsageError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


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


@pytest.mark.parametrize("deterministic", [False, True])
def test_phantom_hole_and_new_tokens_in_one_batch_equal_full_prefill(deterministic):
    model = Qwen3Decoder(UNTIED, random_weights(UNTIED, seed=8), attention=REFERENCE, deterministic=deterministic)
    tokens = random_tokens(UNTIED, NUM_TOKENS, seed=2)
    expected, _ = full_prefill(model, tokens)
    # Few new tokens: their rows are computed in much smaller matmuls than in the full prefill,
    # which only deterministic mode makes bitwise equal.
    hole, cached_end = (64, 128), NUM_TOKENS - 5
    pool, slots = phantom_setup(model, tokens, hole, cached_end)
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

    pool, slots = phantom_setup(model, tokens, hole, cached_end)
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
    pool, slots = phantom_setup(model, tokens, hole, cached_end)
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
