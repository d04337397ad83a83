"""SGLang 0.5.23's real pools, requests and batches on CPU around PenelopeRadixCache, driven the
way its scheduler drives them (a stand-in for the scheduler loop, not a model).

`Serving.prefill(token_lists)` does what one prefill step of the scheduler does for new requests:
`Req.init_next_round_input` (match), `tree_cache.lock`, `ScheduleBatch.init_new` and
`prepare_for_extend` (allocation, row writes) with the phantom hooks of `hooks.py` called around
the real methods, a "forward" that writes a fingerprint (token id, absolute position) as the K of
every computed token, then the result processing: phantoms retired, requests checkpointed or
released through `release_kv_cache`, phantom rows freed.
"""
from __future__ import annotations

import contextlib
from array import array

import numpy as np
import torch
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req, ScheduleBatch
from sglang.srt.managers.scheduler_components.pool_stats_observer import kv_private_tokens
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.runtime_context import get_context
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from penelope.cache.tree import BlockState
from penelope.integration.sglang import hooks
from penelope.integration.sglang.options import PenelopeOptions
from penelope.integration.sglang.radix_cache import PenelopeRadixCache

VOCAB = 50_000


def blocks(base: int, n: int) -> list[int]:
    """n blocks of 64 consecutive token ids from `base`."""
    return list(range(base, base + 64 * n))


@contextlib.contextmanager
def sglang_config():
    """Publish a CPU server config (torch_native attention) for SGLang code that reads it."""
    override = get_context().override_server_args(attention_backend="torch_native", device="cpu")
    override.install()
    try:
        yield
    finally:
        override.restore()


class _ModelConfig:
    vocab_size = VOCAB
    is_encoder_decoder = False


class Serving:
    """Pools of `size` token slots (page `page_size`), `rows` request rows, and the cache
    (`forward_stream`: the stream SGLang's forwards run on, for the CPU tier's copies)."""

    def __init__(self, size: int, page_size: int = 1, rows: int = 16, max_context: int = 4096,
                 policy: str = "penelope", phantoms: bool = True, block_size: int | None = 64,
                 events: bool = False, cpu_cache: int = 0, swap_buffer: int = 1024, backend: str | None = None,
                 refill: str = "auto", copy: str = "auto", forward_stream=None, tool_call_token: int | None = None,
                 extra_key: str | None = None, cache_salt: str | None = None):
        self.page_size = page_size
        self.req_pool = ReqToTokenPool(size=rows, max_context_len=max_context, device="cpu",
                                       enable_memory_saver=False)
        self.kv_pool = MHATokenToKVPool(size=size, page_size=page_size, dtype=torch.float32, head_num=1,
                                        head_dim=2, layer_num=1, device="cpu", enable_memory_saver=False,
                                        enable_alt_stream=False)
        if page_size == 1:
            self.allocator = TokenToKVPoolAllocator(size, torch.float32, "cpu", self.kv_pool, False)
        else:
            self.allocator = PagedTokenToKVPoolAllocator(size, page_size, torch.float32, "cpu", self.kv_pool, False)
        params = CacheInitParams(disable=False, req_to_token_pool=self.req_pool,
                                 token_to_kv_pool_allocator=self.allocator, page_size=page_size,
                                 enable_kv_cache_events=events)
        options = PenelopeOptions(policy=policy, block_size=block_size, cpu_cache=cpu_cache, swap_buffer=swap_buffer,
                                  refill=refill, copy=copy, tool_call_token=tool_call_token)
        self.cache = PenelopeRadixCache(params, options, phantoms=phantoms, backend=backend,
                                        forward_stream=forward_stream)
        self.total = self.allocator.size // page_size * page_size
        self.running: list[Req] = []
        self.rows_held: list[Req] = []
        self._next_rid = 0
        self.phantom_tokens = 0
        # The namespace of every request `new_request` makes (a LoRA key, a cache salt).
        self.extra_key, self.cache_salt = extra_key, cache_salt

    def new_request(self, tokens) -> Req:
        params = SamplingParams(max_new_tokens=1, temperature=0)
        params.normalize(None)
        self._next_rid += 1
        return Req(f"r{self._next_rid}", "", array("q", tokens), params, vocab_size=VOCAB, extra_key=self.extra_key,
                   cache_salt=self.cache_salt)

    def admit(self, token_lists, chunk: int | None = None) -> list[Req]:
        """Match, plan the refill of any holes (``hooks._admit``: `chunk` tokens of budget, the
        free request rows) and lock, as PrefillAdder.add_one_req does; the whole prompt from the
        planned prefix is one extend."""
        reqs = []
        rows = self.req_pool.available_size()
        for tokens in token_lists:
            req = self.new_request(tokens)
            req.init_next_round_input(self.cache)
            assert self.cache.load_for(req), "the GPU cannot take the request's CPU spans"
            self.cache.plan_admission(req, chunk, rows)
            rows -= 1 + len(self.cache.phantom_holes(req))
            req.extend_end = len(req.full_untruncated_fill_ids)
            req.lock = self.cache.lock(req.last_node)
            reqs.append(req)
        return reqs

    def build_batch(self, reqs) -> ScheduleBatch:
        """ScheduleBatch.init_new and prepare_for_extend with the phantom hooks around them."""
        batch = hooks._add_phantoms(ScheduleBatch.init_new.__func__, ScheduleBatch, reqs, self.req_pool,
                                    self.allocator, self.cache, _ModelConfig(), False, SpeculativeAlgorithm.NONE)
        hooks._link_rows(ScheduleBatch.prepare_for_extend, batch)
        self.rows_held += batch.reqs
        return batch

    def forward(self, batch: ScheduleBatch) -> None:
        """Write (token id, position) as the K of every token the batch computes."""
        keys = self.kv_pool.k_buffer[0]
        start = 0
        for req, prefix, length in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, strict=True):
            tokens = torch.tensor(req.full_untruncated_fill_ids[prefix:prefix + length], dtype=torch.float32)
            positions = torch.arange(prefix, prefix + length, dtype=torch.float32)
            keys[batch.out_cache_loc[start:start + length], 0] = torch.stack([tokens, positions], dim=1)
            start += length
            self.phantom_tokens += length if hooks.is_phantom(req) else 0

    def finish(self, batch: ScheduleBatch, keep_running: bool = False) -> None:
        """Result processing: phantoms retired; requests checkpointed (kept running) or released
        with a checkpoint; phantom rows freed."""
        for req in batch.reqs:
            if req.finished():
                continue
            if keep_running:
                checkpoint_kv_cache(req, self.cache)
                self.running.append(req)
            else:
                self.release(req)
        hooks.release_phantom_rows(batch.reqs, self.req_pool)
        self.rows_held = [r for r in self.rows_held if r.kv.req_pool_idx is not None]

    def release(self, req: Req, checkpoint: bool = True) -> None:
        req.finished_reason = FINISH_LENGTH(1)
        release_kv_cache(req, self.cache, checkpoint=checkpoint)
        if req in self.running:
            self.running.remove(req)
        self.rows_held = [r for r in self.rows_held if r.kv.req_pool_idx is not None]

    def fits(self, reqs) -> bool:
        """PrefillAdder's memory test: the extends, the phantoms' holes and a page per request
        fit in what is free or evictable once the requests' matches are locked."""
        need = sum(-(-(r.extend_len + self.cache.hole_tokens(r)) // self.page_size)
                   * self.page_size + self.page_size for r in reqs)
        return need <= self.allocator.available_size() + self.cache.evictable_size()

    def prefill(self, token_lists, keep_running: bool = False) -> list[Req]:
        """One prefill step for new requests; [] when admission refuses them (locks dropped)."""
        reqs = self.admit(token_lists)
        if not self.fits(reqs):
            for req in reqs:
                self.cache.unlock(req.lock)
            return []
        batch = self.build_batch(reqs)
        self.forward(batch)
        for req in reqs:
            self.check_row(req)
        self.finish(batch, keep_running=keep_running)
        return reqs

    def lose_front(self) -> tuple[list[int], list[int]]:
        """Session A (2 blocks shared with session B, then 6 private) loses the first 2 blocks of
        its private history, [128, 256): both are cached, then 128 tokens are evicted. Returns
        (the shared blocks' tokens, A's history)."""
        system = blocks(1000, 2)
        history = system + blocks(1, 6)
        self.prefill([history + [7]])
        self.prefill([system + blocks(5000, 6) + [8]])
        self.cache.evict(EvictParams(num_tokens=128))
        return system, history

    def accounting(self) -> tuple[int, int]:
        """(SGLang's conservation sum, total): available + evictable + protected + what requests
        own privately (SGLang's `kv_private_tokens` over every request holding a row)."""
        private = sum(kv_private_tokens(r.kv, self.page_size) for r in self.rows_held)
        used = (self.allocator.available_size() + self.cache.evictable_size() + self.cache.protected_size()
                + private)
        return used, self.total

    def check_row(self, req: Req) -> None:
        """Every position of the request's row up to its extend end holds that position's KV."""
        end = req.extend_end
        slots = self.req_pool.req_to_token[req.kv.req_pool_idx, :end].long()
        got = self.kv_pool.k_buffer[0][slots, 0]
        want = torch.stack([torch.tensor(req.full_untruncated_fill_ids[:end], dtype=torch.float32),
                            torch.arange(end, dtype=torch.float32)], dim=1)
        bad = torch.nonzero((got != want).any(dim=1))
        assert not len(bad), f"{req.rid}: position {int(bad[0])} holds {got[bad[0]].tolist()}"

    def check_tree_kv(self) -> None:
        """Every resident block in the tree holds the KV of its tokens at its positions: GPU blocks
        in SGLang's pool, CPU blocks in the CPU tier's host pool."""
        pools = {BlockState.GPU: self.kv_pool.k_buffer[0]}
        if self.cache.host_kv is not None:
            pools[BlockState.CPU] = self.cache.host_kv.host[0]
        bs = self.cache.block_size
        for node in self.cache.cache.tree.nodes():
            for state, keys in pools.items():
                for block in np.flatnonzero(node.state == state):
                    first = block * bs
                    slots = torch.from_numpy(node.slots[first:first + bs].astype(np.int64))
                    want_tokens = torch.from_numpy(node.tokens[first:first + bs].astype(np.float32))
                    want_pos = torch.arange(node.start + first, node.start + first + bs, dtype=torch.float32)
                    assert torch.equal(keys[slots, 0, 0], want_tokens), f"token mismatch in {node} ({state.name})"
                    assert torch.equal(keys[slots, 0, 1], want_pos), f"position mismatch in {node} ({state.name})"
