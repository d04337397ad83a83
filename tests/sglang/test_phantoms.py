"""The refill hooks around SGLang 0.5.23's real PrefillAdder, Req and ScheduleBatch (CPU), one by
one. ``tests/sglang/test_engine.py`` runs them inside SGLang's real scheduler loop."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang_env import Serving, blocks, sglang_config

from penelope.errors import UsageError
from penelope.integration.sglang import hooks


@pytest.fixture(autouse=True)
def _config():
    with sglang_config():
        yield


@pytest.fixture
def budget_hooks(monkeypatch):
    """PrefillAdder's budget methods with Penelope's hooks around them, as HookRegistry does."""
    for name, hook in (("_request_slot_reserve_for_req", hooks._reserve_hole_slots),
                       ("_replay_len", hooks._charge_hole_compute),
                       ("_check_prefill_budget", hooks._check_budget)):
        original = getattr(PrefillAdder, name)
        monkeypatch.setattr(PrefillAdder, name, lambda self, *a, _o=original, _h=hook, **k: _h(_o, self, *a, **k))


@pytest.fixture
def holed():
    """Serving whose session A (2 shared + 6 private blocks) lost its first 2 private blocks."""
    serving = Serving(size=64 * 40, page_size=64)
    system = blocks(1000, 2)
    a = system + blocks(1, 6)
    serving.prefill([a + [7]])
    serving.prefill([system + blocks(5000, 6) + [8]])
    serving.cache.evict(EvictParams(num_tokens=128))
    return serving, a + blocks(9000, 1) + [9]


def new_adder(serving, chunk: int | None = 8192) -> PrefillAdder:
    return PrefillAdder(64, serving.cache, serving.allocator, ScheduleBatch(reqs=[]), 0.5, 16384, chunk)


def admit(serving, adder, tokens, has_chunked_req=False, align=None):
    req = serving.new_request(tokens)
    req.init_next_round_input(serving.cache)
    return req, hooks._admit(PrefillAdder.add_one_req, adder, req, has_chunked_req, align)


def nearly_full(**options):
    """A 2,560-token pool: session A's 30 blocks (2 shared) lost 6 blocks after the shared prefix
    to session B, and the pool holds 2,048 tokens. A's next turn, which adds a block, is returned:
    its hole [128, 512) lies before 1,408 resident tokens, which its lock holds while it waits."""
    serving = Serving(size=64 * 40, page_size=64, **options)
    system = blocks(1000, 2)
    a = system + blocks(1, 28)
    serving.prefill([a + [7]])
    serving.prefill([system + blocks(5000, 8) + [8]])
    serving.cache.evict(EvictParams(num_tokens=384))
    assert serving.allocator.available_size() == 512 and serving.cache.evictable_size() == 128 + 1408 + 512
    return serving, a + blocks(9000, 1) + [9]


def serve_whole_prefill(serving, req, chunk):
    """Run the request's chunks, as the scheduler does, until its prompt is computed."""
    while True:
        batch = serving.build_batch([req])
        serving.forward(batch)
        serving.check_row(req)
        if req.extend_end == len(req.full_untruncated_fill_ids):
            serving.finish(batch)
            return
        serving.finish(batch, keep_running=True)
        req.init_next_round_input()
        following = new_adder(serving, chunk=chunk)
        assert hooks._continue_chunk(PrefillAdder.add_chunked_req, following, req) in (None, req)
        serving.running.remove(req)


def test_a_hole_first_request_is_not_charged_the_resident_tail_it_jumps(budget_hooks):
    """SGLang charges a new request its whole prompt after its prefix against the free and
    evictable pool; a hole-first request's prefix is its hole, and its locked resident tail would
    be charged too: 1,921 tokens against 1,024 free or evictable, refused at every step with
    nothing else running."""
    serving, tokens = nearly_full()
    adder = new_adder(serving, chunk=128)
    req, result = admit(serving, adder, tokens)
    assert adder.can_run_list == [req] and (req.prefix_len, req.extend_end) == (128, 256), result
    serve_whole_prefill(serving, req, chunk=128)
    assert serving.cache.chunk_refill_tokens == 384
    assert serving.accounting()[0] == serving.total
    serving.cache.check_invariants()


def test_without_phantoms_the_lock_leaves_the_recomputed_tail_evictable(budget_hooks):
    """Without phantoms the request recomputes everything after its hole: its lock must not hold
    the resident tail it will compute again (held, it is charged and unevictable at once)."""
    serving, tokens = nearly_full(phantoms=False)
    adder = new_adder(serving, chunk=4096)
    req, result = admit(serving, adder, tokens)
    assert adder.can_run_list == [req] and req.prefix_len == 128 and req.extend_end == len(tokens), result
    serve_whole_prefill(serving, req, chunk=4096)
    assert serving.accounting()[0] == serving.total
    serving.cache.check_invariants()


def test_an_aligned_scheduler_still_cuts_a_hole_first_chunk_at_the_hole(budget_hooks):
    """Deterministic inference on FlashInfer aligns chunks to 4096 tokens (truncation_align_size)
    and gets no phantoms: a first chunk capped at a 384-token hole's end was rounded down to nothing
    and refused at every step."""
    serving, tokens = nearly_full(backend="flashinfer")
    adder = new_adder(serving, chunk=4096)
    req, _ = admit(serving, adder, tokens, align=4096)
    assert adder.can_run_list == [req] and (req.prefix_len, req.extend_end) == (128, 512)
    serve_whole_prefill(serving, req, chunk=4096)
    serving.cache.check_invariants()


def test_no_phantoms_on_a_backend_that_reads_the_prefix_before_storing(holed):
    """FlashInfer reads a batch's cached prefix before it stores the batch's K/V: its holes are
    refilled hole-first even where phantoms fit; asking for phantoms there is refused in one line."""
    serving = Serving(size=64 * 40, page_size=64, backend="flashinfer")
    assert not serving.cache.phantom_refill
    with pytest.raises(UsageError, match="refill 'phantoms' is unsafe here: the flashinfer attention backend"):
        Serving(size=64 * 40, page_size=64, backend="flashinfer", refill="phantoms")
    assert Serving(size=64 * 40, page_size=64, backend="fa3", refill="phantoms").cache.phantom_refill
    assert not Serving(size=64 * 40, page_size=64, backend="fa3", refill="hole-first").cache.phantom_refill


def test_phantoms_are_charged_to_the_budgets(holed, budget_hooks):
    serving, tokens = holed
    plain = new_adder(serving)
    plain_req = serving.new_request(tokens)
    plain_req.init_next_round_input(serving.cache)
    PrefillAdder.add_one_req(plain, plain_req, False, None)  # SGLang's own admission, no refill plan
    serving.cache.unlock(plain_req.lock)
    adder = new_adder(serving)
    req, result = admit(serving, adder, tokens)
    assert result == AddReqResult.CONTINUE and serving.cache.phantom_holes(req) == [(128, 256)]
    assert req.prefix_len == 512 and req.extend_end == len(tokens)
    # The hole is computed in this step: a new token, neither a cache hit nor a replayed token.
    assert plain.log_hit_tokens - adder.log_hit_tokens == 128
    assert plain.log_device_hit_tokens - adder.log_device_hit_tokens == 128
    assert adder.log_input_tokens - plain.log_input_tokens == 128
    assert adder.log_replay_tokens == plain.log_replay_tokens
    assert plain.rem_chunk_tokens - adder.rem_chunk_tokens == 128
    assert plain.rem_input_tokens - adder.rem_input_tokens == 128
    assert adder.memory_budget.total_offset - plain.memory_budget.total_offset == 128
    assert getattr(adder, hooks._PHANTOM_ROWS) == 1 and hooks.free_rows_for(adder) == 16 - 2
    batch = serving.build_batch(adder.can_run_list)
    serving.forward(batch)
    serving.check_row(req)
    serving.finish(batch)
    assert serving.accounting()[0] == serving.total
    serving.cache.check_invariants()


def test_a_hole_larger_than_the_chunk_is_computed_hole_first_then_jumped_past(holed, budget_hooks):
    serving, tokens = holed
    adder = new_adder(serving, chunk=128)
    req, _ = admit(serving, adder, tokens)
    # Hole [128, 256) and a page of new tokens do not fit 128: the request computes its hole.
    assert serving.cache.phantom_holes(req) == []
    assert (req.prefix_len, req.extend_end) == (128, 256) and adder.new_chunked_req is req
    assert adder.rem_chunk_tokens == 0
    batch = serving.build_batch(adder.can_run_list)
    assert batch.reqs == [req]
    serving.forward(batch)
    serving.check_row(req)
    serving.finish(batch, keep_running=True)  # SGLang stashes the chunk: checkpoint
    assert req.prefix_len == 256 and serving.cache.chunk_refill_tokens == 128
    # The next chunk jumps over the resident [256, 512) and computes the new tokens.
    following = new_adder(serving, chunk=128)
    req.init_next_round_input()
    assert hooks._continue_chunk(PrefillAdder.add_chunked_req, following, req) is None
    assert req.prefix_len == 512 and req.extend_end == len(tokens)
    assert req.kv.cache_protected_len == req.kv.kv_allocated_len == 512
    batch = serving.build_batch([req])
    serving.forward(batch)
    serving.check_row(req)
    serving.running.remove(req)
    serving.finish(batch)
    assert serving.accounting()[0] == serving.total
    serving.cache.check_invariants()
    serving.check_tree_kv()


def test_budget_left_beside_a_continuing_chunk_admits_only_whole_requests(holed, budget_hooks):
    serving, tokens = holed
    adder = new_adder(serving, chunk=128)
    long, result = admit(serving, adder, blocks(1000, 2) + blocks(7000, 3), has_chunked_req=True)
    assert result == AddReqResult.OTHER and adder.can_run_list == []
    short, result = admit(serving, adder, blocks(1000, 2) + [3, 4], has_chunked_req=True)
    assert adder.can_run_list == [short] and adder.new_chunked_req is None


def test_a_phantom_is_created_finished_and_sglang_filters_it(holed):
    serving, tokens = holed
    [req] = serving.admit([tokens])
    [phantom] = [hooks.make_phantom(req, start, end) for start, end in serving.cache.phantom_holes(req)]
    assert hooks.is_phantom(phantom) and not hooks.is_phantom(req) and phantom.finished()
    assert list(phantom.full_untruncated_fill_ids) == tokens[:256]
    assert (phantom.prefix_len, phantom.extend_end, phantom.extend_len) == (128, 256, 128)
    assert phantom.last_node is req.last_node and phantom.logprob_start_len == -1
    batch = serving.build_batch([req])
    assert [hooks.is_phantom(r) for r in batch.reqs] == [True, False]
    # SGLang's own filter (before merging a prefill batch into the running one) drops it.
    batch.filter_batch()
    assert batch.reqs == [req]


def test_rows_and_segments(holed):
    serving, tokens = holed
    [req, other] = serving.admit([tokens, blocks(1000, 2) + [3, 4, 5]])
    batch = serving.build_batch([req, other])
    phantom = batch.reqs[0]
    table = serving.req_pool.req_to_token
    assert torch.equal(table[req.kv.req_pool_idx, 128:256], table[phantom.kv.req_pool_idx, 128:256])
    assert phantom.kv.cache_protected_len == 256  # the hole is the tree's, not the phantom's

    def init_new(cls, batch, model_runner, **kwargs):
        return SimpleNamespace()

    forward_batch = hooks._attach_segments(init_new, ForwardBatch, batch, None, return_hidden_states_before_norm=False)
    rows = [r.kv.req_pool_idx for r in batch.reqs]
    extend = len(tokens) - 512
    assert getattr(forward_batch, hooks.SEGMENTS).tolist() == [
        [rows[0], 0, 128, 128], [rows[1], 128, 512, extend], [rows[2], 128 + extend, 128, 3]]
    plain = serving.build_batch(serving.admit([blocks(1000, 2) + [6]]))
    assert not hasattr(hooks._attach_segments(init_new, ForwardBatch, plain, None), hooks.SEGMENTS)


def test_result_processing_frees_only_the_phantoms_rows_and_counts_them(holed):
    serving, tokens = holed
    [req] = serving.admit([tokens])
    batch = serving.build_batch([req])
    serving.forward(batch)
    phantom = batch.reqs[0]
    free_slots, free_rows = serving.allocator.available_size(), serving.req_pool.available_size()
    before = dict(hooks.COUNTERS)
    seen = []

    def process(processor, batch, result):
        seen.append([r.finished() for r in batch.reqs])

    hooks._process_prefill(process, None, batch, None)
    assert seen == [[True, False]]
    assert phantom.kv.req_pool_idx is None and serving.req_pool.available_size() == free_rows + 1
    assert serving.allocator.available_size() == free_slots  # the hole's slots are the tree's
    assert hooks.COUNTERS["phantom_tokens"] - before["phantom_tokens"] == 128
    assert hooks.COUNTERS["prefill_tokens"] - before["prefill_tokens"] == 128 + len(tokens) - 512
    serving.check_row(req)


def test_a_request_gets_no_row_its_predecessors_phantoms_took(budget_hooks):
    serving = Serving(size=64 * 40, page_size=64, rows=2)
    system = blocks(1000, 2)
    a = system + blocks(1, 6)
    serving.prefill([a + [7]])
    serving.prefill([system + blocks(5000, 6) + [8]])
    serving.cache.evict(EvictParams(num_tokens=128))
    adder = new_adder(serving)
    holed, result = admit(serving, adder, a + [9])
    assert result == AddReqResult.CONTINUE and serving.cache.phantom_holes(holed) == [(128, 256)]
    other, result = admit(serving, adder, system + [5])
    assert result == AddReqResult.OTHER and adder.can_run_list == [holed]
    batch = serving.build_batch(adder.can_run_list)
    serving.forward(batch)
    serving.check_row(holed)
    serving.finish(batch)
    assert serving.accounting()[0] == serving.total


def test_the_prefix_aware_cpu_backend_takes_phantoms():
    """It stores the batch's K/V before it reads any prefix, as torch_native does."""
    assert Serving(size=64 * 40, page_size=64, backend="torch_native_prefix", refill="phantoms").cache.phantom_refill


class _CountedReads(torch.Tensor):
    """A req_to_token table that counts its reads back to the host (each one waits for a GPU)."""

    reads = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and "cpu" in map(str, [*args[1:], *kwargs.values()]):
            cls.reads += 1
        return super().__torch_function__(func, types, args, kwargs)


def test_a_batch_of_phantoms_reads_its_rows_back_once(budget_hooks):
    """Two requests with a hole each (sessions A and C lost their fronts): linking their phantoms'
    slots reads the table back to the host once for the whole batch."""
    serving = Serving(size=64 * 60, page_size=64)
    system = blocks(1000, 2)
    a, c = system + blocks(1, 6), system + blocks(3000, 6)
    for tokens in (a + [7], c + [7], system + blocks(5000, 6) + [8]):
        serving.prefill([tokens])
    serving.cache.evict(EvictParams(num_tokens=128))
    # A was used last: C is the next victim.
    serving.cache.cache.match(np.asarray(a, dtype=np.int64))
    serving.cache.evict(EvictParams(num_tokens=128))
    adder = new_adder(serving)
    reqs = [admit(serving, adder, tokens + blocks(9000, 1) + [9])[0] for tokens in (a, c)]
    assert [serving.cache.phantom_holes(r) for r in reqs] == [[(128, 256)], [(128, 256)]]
    serving.req_pool.req_to_token = serving.req_pool.req_to_token.as_subclass(_CountedReads)
    link = serving.cache.link_phantoms
    counted = []

    def counting(phantoms, *write_slots):
        _CountedReads.reads = 0
        link(phantoms, *write_slots)
        counted.append(_CountedReads.reads)

    serving.cache.link_phantoms = counting
    batch = serving.build_batch(adder.can_run_list)
    assert counted == [1] and len(batch.reqs) == 4
    serving.req_pool.req_to_token = serving.req_pool.req_to_token.as_subclass(torch.Tensor)
    serving.forward(batch)
    for req in reqs:
        serving.check_row(req)
    serving.finish(batch)
    assert serving.accounting()[0] == serving.total
    serving.cache.check_invariants()


def test_a_hole_two_phantoms_refill_in_one_batch_is_written_into_the_trees_slots(holed, budget_hooks):
    """Two turns of the same history in one batch, both missing [128, 256): the first phantom's
    slots go to the tree, the second phantom's are freed, so it must write the tree's slots too;
    writing its own freed slots, it could overwrite KV that a token of the same forward was given."""
    serving, tokens = holed
    adder = new_adder(serving)
    first, _ = admit(serving, adder, tokens)
    second, _ = admit(serving, adder, tokens[:-1] + [11])
    assert serving.cache.phantom_holes(first) == serving.cache.phantom_holes(second) == [(128, 256)]
    batch = serving.build_batch(adder.can_run_list)
    written = set(batch.out_cache_loc.tolist())
    # Every slot still free after linking: none of them may be written by this forward.
    free = serving.allocator.alloc(serving.allocator.available_size())
    assert not written & set(free.tolist())
    serving.allocator.free(free)
    phantoms = [r for r in batch.reqs if hooks.is_phantom(r)]
    rows = serving.req_pool.req_to_token
    assert torch.equal(rows[phantoms[0].kv.req_pool_idx, 128:256], rows[phantoms[1].kv.req_pool_idx, 128:256])
    serving.forward(batch)
    serving.check_row(first)
    serving.check_row(second)
    serving.finish(batch)
    assert serving.accounting()[0] == serving.total
    serving.cache.check_invariants()
    serving.check_tree_kv()


def test_a_chunk_the_full_pool_cannot_take_waits_for_the_running_requests(budget_hooks):
    """A chunked request whose next chunk finds the pool held by a running request: SGLang's
    budget is spent, so it would force a whole chunk on an allocator with no free page and stop
    the scheduler ("Prefill out of memory"). The chunk waits instead, and continues once the
    running request has finished."""
    serving = Serving(size=64 * 16, page_size=64)
    tokens = blocks(1, 10) + [5]
    adder = new_adder(serving, chunk=128)
    req, _ = admit(serving, adder, tokens)
    assert (req.prefix_len, req.extend_end) == (0, 128) and adder.new_chunked_req is req
    batch = serving.build_batch([req])
    serving.forward(batch)
    serving.finish(batch, keep_running=True)
    # Another request takes every other page and keeps running (decoding).
    [other] = serving.admit([blocks(5000, 13) + list(range(9000, 9063))])
    batch = serving.build_batch([other])
    serving.forward(batch)
    serving.finish(batch, keep_running=True)
    assert serving.allocator.available_size() == 0 and serving.cache.evictable_size() == 0
    parked = hooks.COUNTERS["parked_chunks"]
    following = PrefillAdder(64, serving.cache, serving.allocator, ScheduleBatch(reqs=[other]), 0.5, 16384, 128)
    req.init_next_round_input()
    assert hooks._continue_chunk(PrefillAdder.add_chunked_req, following, req) is req
    assert following.can_run_list == [] and hooks.COUNTERS["parked_chunks"] == parked + 1
    assert req.prefix_len == 128
    # The running request finishes: its KV becomes evictable and the chunks go on to the end.
    serving.release(other)
    serve_whole_prefill(serving, req, chunk=128)
    assert serving.accounting()[0] == serving.total
    serving.cache.check_invariants()


def test_after_a_hole_first_cut_only_requests_that_fit_whole_join_the_batch(budget_hooks):
    """A hole-first request's chunk stops at its hole's end and leaves chunk budget: a request
    cut after it would replace it as the step's one chunked request (SGLang tracks one), and the
    first would leave prefill with its prompt half computed. Only requests that fit whole join."""
    serving = Serving(size=64 * 40, page_size=64, refill="hole-first")
    system, history = serving.lose_front()
    adder = new_adder(serving, chunk=512)
    first, _ = admit(serving, adder, history + blocks(9000, 1) + [9])
    assert (first.prefix_len, first.extend_end) == (128, 256) and adder.new_chunked_req is first
    assert adder.rem_chunk_tokens == 384
    cut, result = admit(serving, adder, blocks(7000, 8) + [1])
    assert result == AddReqResult.OTHER and cut not in adder.can_run_list and adder.new_chunked_req is first
    whole, _ = admit(serving, adder, system + [3, 4])
    assert adder.can_run_list == [first, whole] and adder.new_chunked_req is first
