"""PenelopeRadixCache on SGLang 0.5.23's real ReqToTokenPool, MHATokenToKVPool and token/paged
allocators (CPU): accounting, holes, locks, and KV correctness checked with fingerprints."""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sglang.srt.mem_cache.base_prefix_cache import DecLockRefParams, EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang_env import Serving, blocks, sglang_config

from penelope.cache.policies import get_policy
from penelope.cache.tree import BlockState
from penelope.errors import InvariantError, UsageError
from penelope.integration.sglang import PenelopeOptions, PenelopeRadixCache, hooks

PAGES = [1, 64]


@pytest.fixture(autouse=True)
def _config():
    with sglang_config():
        yield


def assert_conserved(serving: Serving) -> None:
    used, total = serving.accounting()
    assert used == total, f"available + evictable + protected + private = {used} != {total}"


def two_sessions(serving: Serving):
    """A shared 2-block prompt, then two private 6-block histories: A first, then B."""
    system = blocks(1000, 2)
    a, b = system + blocks(1, 6), system + blocks(5000, 6)
    serving.prefill([a + [7]])
    serving.prefill([b + [8]])
    return system, a, b


@pytest.mark.parametrize("page", PAGES)
def test_evicted_front_of_private_history_is_a_hole_and_tail_still_matches(page):
    serving = Serving(size=64 * 40, page_size=page)
    system, a, b = two_sessions(serving)
    assert serving.cache.evict(EvictParams(num_tokens=128)).num_tokens_evicted == 128
    assert_conserved(serving)

    [req] = serving.admit([a + blocks(9000, 1) + [9]])
    ref = req.last_node
    assert ref.holes == [(128, 256)]
    assert req.prefix_len == len(a) == 512
    states = [(s.start, s.end, s.state) for s in ref.match.spans]
    assert states[:3] == [(0, 128, BlockState.GPU), (128, 256, BlockState.MISSING), (256, 512, BlockState.GPU)]
    # The retained tail's KV is what the request reads: fingerprints of A's tokens at their positions.
    tail = serving.cache.prefix_device_indices(req)[256:512]
    keys = serving.kv_pool.k_buffer[0][tail, 0]
    assert torch.equal(keys[:, 0], torch.tensor(a[256:512], dtype=torch.float32))
    assert torch.equal(keys[:, 1], torch.arange(256, 512, dtype=torch.float32))

    batch = serving.build_batch([req])
    assert [(r.prefix_len, r.extend_end) for r in batch.reqs] == [(128, 256), (512, len(req.full_untruncated_fill_ids))]
    assert_conserved(serving)
    serving.forward(batch)
    serving.check_row(req)
    serving.finish(batch)
    assert serving.phantom_tokens == 128
    assert_conserved(serving)
    serving.cache.check_invariants()
    serving.check_tree_kv()
    [again] = serving.admit([a + blocks(9000, 1) + [1]])
    assert again.last_node.holes == [] and again.prefix_len == 576


@pytest.mark.parametrize("page", PAGES)
def test_without_phantoms_a_hole_ends_the_match(page):
    serving = Serving(size=64 * 40, page_size=page, phantoms=False)
    system, a, b = two_sessions(serving)
    serving.cache.evict(EvictParams(num_tokens=128))
    [req] = serving.prefill([a + [9]])
    assert req.last_node.holes == [] and req.cached_tokens == len(system)
    assert serving.phantom_tokens == 0
    assert_conserved(serving)
    serving.cache.check_invariants()
    serving.check_tree_kv()


def test_sglang_policy_deletes_the_tail_instead():
    serving = Serving(size=64 * 40, page_size=64, policy="sglang")
    system, a, b = two_sessions(serving)
    # SGLang's RadixCache deletes the whole LRU leaf: all of A's private history goes.
    assert serving.cache.evict(EvictParams(num_tokens=128)).num_tokens_evicted == 6 * 64
    [req] = serving.admit([a + [9]])
    assert req.last_node.holes == [] and req.prefix_len == len(system)


@pytest.mark.parametrize("page", PAGES)
def test_locked_path_is_never_evicted(page):
    serving = Serving(size=64 * 40, page_size=page)
    system, a, b = two_sessions(serving)
    [req] = serving.admit([a + [9]])
    locked = serving.cache.prefix_device_indices(req).clone()
    freed = serving.cache.evict(EvictParams(num_tokens=10**6)).num_tokens_evicted
    assert freed == 6 * 64  # B's private history only; the shared prompt is on A's locked path
    assert serving.cache.evict(EvictParams(num_tokens=64)).num_tokens_evicted == 0
    assert serving.cache.protected_size() == len(a) and serving.cache.evictable_size() == 0
    assert_conserved(serving)
    serving.cache.check_invariants()  # includes: no tree page is on SGLang's free list
    [same] = serving.admit([a + [9]])
    assert torch.equal(serving.cache.prefix_device_indices(same), locked)
    serving.cache.unlock(same.lock)
    serving.cache.unlock(req.lock)
    assert serving.cache.evict(EvictParams(num_tokens=10**6)).num_tokens_evicted == len(a)
    assert serving.allocator.available_size() == serving.total


def test_lock_after_an_unrelated_eviction_redoes_the_match_and_refuses_a_changed_prefix():
    serving = Serving(size=64 * 40, page_size=64)
    system, a, b = two_sessions(serving)
    [req_b] = serving.admit([b + [9]])  # B is now the most recent history
    serving.cache.unlock(req_b.lock)
    req_a = serving.new_request(a + [9])
    req_a.init_next_round_input(serving.cache)
    serving.cache.touch_prefix(RadixKey(list(b)))  # B recent again: eviction takes A's front
    serving.cache.evict(EvictParams(num_tokens=64))
    with pytest.raises(InvariantError, match="evicted part of a matched prefix"):
        serving.cache.lock(req_a.last_node)
    req_b = serving.new_request(b + [9])
    req_b.init_next_round_input(serving.cache)
    serving.cache.evict(EvictParams(num_tokens=64))  # A's front again, not B's path
    lock = serving.cache.lock(req_b.last_node)
    assert serving.cache.protected_size() == len(b)
    serving.cache.unlock(lock)
    serving.cache.check_invariants()


def test_two_holes_get_two_phantoms_and_later_phantoms_see_earlier_holes():
    serving = Serving(size=64 * 40, page_size=64)
    system, p, q, r, x = blocks(1000, 2), blocks(2000, 2), blocks(3000, 3), blocks(4000, 1), blocks(5000, 2)
    for tokens in (system + p + r, system + p + q, system + x):
        serving.prefill([tokens + [1]])
    # Penelope frees R, then the front of P (R gone, P's history is private); leaf-head then
    # frees the front of Q: two holes on one history.
    for policy in ("penelope", "penelope", "leaf-head-block"):
        serving.cache.cache.policy = get_policy(policy)
        serving.cache.evict(EvictParams(num_tokens=64))
    [req] = serving.admit([system + p + q + blocks(6000, 1) + [4]])
    assert req.last_node.holes == [(128, 192), (256, 320)] and req.prefix_len == 448
    batch = serving.build_batch([req])
    assert [(x.prefix_len, x.extend_end) for x in batch.reqs][:2] == [(128, 192), (256, 320)]
    serving.forward(batch)
    for member in batch.reqs:
        serving.check_row(member)  # the second phantom's prefix holds the first phantom's slots
    serving.finish(batch)
    assert_conserved(serving)
    serving.cache.check_invariants()
    serving.check_tree_kv()


@pytest.mark.parametrize("page", PAGES)
def test_refilled_holes_are_the_trees_from_the_link_and_survive_an_abort(page):
    serving = Serving(size=64 * 40, page_size=page)
    system, a, b = two_sessions(serving)
    serving.cache.evict(EvictParams(num_tokens=128))
    [req] = serving.admit([a + [9]])
    batch = serving.build_batch([req])
    # Linked before the forward: the hole is resident (and locked by the request) already.
    spans = serving.cache.match_prefix(MatchPrefixParams(key=RadixKey(list(a)))).last_device_node.match.spans
    assert [(s.start, s.end, s.state) for s in spans] == [(0, 512, BlockState.GPU)]
    assert_conserved(serving)
    serving.forward(batch)
    # Aborted before any checkpoint (SGLang: release_kv_cache(checkpoint=False)).
    serving.release(req, checkpoint=False)
    hooks.release_phantom_rows(batch.reqs, serving.req_pool)
    serving.rows_held = []
    assert_conserved(serving)
    serving.cache.check_invariants()
    serving.check_tree_kv()
    assert serving.req_pool.available_size() == 16


def test_no_request_row_for_a_phantom_drops_the_hole_without_chunked_prefill():
    serving = Serving(size=64 * 40, page_size=64, rows=2)
    system, a, b = two_sessions(serving)
    serving.cache.evict(EvictParams(num_tokens=128))
    # Two free rows: the first request takes one, the holed one the other, none is left for its
    # phantom: it computes from its hole on (chunked prefill off, so it cannot go hole-first).
    other, req = serving.admit([system + [5], a + [9]])
    assert serving.cache.phantom_holes(req) == [] and req.prefix_len == 128
    batch = serving.build_batch([other, req])
    assert len(batch.reqs) == 2
    serving.forward(batch)
    serving.check_row(req)
    serving.finish(batch)
    assert_conserved(serving)
    serving.cache.check_invariants()
    serving.check_tree_kv()


def test_insert_follows_radix_cache_the_caller_frees_leading_duplicates_and_the_partial_block():
    serving = Serving(size=64 * 8, page_size=1)
    cache, allocator = serving.cache, serving.allocator
    tokens = blocks(1, 2) + [5, 6]
    first = allocator.alloc(len(tokens))
    result = cache.insert(InsertParams(key=RadixKey(list(tokens)), value=first))
    assert (result.prefix_len, result.total_len) == (0, 128)
    again = allocator.alloc(len(tokens))
    assert cache.insert(InsertParams(key=RadixKey(list(tokens)), value=again)).prefix_len == 128
    # Nothing of `again` was taken or freed, and the partial block of `first` is still the caller's.
    held = len(again) + 2
    assert allocator.available_size() + cache.evictable_size() + held == serving.total
    allocator.free(again)
    allocator.free(first[128:])
    assert allocator.available_size() + cache.evictable_size() == serving.total
    assert cache.match_prefix(MatchPrefixParams(key=RadixKey(list(tokens)))).device_prefix_len == 128
    assert cache.all_values_flatten().sort().values.tolist() == sorted(first[:128].tolist())
    cache.check_invariants()


def test_insert_without_slots_is_refused_where_sglang_would_cache_token_ids_as_slots():
    """SGLang's ``RadixCache.insert(value=None)`` is a fallback for its simulated tree (no pools:
    the scheduler's in-batch prefix tree; SGLang's scheduler never inserts into its tree cache
    without slots): it caches the token ids themselves as the slots, and on real pools its eviction
    then hands those ids to the allocator as free KV slots. Penelope's tree gives evicted slots
    back to SGLang's allocator too, so it refuses such an insert in one line and changes nothing."""
    tokens = list(range(64, 192))
    theirs = Serving(size=64 * 4, page_size=64)
    sglang = RadixCache(CacheInitParams(disable=False, req_to_token_pool=theirs.req_pool,
                                        token_to_kv_pool_allocator=theirs.allocator, page_size=64))
    sglang.insert(InsertParams(key=RadixKey(list(tokens))))
    node = sglang.match_prefix(MatchPrefixParams(key=RadixKey(list(tokens)))).last_device_node
    assert sglang.path_device_indices(node).tolist() == tokens
    held = theirs.allocator.alloc(theirs.allocator.available_size())
    assert theirs.allocator.available_size() == 0
    sglang.evict(EvictParams(num_tokens=len(tokens)))
    # Every slot is still held, yet two pages came free: slots 64 to 191, the token ids.
    assert theirs.allocator.available_size() == len(tokens) and set(tokens) <= set(held.tolist())

    serving = Serving(size=64 * 4, page_size=1)
    serving.prefill([blocks(1, 1) + [7]])
    before = adapter_state(serving)
    for key in (RadixKey(list(tokens)), RadixKey(list(blocks(1, 1))), RadixKey(list(tokens), extra_key="lora")):
        with pytest.raises(UsageError, match=r"^penelope: insert needs the KV slots of its key \(value=None"):
            serving.cache.insert(InsertParams(key=key))
    assert adapter_state(serving) == before
    serving.cache.check_invariants()


def _refuse_get_all_free_pages(allocator):
    """The stock allocators' lists are read directly: SGLang's census must not be called."""
    def refuse():
        raise AssertionError("get_all_free_pages was called")
    allocator.get_all_free_pages = refuse


@pytest.mark.parametrize("need_sort", [False, True])
@pytest.mark.parametrize("page", PAGES)
def test_slots_freed_back_to_sglang_are_refused_as_free(page, need_sort):
    """Slots a request gave back wait, with need_sort, in the allocator's second list (page 1:
    `release_pages`, paged: `staged_pages`) until SGLang merges them: the free-list check reads
    both lists, the same pages as SGLang's own `get_all_free_pages`."""
    serving = Serving(size=64 * 8, page_size=page)
    cache, allocator = serving.cache, serving.allocator
    allocator.need_sort = need_sort
    first, second = allocator.alloc(128), allocator.alloc(128)
    allocator.free(first[:64])
    allocator.free(second)
    census = sorted(allocator.get_all_free_pages().tolist())
    _refuse_get_all_free_pages(allocator)
    listed = cache.slots._free_list()
    assert sorted(listed.tolist()) == census
    assert listed.dtype == np.int64 and listed.flags.c_contiguous
    for freed in (first[:64], second[64:]):
        with pytest.raises(UsageError, match="is free in SGLang's allocator"):
            cache.insert(InsertParams(key=RadixKey(list(blocks(900, 1))), value=freed))
    # The slots still held go in.
    assert cache.insert(InsertParams(key=RadixKey(list(blocks(900, 1))), value=first[64:])).prefix_len == 0
    assert cache.evictable_size() == 64
    del allocator.get_all_free_pages
    cache.check_invariants()


@pytest.mark.parametrize("gpu_path", [False, True])
@pytest.mark.parametrize("by_page_id", [False, True])
@pytest.mark.parametrize("page", PAGES)
def test_slots_freed_in_an_open_free_group_are_refused(page, by_page_id, gpu_path):
    """SGLang's scheduler frees a batch's slots inside a free group: they are free from then on,
    though listed only when the group ends. An insert of them in between is refused; accepted,
    the tree would hold pages that the group's end puts on the free list. `gpu_path`: the lists
    read as on a GPU pool (joined on the device, then copied to the host)."""
    serving = Serving(size=64 * 8, page_size=page)
    cache, allocator = serving.cache, serving.allocator
    cache.slots._on_cpu = not gpu_path
    slots = allocator.alloc(128)
    allocator.free_group_begin()
    if by_page_id:
        allocator.free_page_ids(slots[64::page] // page)
    else:
        allocator.free(slots[64:])
    _refuse_get_all_free_pages(allocator)
    with pytest.raises(UsageError, match="is free in SGLang's allocator"):
        cache.insert(InsertParams(key=RadixKey(list(blocks(900, 1))), value=slots[64:]))
    assert cache.insert(InsertParams(key=RadixKey(list(blocks(901, 1))), value=slots[:64])).prefix_len == 0
    del allocator.get_all_free_pages
    allocator.free_group_end()
    assert allocator.available_size() == 64 * 8 - 64
    cache.check_invariants()


@pytest.mark.parametrize("in_a_group", [False, True])
@pytest.mark.parametrize("page", PAGES)
def test_the_invariants_catch_a_tree_page_freed_behind_the_caches_back(page, in_a_group):
    """A page the tree holds that SGLang lists as free (or frees in a group still open) is named by
    `check_invariants`, from the same free list the inserts check."""
    serving = Serving(size=64 * 8, page_size=page)
    cache, allocator = serving.cache, serving.allocator
    slots = allocator.alloc(64)
    cache.insert(InsertParams(key=RadixKey(list(blocks(900, 1))), value=slots))
    cache.check_invariants()
    if in_a_group:
        allocator.free_group_begin()
    allocator.free(slots)
    with pytest.raises(InvariantError, match=f"page {int(slots[0]) // page} is both in the tree and on SGLang's"):
        cache.check_invariants()


def test_insert_refuses_slots_in_the_wrong_state_and_changes_nothing():
    serving = Serving(size=64 * 8, page_size=1)
    cache, allocator = serving.cache, serving.allocator
    held = allocator.alloc(64)
    cache.insert(InsertParams(key=RadixKey(list(blocks(1, 1))), value=held))
    twice = allocator.alloc(64)
    twice[5] = twice[9]
    before = (allocator.available_size(), cache.evictable_size())
    never = torch.arange(300, 364)  # still on SGLang's free list
    with pytest.raises(UsageError, match="passed twice"):
        cache.insert(InsertParams(key=RadixKey(list(blocks(900, 1))), value=twice))
    with pytest.raises(UsageError, match="already held by the cache"):
        cache.insert(InsertParams(key=RadixKey(list(blocks(900, 1))), value=held))
    with pytest.raises(UsageError, match="never allocated"):
        cache.insert(InsertParams(key=RadixKey(list(blocks(900, 1))), value=never))
    assert (allocator.available_size(), cache.evictable_size()) == before
    cache.check_invariants()


@pytest.mark.parametrize("page", PAGES)
def test_insert_names_the_lowest_listed_page_and_refuses_slots_outside_the_pool(page):
    serving = Serving(size=64 * 8, page_size=page)
    cache, allocator = serving.cache, serving.allocator
    key = RadixKey(list(blocks(900, 2)))
    free = sorted(allocator.get_all_free_pages().tolist())[:128 // page]
    # Free pages, the highest first: the message names the lowest.
    never = torch.cat([torch.arange(p * page, (p + 1) * page) for p in reversed(free)])
    with pytest.raises(UsageError, match=f"slot page {free[0]} is free in SGLang's allocator"):
        cache.insert(InsertParams(key=key, value=never))
    for outside in (torch.arange(-128, 0), torch.arange(64 * 9, 64 * 9 + 128)):
        with pytest.raises(UsageError, match="outside SGLang's pool"):
            cache.insert(InsertParams(key=key, value=outside))
    assert cache.evictable_size() == 0 and allocator.available_size() == 64 * 8
    cache.check_invariants()


def adapter_state(serving: Serving) -> tuple:
    """What a rejected call must leave as it was: tree, locks, SGLang's free list, namespaces."""
    cache, allocator = serving.cache, serving.allocator
    free = torch.cat([allocator.free_pages, allocator.release_pages]).sort().values.tolist()
    nodes = sorted((n.start, n.key, n.slots.tolist(), n.state.tolist(), n.lock_ref) for n in cache.cache.tree.nodes())
    return free, nodes, sorted(cache._locks), cache.total_size(), cache.namespaces.as_dict()


@pytest.mark.parametrize(("value", "message"), [
    (lambda held: held[:8].float() + 0.7, "1-D int32 or int64 tensor on cpu, got torch.float32"),
    (lambda held: torch.ones(8, dtype=torch.bool), "got torch.bool"),
    (lambda held: held[:8].reshape(2, 4), r"got torch.int64 \(2, 4\)"),
    (lambda held: torch.empty(8, dtype=torch.int64, device="meta"), "on cpu, got .* on meta"),
    (lambda held: held[:8].tolist(), "got a list"),
    (lambda held: held[:8].numpy(), "got a ndarray"),
    (lambda held: held[:8].to_sparse(), r"cannot read its slots \(torch.sparse_coo\)"),
])
def test_insert_takes_slots_only_as_an_integer_tensor_on_the_pool_device(value, message):
    serving = Serving(size=256, page_size=1, block_size=8)
    held = serving.allocator.alloc(32)
    before = adapter_state(serving)
    with pytest.raises(UsageError, match=message):
        serving.cache.insert(InsertParams(key=RadixKey(list(range(100, 108)), extra_key="ns"), value=value(held)))
    assert adapter_state(serving) == before
    serving.cache.insert(InsertParams(key=RadixKey(list(range(100, 108))), value=held[:8].int()))
    serving.cache.check_invariants()


@pytest.mark.parametrize(("tokens", "message"), [
    ([2**64] * 8, "got object"),
    ([None] * 8, "got object"),
    ([True] * 8, "got bool"),
    ([1.5] * 8, "got float64"),
    ([2**63] * 8, "above the int64 range"),
    ("abcdefgh", "got <U8"),
])
def test_token_ids_must_be_int64_integers(tokens, message):
    serving = Serving(size=256, page_size=1, block_size=8)
    held = serving.allocator.alloc(32)
    before = adapter_state(serving)
    with pytest.raises(UsageError, match=f"penelope: token ids .*{message}"):
        serving.cache.insert(InsertParams(key=RadixKey(tokens), value=held[:8]))
    with pytest.raises(UsageError, match=f"penelope: token ids .*{message}"):
        serving.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
    assert adapter_state(serving) == before


@pytest.mark.parametrize("num_tokens", [None, "8", 2.5, float("nan"), True])
def test_evict_takes_a_whole_number_of_tokens(num_tokens):
    serving = Serving(size=256, page_size=1, block_size=8)
    serving.cache.insert(InsertParams(key=RadixKey(list(range(100, 116))), value=serving.allocator.alloc(16)))
    before = adapter_state(serving)
    with pytest.raises(UsageError, match="penelope: evict takes a whole number of tokens"):
        serving.cache.evict(EvictParams(num_tokens=num_tokens))
    assert adapter_state(serving) == before
    assert serving.cache.evict(EvictParams(num_tokens=-3)).num_tokens_evicted == 0  # evicting <= 0 is safe
    assert serving.cache.evict(EvictParams(num_tokens=torch.tensor(8))).num_tokens_evicted == 8


def test_a_lock_is_released_only_on_its_own_node_of_its_own_cache():
    serving, other = Serving(size=256, page_size=1, block_size=8), Serving(size=256, page_size=1, block_size=8)
    cache = serving.cache
    tokens = list(range(100, 116))
    for s in (serving, other):
        s.cache.insert(InsertParams(key=RadixKey(tokens), value=s.allocator.alloc(16)))
    ref_a = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).last_device_node
    ref_b = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens[:8]))).last_device_node
    receipt_a, receipt_b = cache.inc_lock_ref(ref_a), cache.inc_lock_ref(ref_b)
    other_ref = other.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).last_device_node
    other.cache.inc_lock_ref(other_ref)
    before = adapter_state(other)
    # The other cache holds the same tokens in the same slots: only the origin tells them apart.
    with pytest.raises(UsageError, match="comes from another cache"):
        other.cache.inc_lock_ref(ref_a)
    with pytest.raises(UsageError, match="comes from another cache"):
        other.cache.dec_lock_ref(ref_a, DecLockRefParams(node_id=receipt_a.node_id))
    assert adapter_state(other) == before
    before = adapter_state(serving)
    with pytest.raises(UsageError, match=f"receipt {receipt_b.node_id} is a lock on another node"):
        cache.dec_lock_ref(ref_a, DecLockRefParams(node_id=receipt_b.node_id))
    assert adapter_state(serving) == before
    cache.dec_lock_ref(ref_b, DecLockRefParams(node_id=receipt_b.node_id))
    assert cache.protected_size() == 16  # ref_a's lock holds
    cache.dec_lock_ref(ref_a, DecLockRefParams(node_id=receipt_a.node_id))
    assert cache.protected_size() == 0
    cache.check_invariants()


def test_bad_configuration_is_refused():
    serving = Serving(size=64 * 8, page_size=64)
    params = CacheInitParams(disable=False, req_to_token_pool=serving.req_pool,
                             token_to_kv_pool_allocator=serving.allocator, page_size=64)
    with pytest.raises(UsageError, match="multiple of SGLang's page size"):
        PenelopeRadixCache(params, PenelopeOptions(block_size=96))
    params.is_eagle = True
    with pytest.raises(UsageError, match="EAGLE"):
        PenelopeRadixCache(params)


def test_namespaced_keys_are_cached_in_their_own_namespace():
    serving = Serving(size=64 * 8, page_size=1)
    tokens = list(blocks(1, 2))
    slots = serving.allocator.alloc(128)
    serving.cache.insert(InsertParams(key=RadixKey(tokens, extra_key="lora-a"), value=slots))

    def hit(**namespace) -> int:
        return serving.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens, **namespace))).device_prefix_len

    assert hit(extra_key="lora-a") == 128
    assert hit() == hit(extra_key="lora-b") == hit(extra_key="lora-a", cache_salt="s") == 0
    other = serving.allocator.alloc(128)
    serving.cache.insert(InsertParams(key=RadixKey(tokens, cache_salt="s"), value=other))
    assert hit(cache_salt="s") == 128 and hit() == 0
    serving.cache.check_invariants()


def test_by_default_a_block_is_one_sglang_page():
    for page in PAGES:
        serving = Serving(size=64 * 8, page_size=page, block_size=None)
        assert serving.cache.block_size == page


@st.composite
def workloads(draw):
    """Pool, page, policy, phantoms, and a random source for 30 operations of agent sessions."""
    page = draw(st.sampled_from(PAGES))
    capacity = draw(st.integers(12, 20)) * 64
    policy = draw(st.sampled_from(["penelope", "penelope", "sglang", "leaf-head-block"]))
    return page, capacity, policy, draw(st.booleans()), draw(st.randoms(use_true_random=False))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_accounting_and_kv_hold_after_every_operation(workload):
    """Agent-like sessions over a shared prompt, under memory pressure: after every operation
    SGLang's conservation sum holds and every cached block holds its own tokens' KV; after every
    prefill each request's row holds the right KV at every position (holes included)."""
    page, capacity, policy, phantoms, rng = workload
    serving = Serving(size=capacity, page_size=page, policy=policy, phantoms=phantoms)
    system = blocks(100_000, 2)
    sessions = [list(system) for _ in range(4)]
    fresh = iter(range(1, 10**6))

    def turn(i: int, n: int) -> list[int]:
        # Histories grow turn by turn; past 9 blocks a session compacts to the prompt.
        if len(sessions[i]) + n > 9 * 64:
            sessions[i] = list(system)
        sessions[i] = sessions[i] + [next(fresh) for _ in range(n)]
        return list(sessions[i])

    for _ in range(30):
        # Skewed sessions: frequent ones keep their tails while rare ones lose their fronts.
        op, i, n = rng.choice("tttpheb"), rng.choice([0, 0, 0, 1, 1, 2, 3]), rng.randint(1, 150)
        if op == "t":
            serving.prefill([turn(i, n)])
        elif op == "p":
            serving.prefill([turn(i, n), turn((i + 1) % 4, n // 2 + 1)])
        elif op == "h" and not serving.running:
            serving.prefill([turn(i, n)], keep_running=True)
        elif op == "h":
            serving.release(serving.running[0], checkpoint=rng.random() < 0.5)
        elif op == "b":
            # A sibling of session i's history: shares all but its last block.
            base = sessions[i][: max(len(system), len(sessions[i]) - 64)]
            serving.prefill([base + [next(fresh) for _ in range(n)]])
        else:
            serving.cache.evict(EvictParams(num_tokens=n * 4))
        assert_conserved(serving)
        serving.check_tree_kv()
        if not serving.running:
            serving.cache.check_invariants()
    for req in list(serving.running):
        serving.release(req)
    assert_conserved(serving)
    serving.cache.check_invariants()
    assert serving.req_pool.available_size() == 16


def test_two_caches_fed_the_same_operations_agree():
    """What tensor parallelism relies on: every rank runs its own cache, and caches that see the
    same operations make the same decisions (a logical clock, no wall time, no randomness)."""
    ranks = [Serving(size=64 * 14, page_size=64) for _ in range(2)]
    system = blocks(1000, 2)

    def tree(serving):
        return [(n.start, n.end, n.state.tolist(), n.tokens.tolist(), n.slots.tolist(), n.lock_ref)
                for n in serving.cache.cache.tree.nodes()]

    for turn in range(12):
        session = turn % 3
        tokens = system + blocks(10_000 * (session + 1), 2 + turn // 3) + [turn]
        for serving in ranks:
            serving.prefill([tokens])
            if turn % 4 == 3:
                serving.cache.evict(EvictParams(num_tokens=64))
        assert tree(ranks[0]) == tree(ranks[1])
    assert ranks[0].cache.cache.stats.evicted_tokens > 0


def test_a_released_receipt_cannot_release_another_holders_lock():
    serving = Serving(size=64 * 16, page_size=64)
    system, a, b = two_sessions(serving)
    first = serving.cache.lock(serving.cache.match_prefix(MatchPrefixParams(key=RadixKey(list(a)))).last_device_node)
    second = serving.cache.lock(serving.cache.match_prefix(MatchPrefixParams(key=RadixKey(list(a)))).last_device_node)
    serving.cache.unlock(first)
    with pytest.raises(UsageError, match="released already"):
        serving.cache.unlock(first)
    assert serving.cache.protected_size() == len(a)  # still held by the second lock
    serving.cache.unlock(second)
    with pytest.raises(UsageError, match="node a match returned"):
        serving.cache.inc_lock_ref(None)
    with pytest.raises(UsageError, match="node a match returned"):
        serving.cache.dec_lock_ref(object())
    serving.cache.check_invariants()


@pytest.mark.parametrize("page", [16, 64])
def test_paged_slots_are_checked_by_page_and_the_message_names_the_first_bad_slot(page):
    """Whole pages are checked by page id; the slot named is the one a slot-by-slot check names
    (the first in order), and slots that are not whole pages are checked slot by slot."""
    serving = Serving(size=64 * 8, page_size=page)
    cache, allocator = serving.cache, serving.allocator
    held = allocator.alloc(128)
    cache.insert(InsertParams(key=RadixKey(list(blocks(1, 2))), value=held))
    mine = allocator.alloc(128)

    def state():
        nodes = sorted((n.start, n.key, n.slots.tolist(), n.state.tolist()) for n in cache.cache.tree.nodes())
        return sorted(allocator.get_all_free_pages().tolist()), nodes, cache.total_size(), cache.slots.tree_size()

    before = state()
    key = RadixKey(list(blocks(900, 2)))
    cases = [
        (torch.cat([mine[:64], mine[page:64], mine[:page]]), f"slot {int(mine[0])} is passed twice"),
        (torch.cat([mine[:64], held[64:]]), f"slot {int(held[64])} is already held by the cache"),
        (torch.cat([mine[:128 - page], held[128 - page:]]), f"slot {int(held[128 - page])} is already held"),
        # Not whole pages (one slot moved into the next page): named slot by slot.
        (torch.cat([mine[1:65], mine[:1], held[65:]]), f"slot {int(held[65])} is already held"),
        (torch.cat([mine[1:65], mine[1:2], mine[65:]]), f"slot {int(mine[1])} is passed twice"),
    ]
    for value, message in cases:
        with pytest.raises(UsageError, match=f"^penelope: {message}"):
            cache.insert(InsertParams(key=key, value=value))
        assert state() == before
    cache.insert(InsertParams(key=key, value=mine))
    assert cache.evictable_size() == 256
    cache.check_invariants()


def test_slots_that_straddle_pages_are_refused():
    serving = Serving(size=64 * 8, page_size=64)
    slots = serving.allocator.alloc(128)
    straddling = torch.cat([slots[32:96], slots[:32], slots[96:]])
    before = serving.allocator.available_size()
    with pytest.raises(UsageError, match="whole pages"):
        serving.cache.insert(InsertParams(key=RadixKey(list(blocks(1, 2))), value=straddling))
    assert serving.allocator.available_size() == before and serving.cache.total_size() == 0
    serving.cache.insert(InsertParams(key=RadixKey(list(blocks(1, 2))), value=slots))
    serving.cache.check_invariants()


@pytest.mark.parametrize("cpu_cache", [0, 1024])
def test_a_flush_empties_the_cache_and_keeps_its_counters(cpu_cache):
    """SGLang's /flush_cache resets the cache: nothing stays cached on either tier, and the
    counters of what it did (evictions, tier moves) go on from where they were, as SGLang's own
    counters do: a monitor reading them never sees them fall."""
    serving = Serving(size=64 * 40, cpu_cache=cpu_cache)
    two_sessions(serving)
    assert serving.cache.evict(EvictParams(num_tokens=128)).num_tokens_evicted == 128
    before = serving.cache.stats()
    moved = "tier_demoted_tokens" if cpu_cache else "evicted_tokens"
    assert before[moved] == 128 and before["cached_tokens"] > 0
    serving.cache.reset()
    serving.allocator.clear()
    after = serving.cache.stats()
    assert after["cached_tokens"] == 0 and after.get("tier_host_cached_tokens", 0) == 0
    assert {k: after[k] for k in before if k.startswith(("evict", "tier_")) and k != "tier_host_cached_tokens"} == {
        k: v for k, v in before.items() if k.startswith(("evict", "tier_")) and k != "tier_host_cached_tokens"}
    two_sessions(serving)
    assert serving.cache.evict(EvictParams(num_tokens=64)).num_tokens_evicted == 64
    assert serving.cache.stats()[moved] == 128 + 64


@pytest.mark.parametrize("page", PAGES)
def test_slot_checks_read_slot_arrays_of_any_integer_type(page):
    """SGLang's slots arrive as int64; other integer arrays get the same checks and messages."""
    import numpy as np

    serving = Serving(size=64 * 8, page_size=page)
    slots = serving.cache.slots
    taken = serving.allocator.alloc(2 * max(page, 4)).numpy()
    for dtype in (np.int32, np.int64, np.uint32):
        slots.check_outstanding(taken.astype(dtype))
        with pytest.raises(UsageError, match="passed twice"):
            slots.check_outstanding(np.concatenate([taken, taken[:page]]).astype(dtype))
