"""The prefix-aware CPU attention backend (``torch_native_prefix``) against SGLang's own
``TorchNativeAttnBackend`` on SGLang's real pools: the same outputs (fp32, 1e-5) and the same
pool after the batch's K/V store, with cached prefixes, holes refilled by phantoms in the same
batch, several requests per batch and odd lengths; the query-key pairs it computes are the causal
minimum where the parent computes every pair of the whole sequence."""
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.attention import torch_native_backend
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang_env import Serving, blocks, sglang_config

from penelope.errors import UsageError
from penelope.integration.sglang import cpu_attention, hooks
from penelope.integration.sglang.cpu_attention import PrefixTorchNativeAttnBackend, create_prefix_attention_backend

HEADS, KV_HEADS, DIM = 4, 2, 16
ATOL = 1e-5


@pytest.fixture(autouse=True)
def _config():
    with sglang_config():
        yield


def kv_pool(size: int) -> MHATokenToKVPool:
    return MHATokenToKVPool(size=size, page_size=1, dtype=torch.float32, head_num=KV_HEADS, head_dim=DIM,
                            layer_num=1, device="cpu", enable_memory_saver=False, enable_alt_stream=False)


def attention_layer(**changes) -> RadixAttention:
    layer = RadixAttention(HEADS, DIM, DIM**-0.5, KV_HEADS, layer_id=0)
    for name, value in changes.items():
        setattr(layer, name, value)
    return layer


def forward_batch(rows, prefixes, extends, out_cache_loc, mode=ForwardMode.EXTEND, **changes):
    """What both backends read of a ForwardBatch, as SGLang's ForwardBatch.init_new fills it."""
    fields = dict(forward_mode=mode, req_pool_indices=torch.tensor(rows), out_cache_loc=out_cache_loc,
                  extend_prefix_lens=torch.tensor(prefixes), extend_seq_lens=torch.tensor(extends),
                  seq_lens=torch.tensor(prefixes) + torch.tensor(extends), encoder_lens=None)
    return SimpleNamespace(**{**fields, **changes})


def run_both(req_pool, pool, batch, layer=None, seed=0):
    """One layer of `batch` through the parent and through the subclass, each on its own copy of
    `pool` (cached K/V random), with the same random q/k/v. Returns (parent output, subclass
    output, parent pool keys, subclass pool keys)."""
    layer = layer or attention_layer()
    gen = torch.Generator().manual_seed(seed)
    pool.k_buffer[0].copy_(torch.randn(pool.k_buffer[0].shape, generator=gen))
    pool.v_buffer[0].copy_(torch.randn(pool.v_buffer[0].shape, generator=gen))
    tokens = int(batch.extend_seq_lens.sum())
    q = torch.randn(tokens, HEADS * DIM, generator=gen)
    k = torch.randn(tokens, KV_HEADS, DIM, generator=gen)
    v = torch.randn(tokens, KV_HEADS, DIM, generator=gen)
    results = []
    for cls in (TorchNativeAttnBackend, PrefixTorchNativeAttnBackend):
        own = kv_pool(pool.size)
        own.k_buffer[0].copy_(pool.k_buffer[0])
        own.v_buffer[0].copy_(pool.v_buffer[0])
        backend = cls(SimpleNamespace(device="cpu", req_to_token_pool=req_pool, token_to_kv_pool=own))
        backend.init_forward_metadata(batch)
        out = backend.forward_extend(q.clone(), k.clone(), v.clone(), layer, batch)
        results.append((out, own.k_buffer[0].clone(), own.v_buffer[0].clone()))
    (parent, parent_k, parent_v), (ours, our_k, our_v) = results
    assert torch.equal(parent_k, our_k) and torch.equal(parent_v, our_v)
    # The store happened: every slot of the batch holds its new K.
    assert torch.equal(our_k[batch.out_cache_loc.long()], k)
    return parent, ours


def phantom_batch():
    """SGLang's pools and batch builder around Penelope's cache: session A lost 2 blocks at the
    front of its private history; its next request (odd length) is batched with the phantom
    refilling that hole and with two more requests (one odd, one fresh), page 1."""
    serving = Serving(size=64 * 40, page_size=1, max_context=1024)
    system, a = serving.lose_front()
    reqs = serving.admit([a + blocks(9000, 1)[:37], system + [3, 4, 5], list(range(20_000, 20_065))])
    return serving, serving.build_batch(reqs)


def from_schedule_batch(batch):
    return forward_batch([r.kv.req_pool_idx for r in batch.reqs], list(batch.prefix_lens), list(batch.extend_lens),
                         batch.out_cache_loc)


def test_matches_torch_native_with_a_phantom_in_the_batch():
    serving, batch = phantom_batch()
    assert [hooks.is_phantom(r) for r in batch.reqs] == [True, False, False, False]
    # The phantom refills [128, 256); its request reads that hole through its row in the same
    # layer, then computes its own 37 + 128 new tokens; the others: a 3-token and a fresh extend.
    assert list(batch.prefix_lens) == [128, 512, 128, 0] and list(batch.extend_lens) == [128, 37, 3, 65]
    parent, ours = run_both(serving.req_pool, kv_pool(64 * 40), from_schedule_batch(batch))
    torch.testing.assert_close(ours, parent, rtol=0, atol=ATOL)


@pytest.mark.parametrize(("prefixes", "extends"), [
    ([0], [1]),
    ([0], [111]),
    ([1], [1]),
    ([63, 0, 65], [65, 63, 1]),
    ([111, 7, 300], [1, 1, 1]),  # decode tokens of a mixed batch
    ([1000, 2, 511], [24, 333, 1]),
])
def test_matches_torch_native_on_cached_prefixes(prefixes, extends):
    """Rows of SGLang's ReqToTokenPool holding scattered slots (cached prefixes of odd lengths,
    then each extend's slots), a batch of several requests."""
    size = 4096
    req_pool = ReqToTokenPool(size=8, max_context_len=2048, device="cpu", enable_memory_saver=False)
    slots = torch.randperm(size, generator=torch.Generator().manual_seed(1)).to(torch.int32)
    taken, out_cache_loc = 0, []
    for row, (prefix, new) in enumerate(zip(prefixes, extends, strict=True)):
        req_pool.req_to_token[row, :prefix + new] = slots[taken:taken + prefix + new]
        out_cache_loc.append(slots[taken + prefix:taken + prefix + new])
        taken += prefix + new
    batch = forward_batch(list(range(len(prefixes))), prefixes, extends, torch.cat(out_cache_loc).long())
    parent, ours = run_both(req_pool, kv_pool(size), batch)
    torch.testing.assert_close(ours, parent, rtol=0, atol=ATOL)


def test_a_request_reads_what_another_request_of_its_batch_stores():
    """Two requests share a row prefix whose last 40 slots the first one writes in this batch (as
    a phantom does): the second must read them, so the store must come before any read."""
    req_pool = ReqToTokenPool(size=4, max_context_len=512, device="cpu", enable_memory_saver=False)
    shared = torch.arange(100, 200, dtype=torch.int32)
    req_pool.req_to_token[0, :100] = shared
    req_pool.req_to_token[1, :100] = shared
    req_pool.req_to_token[1, 100:105] = torch.arange(300, 305, dtype=torch.int32)
    batch = forward_batch([0, 1], [60, 100], [40, 5], torch.cat([shared[60:], torch.arange(300, 305)]).long())
    parent, ours = run_both(req_pool, kv_pool(512), batch)
    torch.testing.assert_close(ours, parent, rtol=0, atol=ATOL)


def test_pairs_computed_are_the_causal_minimum(monkeypatch):
    """Spies on the attention each backend runs: the subclass computes prefix * new +
    new * (new + 1) / 2 query-key pairs per request (per head); SGLang's torch_native computes
    (prefix + new) * (prefix + new + 1) / 2, whatever is cached."""
    ours, theirs = [], []
    attend = cpu_attention.attend
    monkeypatch.setattr(cpu_attention, "attend", lambda q, k, v, causal, scale: (
        ours.append(q.shape[1] * (q.shape[1] + 1) // 2 if causal else q.shape[1] * k.shape[1]),
        attend(q, k, v, causal, scale))[1])
    sdpa = torch_native_backend.scaled_dot_product_attention
    monkeypatch.setattr(torch_native_backend, "scaled_dot_product_attention", lambda q, k, v, **kw: (
        theirs.append(q.shape[2] * (q.shape[2] + 1) // 2 if kw["is_causal"] else q.shape[2] * k.shape[2]),
        sdpa(q, k, v, **kw))[1])
    serving, batch = phantom_batch()
    run_both(serving.req_pool, kv_pool(64 * 40), from_schedule_batch(batch))
    pairs = zip(batch.prefix_lens, batch.extend_lens, strict=True)
    assert sum(ours) == sum(p * n + n * (n + 1) // 2 for p, n in pairs) == 128 * 128 + 128 * 129 // 2 + 512 * 37 + \
        37 * 38 // 2 + 128 * 3 + 6 + 65 * 66 // 2
    assert sum(theirs) == sum((p + n) * (p + n + 1) // 2 for p, n in zip(batch.prefix_lens, batch.extend_lens,
                                                                        strict=True))
    assert sum(theirs) > 4 * sum(ours)


@pytest.mark.parametrize("case", ["verify", "dllm", "encoder", "cross", "encoder-only", "sliding window",
                                  "logit cap", "v head dim", "extra argument"])
def test_everything_else_goes_to_torch_native(case, monkeypatch):
    calls = []
    monkeypatch.setattr(TorchNativeAttnBackend, "forward_extend", lambda self, *a, **k: calls.append(a) or "parent")
    modes = {"verify": ForwardMode.TARGET_VERIFY, "dllm": ForwardMode.DLLM_EXTEND}
    batch = forward_batch([0], [4], [2], torch.tensor([10, 11]), mode=modes.get(case, ForwardMode.EXTEND),
                          **({"encoder_lens": torch.tensor([3])} if case == "encoder" else {}))
    layer = attention_layer(**{"cross": {"is_cross_attention": True},
                               "encoder-only": {"attn_type": AttentionType.ENCODER_ONLY},
                               "sliding window": {"sliding_window_size": 128}, "logit cap": {"logit_cap": 30.0},
                               "v head dim": {"v_head_dim": DIM // 2}}.get(case, {}))
    req_pool = ReqToTokenPool(size=2, max_context_len=64, device="cpu", enable_memory_saver=False)
    backend = PrefixTorchNativeAttnBackend(SimpleNamespace(device="cpu", req_to_token_pool=req_pool,
                                                           token_to_kv_pool=kv_pool(64)))
    extra = {"sinks": torch.zeros(HEADS)} if case == "extra argument" else {}
    q, kv = torch.zeros(2, HEADS * DIM), torch.zeros(2, KV_HEADS, DIM)
    assert backend.forward_extend(q, kv, kv, layer, batch, **extra) == "parent"
    assert len(calls) == 1


def test_registered_as_a_choice_of_sglangs_attention_backends():
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    cpu_attention.register()
    cpu_attention.register()
    assert ATTENTION_BACKEND_CHOICES.count("torch_native_prefix") == 1
    assert ATTENTION_BACKENDS["torch_native_prefix"] is create_prefix_attention_backend
    assert ATTENTION_BACKENDS["torch_native"] is not create_prefix_attention_backend


def test_factory_refuses_a_gpu():
    with pytest.raises(UsageError, match="runs on CPU only, not on cuda"):
        create_prefix_attention_backend(SimpleNamespace(device="cuda"))
