"""KV cache events of PenelopeRadixCache against SGLang 0.5.23's own RadixCache and
UnifiedRadixCache (CPU): the same tokens in the same namespace (none, a LoRA adapter's
``extra_key``, another ``extra_key``, a ``cache_salt``) give the same parent-linked block hashes
and event fields, in SGLang's own format and in Dynamo's; evicted blocks are reported removed once,
and a reset clears everything."""
from array import array
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.events import KvEventLoraNames
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang_env import Serving, blocks, sglang_config

from penelope.integration.sglang import PenelopeOptions, PenelopeRadixCache

LORA_KEY = "tenant-7" + "0" * 32
# (extra_key, cache_salt): none; a LoRA adapter's key (its name is known to the event table);
# another extra_key; a salt; both.
NAMESPACES = [(None, None), (LORA_KEY, None), ("plain-key", None), (None, "salt-1"), (LORA_KEY, "salt-1")]


@pytest.fixture(autouse=True)
def _config():
    with sglang_config():
        yield


def stored(events) -> list[tuple[int, int | None, list[int]]]:
    """(block hash, parent hash, tokens) of every stored page, in order."""
    out = []
    for event in events:
        if isinstance(event, BlockStored):
            parent = event.parent_block_hash
            for i, block in enumerate(event.block_hashes):
                size = event.block_size
                out.append((block, parent, list(event.token_ids[i * size:(i + 1) * size])))
                parent = block
    return out


def sglang_events(page: int, sequences) -> list:
    serving = Serving(size=64 * 40, page_size=page)
    params = CacheInitParams(disable=False, req_to_token_pool=serving.req_pool,
                             token_to_kv_pool_allocator=serving.allocator, page_size=page,
                             enable_kv_cache_events=True)
    cache = RadixCache(params)
    for tokens in sequences:
        cache.insert(InsertParams(key=RadixKey(list(tokens)), value=serving.allocator.alloc(len(tokens))))
    return cache.take_events()


@pytest.mark.parametrize("page", [1, 64])
def test_stored_blocks_hash_as_sglangs_radix_cache(page):
    system = blocks(1000, 2)
    a, b = system + blocks(1, 3), system + blocks(5000, 2)
    serving = Serving(size=64 * 40, page_size=page, events=True, block_size=None)
    for tokens in (a, b):
        serving.cache.insert(InsertParams(key=RadixKey(list(tokens)), value=serving.allocator.alloc(len(tokens))))
    ours = stored(serving.cache.take_events())
    theirs = stored(sglang_events(page, [a, b]))
    assert {h for h, _, _ in ours} == {h for h, _, _ in theirs}
    assert sorted(ours, key=lambda e: e[0]) == sorted(theirs, key=lambda e: e[0])


@pytest.mark.parametrize(("extra_key", "cache_salt"), NAMESPACES)
def test_evicted_blocks_are_removed_once_and_refills_are_stored_again(extra_key, cache_salt):
    serving = Serving(size=64 * 40, page_size=64, events=True, extra_key=extra_key, cache_salt=cache_salt)
    system = blocks(1000, 2)
    a, b = system + blocks(1, 6), system + blocks(5000, 6)
    serving.prefill([a + [7]])
    serving.prefill([b + [8]])
    first = {h: tokens for h, _, tokens in stored(serving.cache.take_events())}
    serving.cache.evict(EvictParams(num_tokens=128))
    [removed] = serving.cache.take_events()
    assert isinstance(removed, BlockRemoved) and len(removed.block_hashes) == 2
    assert [first[h] for h in removed.block_hashes] == [a[128:192], a[192:256]]
    serving.prefill([a + [9]])  # a phantom refills the hole: stored again, same hashes
    again = stored(serving.cache.take_events())
    assert [h for h, _, _ in again] == removed.block_hashes
    serving.cache.reset()
    assert isinstance(serving.cache.take_events()[-1], AllBlocksCleared)
    assert torch.equal(serving.cache.all_values_flatten(), torch.empty(0, dtype=torch.int64))


def lora_names() -> KvEventLoraNames:
    """SGLang's event name table with one adapter, registered as its scheduler registers one: when
    the adapter loads, then for a request that uses it."""
    table = KvEventLoraNames()
    table.register(lora_id=LORA_KEY[-32:], lora_name="adapter-a")
    table.register(SimpleNamespace(extra_key=LORA_KEY, lora_id=LORA_KEY[-32:]), "adapter-a")
    return table


def pages(events) -> tuple[list, set]:
    """(every stored page's (hash, parent, tokens, cache_salt, lora_name, medium), sorted; the set of
    removed hashes)."""
    stored_pages, removed = [], set()
    for event in events:
        if isinstance(event, BlockStored):
            parent, size = event.parent_block_hash, event.block_size
            for i, block in enumerate(event.block_hashes):
                stored_pages.append((block, parent, list(event.token_ids[i * size:(i + 1) * size]),
                                     event.cache_salt, event.lora_name, event.medium))
                parent = block
        elif isinstance(event, BlockRemoved):
            removed.update(event.block_hashes)
    return sorted(stored_pages, key=repr), removed


def namespaced_traffic(cache, allocator) -> list:
    """Two histories sharing a prompt in every namespace (whole blocks of two pages), inserted, then
    everything evicted."""
    system = blocks(1000, 2)
    for extra_key, cache_salt in NAMESPACES:
        for tokens in (system + blocks(1, 4), system + blocks(5000, 2) + [9]):
            key = RadixKey(array("q", tokens), extra_key, cache_salt=cache_salt)
            cache.insert(InsertParams(key=key, value=allocator.alloc(len(tokens))))
    cache.evict(EvictParams(num_tokens=64 * 100))
    return cache.take_events()


@pytest.mark.parametrize("block_size", [None, 128], ids=["block=page", "block=2pages"])
@pytest.mark.parametrize("dynamo", [False, True], ids=["sglang-format", "dynamo-format"])
@pytest.mark.parametrize("theirs", [RadixCache, UnifiedRadixCache])
def test_namespaced_blocks_carry_sglangs_hashes_and_fields(theirs, dynamo, block_size):
    def params(serving, **extra):
        return CacheInitParams(disable=False, req_to_token_pool=serving.req_pool,
                               token_to_kv_pool_allocator=serving.allocator, page_size=64,
                               enable_kv_cache_events=True, dynamo_kv_event_format=dynamo,
                               kv_event_lora_names=lora_names(), **extra)

    serving = Serving(size=64 * 100, page_size=64)
    extra = {"tree_components": (ComponentType.FULL,)} if theirs is UnifiedRadixCache else {}
    want_stored, want_removed = pages(namespaced_traffic(theirs(params(serving, **extra)), serving.allocator))
    serving = Serving(size=64 * 100, page_size=64)
    ours = PenelopeRadixCache(params(serving), PenelopeOptions(block_size=block_size), phantoms=False)
    got_stored, got_removed = pages(namespaced_traffic(ours, serving.allocator))
    assert got_stored == want_stored
    assert got_removed == want_removed == {page[0] for page in want_stored}
    # Eight pages per namespace; SGLang's events tell the namespaces apart by salt and adapter, and
    # in Dynamo's format by any extra_key.
    assert len({page[0] for page in want_stored}) == 8 * (5 if dynamo else 4)
