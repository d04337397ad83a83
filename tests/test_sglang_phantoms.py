"""The phantom-request hooks on SGLang 0.5.23's real PrefillAdder, Req and ScheduleBatch (CPU)."""
import inspect
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang_env import Serving, blocks, sglang_config

from penelope.integration.sglang import hooks


@pytest.fixture(autouse=True)
def _config():
    with sglang_config():
        yield


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


def admit_with(serving, tokens):
    """A real PrefillAdder admission of one request, with or without the budget hooks."""
    adder = PrefillAdder(64, serving.cache, serving.allocator, ScheduleBatch(reqs=[]), 0.5, 16384, 8192)
    req = serving.new_request(tokens)
    req.init_next_round_input(serving.cache)
    assert adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None) == AddReqResult.CONTINUE
    return adder, req


def test_admission_charges_the_phantom_tokens(holed, monkeypatch):
    serving, tokens = holed
    plain, plain_req = admit_with(serving, tokens)
    serving.cache.unlock(plain_req.lock)
    for name, hook in (("_request_slot_reserve_for_req", hooks._reserve_hole_slots),
                       ("_replay_len", hooks._charge_hole_compute)):
        original = getattr(PrefillAdder, name)
        monkeypatch.setattr(PrefillAdder, name,
                            lambda self, *a, _o=original, _h=hook, **k: _h(_o, self, *a, **k))
    adder, req = admit_with(serving, tokens)
    assert req.prefix_len == 512 and req.extend_end == len(tokens)
    assert adder.log_replay_tokens - plain.log_replay_tokens == 128
    assert plain.rem_chunk_tokens - adder.rem_chunk_tokens == 128
    assert plain.rem_input_tokens - adder.rem_input_tokens == 128
    assert adder.memory_budget.total_offset - plain.memory_budget.total_offset == 128
    # The admitted request runs with its phantom exactly as the scheduler would run it.
    batch = serving.build_batch(adder.can_run_list)
    serving.forward(batch)
    serving.check_row(req)
    serving.finish(batch)
    assert serving.accounting()[0] == serving.total
    serving.cache.check_invariants()


def test_phantom_computes_the_hole_at_its_original_positions(holed):
    serving, tokens = holed
    [req] = serving.admit([tokens])
    [phantom] = [hooks.make_phantom(req, start, end) for start, end in req.last_node.holes]
    assert hooks.is_phantom(phantom) and not hooks.is_phantom(req)
    assert list(phantom.full_untruncated_fill_ids) == tokens[:256]
    assert (phantom.prefix_len, phantom.extend_end, phantom.extend_len) == (128, 256, 128)
    assert phantom.last_node is req.last_node and phantom.logprob_start_len == -1
    assert phantom.rid == f"{req.rid}.penelope-hole-128-256"


def test_batch_rows_segments_and_filtering(holed):
    serving, tokens = holed
    [req] = serving.admit([tokens])
    [other] = serving.admit([blocks(1000, 2) + [3, 4, 5]])
    batch = serving.build_batch([req, other])
    phantom = batch.reqs[0]
    assert [hooks.is_phantom(r) for r in batch.reqs] == [True, False, False]
    table = serving.req_pool.req_to_token
    assert torch.equal(table[req.kv.req_pool_idx, 128:256], table[phantom.kv.req_pool_idx, 128:256])
    assert phantom.kv.cache_protected_len == 256  # the hole's slots count as the request's

    def init_new(cls, batch, model_runner, *, capture_hidden_mode=None, return_hidden_states_before_norm):
        return SimpleNamespace()

    assert list(inspect.signature(init_new).parameters)[:3] == list(
        inspect.signature(ForwardBatch.init_new.__func__).parameters)[:3]
    forward_batch = hooks._attach_segments(init_new, ForwardBatch, batch, None, return_hidden_states_before_norm=False)
    rows = [r.kv.req_pool_idx for r in batch.reqs]
    extend = len(tokens) - 512
    assert getattr(forward_batch, hooks.SEGMENTS).tolist() == [
        [rows[0], 0, 128, 128], [rows[1], 128, 512, extend], [rows[2], 128 + extend, 128, 3]]

    # Phantoms never join the running batch (SGLang filters last_batch before merging it).
    hooks._exclude_phantoms(ScheduleBatch.filter_batch, batch, [])
    assert batch.reqs == [req, other]


def test_result_processing_skips_phantoms_and_frees_only_their_rows(holed):
    serving, tokens = holed
    [req] = serving.admit([tokens])
    batch = serving.build_batch([req])
    serving.forward(batch)
    phantom = batch.reqs[0]
    free_slots, free_rows = serving.allocator.available_size(), serving.req_pool.available_size()
    seen = []

    def process(processor, batch, result):
        seen.append([(r.finished(), r.finished_output) for r in batch.reqs])

    hooks._process_without_phantoms(process, None, batch, None)
    assert seen == [[(True, True), (False, None)]]
    assert phantom.kv.req_pool_idx is None and serving.req_pool.available_size() == free_rows + 1
    assert serving.allocator.available_size() == free_slots  # the hole's slots are the request's
    serving.check_row(req)
