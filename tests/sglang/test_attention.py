"""PenelopeTritonAttnBackend on CPU (Triton interpreter): a phantom batch built by the hooks on
SGLang's real pools goes through SGLang's K/V store and Penelope's ragged kernel, and the real
request's attention over its holes uses the K/V its phantom computed in the same layer."""
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang_attention_env import DIM, HEADS, KV_HEADS, backend, layer, phantom_batch
from sglang_env import Serving, sglang_config

from penelope.integration.sglang import hooks
from penelope.integration.sglang.attention import create_penelope_triton_backend


@pytest.fixture(autouse=True)
def _config():
    with sglang_config():
        yield








def test_phantom_batch_attends_by_absolute_position_through_the_pool():
    serving, batch = phantom_batch()
    assert [hooks.is_phantom(r) for r in batch.reqs] == [True, False, False]
    pool = MHATokenToKVPool(size=64 * 40, page_size=1, dtype=torch.float32, head_num=KV_HEADS, head_dim=DIM,
                            layer_num=1, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    gen = torch.Generator().manual_seed(0)
    # Cached KV of the whole pool (the tree's blocks), then this batch's q/k/v.
    pool.k_buffer[0].copy_(torch.randn(pool.k_buffer[0].shape, generator=gen))
    pool.v_buffer[0].copy_(torch.randn(pool.v_buffer[0].shape, generator=gen))
    tokens = sum(batch.extend_lens)
    q = torch.randn(tokens, HEADS * DIM, generator=gen)
    k = torch.randn(tokens, KV_HEADS, DIM, generator=gen)
    v = torch.randn(tokens, KV_HEADS, DIM, generator=gen)
    segments = hooks.extend_segments(batch.reqs, batch.prefix_lens, batch.extend_lens, "cpu")
    forward_batch = SimpleNamespace(out_cache_loc=batch.out_cache_loc, out_cache_loc_is_physical=False,
                                    positions=None, mha_one_shot=False, **{hooks.SEGMENTS: segments})
    cached_k, cached_v = pool.k_buffer[0].clone(), pool.v_buffer[0].clone()

    out = backend(serving, pool).forward_extend(q, k, v, layer(), forward_batch)

    # The batch's K/V went into its slots through SGLang's store.
    assert torch.equal(pool.k_buffer[0][batch.out_cache_loc], k)
    # Reference, built without req_to_token: for the real request, positions [0,128) and
    # [256,512) are cached, [128,256) come from the phantom's rows of k/v, the rest from its own.
    phantom, real = batch.reqs[0], batch.reqs[1]
    table = serving.req_pool.req_to_token
    real_row = table[real.kv.req_pool_idx].long()
    n = real.extend_end
    full_k, full_v = cached_k[real_row[:n]].clone(), cached_v[real_row[:n]].clone()
    full_k[128:256], full_v[128:256] = k[0:128], v[0:128]
    full_k[512:n], full_v[512:n] = k[128:128 + n - 512], v[128:128 + n - 512]
    assert not torch.equal(cached_k[real_row[128:256]], k[0:128])  # the hole was not in the pool before
    queries = q[128:128 + n - 512].view(-1, HEADS, DIM)
    expected = causal_attention(queries, full_k, full_v, first_position=512)
    got = out[128:128 + n - 512].view(-1, HEADS, DIM)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # The phantom itself attends over the cached prefix [0,128) and its own hole tokens.
    prefix_k = torch.cat([cached_k[table[phantom.kv.req_pool_idx, :128].long()], k[0:128]])
    prefix_v = torch.cat([cached_v[table[phantom.kv.req_pool_idx, :128].long()], v[0:128]])
    expected = causal_attention(q[0:128].view(-1, HEADS, DIM), prefix_k, prefix_v, first_position=128)
    torch.testing.assert_close(out[0:128].view(-1, HEADS, DIM), expected, rtol=1e-5, atol=1e-5)


def causal_attention(q, k, v, first_position):
    """q [m, Hq, D] at positions first_position.., k/v [n, Hkv, D] for positions 0..n-1 (fp32)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", q, k) * DIM**-0.5
    positions = torch.arange(first_position, first_position + q.shape[0])
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > positions[:, None], float("-inf"))
    return torch.einsum("hmn,nhd->mhd", scores.softmax(dim=-1), v)


@pytest.mark.parametrize("case", ["no phantoms", "sliding window", "logit cap", "sinks"])
def test_everything_else_goes_to_sglangs_path(case, monkeypatch):
    calls = []
    monkeypatch.setattr(TritonAttnBackend, "forward_extend", lambda self, *a, **k: calls.append(a) or "sglang")
    serving = Serving(size=256, page_size=1)
    pool = MHATokenToKVPool(size=256, page_size=1, dtype=torch.float32, head_num=KV_HEADS, head_dim=DIM,
                            layer_num=1, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    segments = torch.zeros((1, 4), dtype=torch.int32)
    forward_batch = SimpleNamespace(mha_one_shot=False, **({} if case == "no phantoms" else {hooks.SEGMENTS: segments}))
    attn_layer = layer(sliding_window_size=128 if case == "sliding window" else -1,
                       logit_cap=30.0 if case == "logit cap" else 0.0)
    q, kv = torch.zeros(1, HEADS * DIM), torch.zeros(1, KV_HEADS, DIM)
    sinks = torch.zeros(HEADS) if case == "sinks" else None
    assert backend(serving, pool).forward_extend(q, kv, kv, attn_layer, forward_batch, sinks=sinks) == "sglang"
    assert len(calls) == 1


def test_factory_refuses_encoder_decoder_models():
    runner = SimpleNamespace(model_config=SimpleNamespace(is_encoder_decoder=True))
    with pytest.raises(ValueError, match="Cross attention"):
        create_penelope_triton_backend(runner)


def test_phantom_batches_keep_the_ragged_kernel_under_a_prefill_cuda_graph(monkeypatch):
    """Prefill CUDA graphs (on by default on CUDA) pad the batch to a bucket, rebuild its
    ForwardBatch field by field (``PrefillCudaGraphRunner.load_batch``) and run attention eagerly
    against the rebuilt one, real rows only (``RadixAttention._eager_attention``). The hook around
    load_batch carries the segments over: SGLang's eager-attention path, run here with a padded
    batch, goes through the ragged kernel (SGLang's Triton kernel is made to fail) and gives the
    rows the unpadded batch gives."""
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.model_executor.runner_utils.forward_batch import set_forward_batch

    serving, batch = phantom_batch()
    pool = MHATokenToKVPool(size=64 * 40, page_size=1, dtype=torch.float32, head_num=KV_HEADS, head_dim=DIM,
                            layer_num=1, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    gen = torch.Generator().manual_seed(1)
    pool.k_buffer[0].copy_(torch.randn(pool.k_buffer[0].shape, generator=gen))
    pool.v_buffer[0].copy_(torch.randn(pool.v_buffer[0].shape, generator=gen))
    tokens, padding = sum(batch.extend_lens), 37
    q = torch.randn(tokens + padding, HEADS * DIM, generator=gen)
    k = torch.randn(tokens + padding, KV_HEADS, DIM, generator=gen)
    v = torch.randn(tokens + padding, KV_HEADS, DIM, generator=gen)
    segments = hooks.extend_segments(batch.reqs, batch.prefix_lens, batch.extend_lens, "cpu")
    served = SimpleNamespace(out_cache_loc=batch.out_cache_loc, out_cache_loc_is_physical=False, positions=None,
                             mha_one_shot=False, **{hooks.SEGMENTS: segments})
    cached = pool.k_buffer[0].clone(), pool.v_buffer[0].clone()
    want = backend(serving, pool).forward_extend(q[:tokens], k[:tokens], v[:tokens], layer(), served)
    pool.k_buffer[0].copy_(cached[0])
    pool.v_buffer[0].copy_(cached[1])

    def load_batch(runner, forward_batch):
        # What load_batch returns: a new batch of the padded bucket, built from named fields only.
        padded = torch.cat([forward_batch.out_cache_loc, torch.zeros(padding, dtype=torch.int64)])
        static = SimpleNamespace(forward_mode=ForwardMode.EXTEND, global_num_token_non_padded_cpu=tokens,
                                 mha_return_lse=False, out_cache_loc=padded, out_cache_loc_is_physical=False,
                                 positions=None, _attn_output=None, mha_one_shot=False)
        return static, None

    static, _ = hooks._keep_segments(load_batch, None, served)
    monkeypatch.setattr(TritonAttnBackend, "forward_extend", lambda *a, **kw: pytest.fail("SGLang's kernel ran"))
    attention = RadixAttention(HEADS, DIM, DIM**-0.5, KV_HEADS, layer_id=0)
    output = torch.full((tokens + padding, HEADS * DIM), float("nan"))
    before = hooks.COUNTERS["ragged_batches"]
    with set_forward_batch(static), forward_context(ForwardContext(attn_backend=backend(serving, pool))):
        attention._eager_attention(q, k, v, output)
    assert hooks.COUNTERS["ragged_batches"] == before + 1
    assert torch.equal(output[:tokens], want)
    assert torch.equal(pool.k_buffer[0][batch.out_cache_loc], k[:tokens])
