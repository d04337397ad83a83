"""Reference engine attention backends (`penelope.engine.attention`): the aligned torch path against
the fp32 per-query reference and the kernel package's naive reference, and the named backends
("naive", "triton" interpreted on CPU) running phantom batches through the decoder bitwise."""
import os

# The "triton" backend runs the kernel under the interpreter on CPU; it must be chosen before
# the kernel package is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from engine_helpers import (  # noqa: E402
    REFERENCE,
    UNTIED,
    full_prefill,
    phantom_setup,
    random_tokens,
    reference_attend,
)

from penelope.engine.attention import ALIGNED_TILE, aligned_ragged_attention  # noqa: E402
from penelope.engine.decoder import EngineBatch, Qwen3Decoder  # noqa: E402
from penelope.engine.weights import random_weights  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


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
    pool, slots = phantom_setup(model, tokens, hole, cached_end)
    batch_tokens = torch.cat((tokens[hole[0] : hole[1]], tokens[cached_end:]))
    segments = [[0, 0, hole[0], hole[1] - hole[0]], [0, hole[1] - hole[0], cached_end, 150 - cached_end]]
    logits = model(EngineBatch.build(batch_tokens, slots[None], segments), pool)
    assert torch.equal(logits[: hole[1] - hole[0]], expected[hole[0] : hole[1]])
    assert torch.equal(logits[hole[1] - hole[0] :], expected[cached_end:])
