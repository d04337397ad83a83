"""KV cache events of PenelopeRadixCache against SGLang 0.5.23's own RadixCache (CPU): the same
tokens give the same parent-linked block hashes, evicted blocks are reported removed once, and a
reset clears everything."""
import pytest
import torch
from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang_env import Serving, blocks, sglang_config


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


def test_evicted_blocks_are_removed_once_and_refills_are_stored_again():
    serving = Serving(size=64 * 40, page_size=64, events=True)
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
