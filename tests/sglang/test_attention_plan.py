"""PenelopeTritonAttnBackend: compiles the ragged kernel when it is created, plans from host-side
segments, and reports a failed slot check of a batch when the next batch is planned."""
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang_attention_env import DIM, HEADS, KV_HEADS, backend, layer, phantom_batch
from sglang_env import sglang_config

from penelope.integration.sglang import attention, hooks
from penelope.kernels.ragged_attention import RaggedBlocks, ragged_prefill_attention


@pytest.fixture(autouse=True)
def _config():
    with sglang_config():
        yield


def make_pool(layers=2, dtype=torch.float32):
    return MHATokenToKVPool(size=64 * 40, page_size=1, dtype=dtype, head_num=KV_HEADS, head_dim=DIM,
                            layer_num=layers, device="cpu", enable_memory_saver=False, enable_alt_stream=False)


def test_warm_up_compiles_for_this_ranks_heads_and_pools(monkeypatch):
    calls = []
    blocks = RaggedBlocks(16, 64, 128, 8, 2)
    monkeypatch.setattr(attention, "warm_up_ragged_attention", lambda *args: calls.append(args) or blocks)
    serving, _ = phantom_batch()
    pool = make_pool()
    attn = backend(serving, pool)
    attn.num_head = HEADS
    assert attn.warm_up() is blocks
    ((k_buffer, table, heads),) = calls
    assert k_buffer is pool.get_key_buffer(0) and table is serving.req_pool.req_to_token and heads == HEADS
    # MLA and quantised pools are not the ragged kernel's: nothing to compile.
    attn.use_mla = True
    assert attn.warm_up() is None
    attn.use_mla = False
    attn.token_to_kv_pool = make_pool(dtype=torch.float8_e4m3fn)
    assert attn.warm_up() is None and len(calls) == 1


def test_warm_up_without_a_gpu_compiles_nothing():
    serving, _ = phantom_batch()
    attn = backend(serving, make_pool())
    attn.num_head = HEADS
    assert attn.warm_up() is None  # interpreted kernels: nothing to compile


def forward_batch_of(batch, segments):
    return SimpleNamespace(out_cache_loc=batch.out_cache_loc, out_cache_loc_is_physical=False, positions=None,
                           mha_one_shot=False, **{hooks.SEGMENTS: segments})


def test_host_segments_plan_without_a_copy_and_match_unplanned_calls():
    serving, batch = phantom_batch()
    pool = make_pool(layers=1)
    gen = torch.Generator().manual_seed(3)
    pool.k_buffer[0].copy_(torch.randn(pool.k_buffer[0].shape, generator=gen))
    pool.v_buffer[0].copy_(torch.randn(pool.v_buffer[0].shape, generator=gen))
    tokens = sum(batch.extend_lens)
    segments = hooks.extend_segments(batch.reqs, batch.prefix_lens, batch.extend_lens, "cpu")
    q = torch.randn(tokens, HEADS * DIM, generator=gen)
    k = torch.randn(tokens, KV_HEADS, DIM, generator=gen)
    v = torch.randn(tokens, KV_HEADS, DIM, generator=gen)
    attn = backend(serving, pool)
    out = attn.forward_extend(q, k, v, layer(), forward_batch_of(batch, segments))
    assert attn.ragged_plan.segments is segments
    expected = ragged_prefill_attention(q.view(-1, HEADS, DIM), pool.k_buffer[0], pool.v_buffer[0],
                                        serving.req_pool.req_to_token, segments.to(torch.int32), sm_scale=DIM**-0.5)
    assert torch.equal(out.view(-1, HEADS, DIM), expected)


# The refused batch's rows are 0 / 0 = NaN by design.
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
def test_a_bad_slot_of_one_batch_is_reported_when_the_next_is_planned(monkeypatch):
    """On a GPU the plan's slot check is asynchronous; here the plan is made with check=False to
    behave the same: the bad batch yields NaN rows, the next batch's planning raises."""
    original = attention.plan_ragged_prefill
    monkeypatch.setattr(attention, "plan_ragged_prefill", lambda *a, **kw: original(*a, **kw, check=False))
    serving, batch = phantom_batch()
    pool = make_pool(layers=1)
    tokens = sum(batch.extend_lens)
    table = serving.req_pool.req_to_token
    row = batch.reqs[1].kv.req_pool_idx
    saved = int(table[row, 3])
    table[row, 3] = pool.size + 100
    attn = backend(serving, pool)
    q, kv = torch.zeros(tokens, HEADS * DIM), torch.zeros(tokens, KV_HEADS, DIM)
    segments = hooks.extend_segments(batch.reqs, batch.prefix_lens, batch.extend_lens, "cpu")
    out = attn.forward_extend(q, kv, kv, layer(), forward_batch_of(batch, segments))
    assert out.isnan().any()
    table[row, 3] = saved
    next_segments = hooks.extend_segments(batch.reqs, batch.prefix_lens, batch.extend_lens, "cpu")
    with pytest.raises(ValueError, match=rf"req_to_token\[{row}, 3\] was outside the pool's {pool.size + 1} slots"):
        attn.forward_extend(q, kv, kv, layer(), forward_batch_of(batch, next_segments))
