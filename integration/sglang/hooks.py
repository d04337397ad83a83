"""Scheduler hooks that refill holes in SGLang 0.5.23 (through ``HookRegistry``).

When ``PenelopeRadixCache`` reports a match with holes (missing blocks before the last resident
span), admission decides how they are refilled (``penelope.cache.refill``, ``plan_admission``):

- phantoms: one prefill-only phantom request per hole joins the request's batch; its prefix is the
  cached history before the hole, its extend the hole, at the hole's original positions. Every
  layer stores the whole batch's K/V before attention runs, so the real request reads the hole's
  K/V in the layer that wrote it (on any attention backend that attends through the request's
  ``req_to_token`` row).
- hole-first chunks, when the holes and a page of the request's own tokens do not fit the step's
  chunk budget or rows run short: the request starts at its first hole, its chunks stop at hole
  ends, and between chunks it jumps over the resident spans (``continue_chunk``).

| target (AROUND hooks)                                   | what the hook does                          |
|---------------------------------------------------------|---------------------------------------------|
| ``PrefillAdder.add_one_req``                            | plans the refill against the chunk budget   |
|                                                         | and the free request rows                   |
| ``PrefillAdder._request_slot_reserve_for_req``          | phantom tokens to the request's KV reserve    |
| ``PrefillAdder._replay_len``                            | phantom tokens to the prefill compute budget  |
| ``PrefillAdder._check_prefill_budget``                  | a hole-first request is not charged the     |
|                                                         | resident spans it jumps over                |
| ``PrefillAdder.add_chunked_req``                        | hole-first jumps; the chunk stops at the    |
|                                                         | hole's end and fits the free pool, or waits |
| ``ScheduleBatch.init_new``                              | the phantoms, each before its request         |
| ``ScheduleBatch.prepare_for_extend``                    | phantoms' slots handed to the tree and linked |
|                                                         | into the request's row                      |
| ``ForwardBatch.init_new``                               | ``penelope_segments`` for the attention     |
| ``PrefillCudaGraphRunner.load_batch``                   | the segments kept on the batch it rebuilds  |
|                                                         | for a prefill CUDA graph replay             |
| ``SchedulerBatchResultProcessor.process_batch_result_prefill`` | phantoms' rows freed; prefill tokens   |
|                                                         | counted                                     |
| ``SchedulerInternalStateController.get_internal_state`` | ``penelope`` counters in get_server_info    |

A phantom is created finished (``PhantomFinished``): SGLang never streams it, never commits its
output and filters it out of every running batch. Every hook passes other caches' batches and
requests without holes straight through.
Not handled: pipeline parallelism, PD disaggregation, speculative decoding, dLLM batches.
"""
from __future__ import annotations

import copy
import logging
import time

import torch
from sglang.srt.managers.schedule_batch import BaseFinishReason, Req
from sglang.srt.managers.schedule_policy import AddReqResult

from penelope.cache.phantom import segment_rows

from . import cache_timer
from .patching import applied, register_around
from .radix_cache import PenelopeRadixCache

logger = logging.getLogger(__name__)

# Attribute on a phantom Req: the real request whose hole it refills.
PHANTOM_OF = "penelope_phantom_of"
# Attribute on a ForwardBatch holding phantoms: int32 [N, 4] segments (req_row, q_start,
# pos_start, length), one per request, as `penelope.kernels.ragged_prefill_attention` takes them.
SEGMENTS = "penelope_segments"
# Attribute on a new ScheduleBatch until its rows are linked: [(request, its phantoms)].
_PHANTOMS = "penelope_phantoms"
# Attribute on a PrefillAdder: rows its admitted requests' phantoms will take.
_PHANTOM_ROWS = "penelope_phantom_rows"

_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
_BATCH = "sglang.srt.managers.schedule_batch.ScheduleBatch"
_FORWARD = "sglang.srt.model_executor.forward_batch_info.ForwardBatch"
_PREFILL_GRAPH = "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner"
_RESULTS = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
_STATE = "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController"

# Per scheduler process: tokens of every prefill batch (phantoms included) and of phantoms alone.
# `prefill_positions` sums the positions of those tokens: the attention query-key pairs they cost,
# per layer and head.
# `ragged_batches`: phantom batches the ragged kernel of ``attention.py`` ran. `parked_chunks`:
# steps a chunked request waited because the pool could not take a page of its next chunk.
COUNTERS = {"prefill_tokens": 0, "prefill_positions": 0, "prefill_batches": 0, "phantom_tokens": 0, "phantoms": 0,
            "ragged_batches": 0, "parked_chunks": 0}


class PhantomFinished(BaseFinishReason):
    """Finish reason of a phantom: its forward runs, it never has an output."""

    def to_json(self):
        return {"type": "penelope_phantom"}


def is_phantom(req) -> bool:
    return getattr(req, PHANTOM_OF, None) is not None


def make_phantom(real: Req, start: int, end: int) -> Req:
    """A prefill-only request computing positions [start, end) of `real`'s tokens on top of the
    cached prefix [0, start) that `real`'s lock holds. Created finished, so SGLang never streams
    it or lets it decode."""
    tokens = real.full_untruncated_fill_ids[:end]
    phantom = Req(f"{real.rid}.penelope-hole-{start}-{end}", "", tokens, copy.copy(real.sampling_params),
                  lora_id=real.lora_id, vocab_size=real.vocab_size, eos_token_ids=real.eos_token_ids,
                  extra_key=real.extra_key)
    phantom.refresh_fill_ids()
    phantom.tokenizer = real.tokenizer
    # -1: no input log-probabilities, so a logprob batch gives the phantom zero logprob rows.
    phantom.logprob_start_len = -1
    phantom.prefix_len = start
    phantom.extend_end = end
    phantom.last_node = real.last_node
    phantom.kv.cache_protected_len = start
    phantom.finished_reason = PhantomFinished()
    phantom.finished_output = True
    setattr(phantom, PHANTOM_OF, real)
    return phantom


def free_rows_for(adder) -> int:
    """Request rows still free for the next admission of `adder`: the pool's free rows minus the
    rows its admitted requests and their phantoms will take."""
    pool = adder.tree_cache.req_to_token_pool
    taken = sum(req.kv.req_pool_idx is None for req in adder.can_run_list)
    return pool.available_size() - taken - getattr(adder, _PHANTOM_ROWS, 0)


def _admit(original, adder, req, has_chunked_req, truncation_align_size):
    cache = adder.tree_cache
    if not isinstance(cache, PenelopeRadixCache):
        return original(adder, req, has_chunked_req, truncation_align_size)
    rows = free_rows_for(adder)
    if rows < 1 and req.kv.req_pool_idx is None:
        # Phantoms took the rows SGLang counted on: this request gets none this step.
        return AddReqResult.OTHER
    if not cache.load_for(req):
        # Its CPU spans cannot come back to the GPU now: too much KV is locked.
        return AddReqResult.NO_TOKEN
    plan = cache.plan_admission(req, adder.rem_chunk_tokens, rows, truncation_align_size)
    chunking = has_chunked_req or adder.new_chunked_req is not None
    if chunking and adder.rem_chunk_tokens is not None and (
            (plan is not None and plan.hole_first) or _chunk_need(adder, req, cache) > adder.rem_chunk_tokens):
        # A chunked request continues past this step (from the last step, or cut at a hole's end
        # in this one) and SGLang tracks one at a time. Its chunk may have stopped short at a
        # hole's end, leaving budget SGLang never expects to see used while a chunk is in flight:
        # admit only what fits whole.
        return AddReqResult.OTHER
    if plan is None or plan.first_chunk_end is None:
        result = original(adder, req, has_chunked_req, truncation_align_size)
        if plan is not None and plan.phantoms and adder.can_run_list and adder.can_run_list[-1] is req:
            setattr(adder, _PHANTOM_ROWS, getattr(adder, _PHANTOM_ROWS, 0) + len(plan.phantoms))
            _count_phantoms_as_computed(adder, req, plan.phantom_tokens)
        return result
    # Hole-first: the first chunk must end where the first hole ends, never in the resident span
    # after it. SGLang chunks at rem_chunk_tokens; narrow it for this call and charge the rest.
    budget = adder.rem_chunk_tokens
    cap = min(budget, plan.first_chunk_end - plan.compute_from)
    adder.rem_chunk_tokens = cap
    if cap < budget:
        # A chunk that stops at a hole's end stops at a block boundary fixed by the cache, not at
        # the scheduler's alignment (deterministic mode's 4096 would round it down to nothing).
        truncation_align_size = None
    try:
        result = original(adder, req, has_chunked_req, truncation_align_size)
    finally:
        adder.rem_chunk_tokens = budget - (cap - adder.rem_chunk_tokens)
    return adder.budget_state() if adder.can_run_list and adder.can_run_list[-1] is req else result


def _count_phantoms_as_computed(adder, req, tokens: int) -> None:
    """SGLang counted a phantom request's whole prefix as cache hits and its phantoms' holes as
    replayed tokens; the holes were recomputed, so they are new tokens of this step, not hits."""
    adder.log_hit_tokens -= tokens
    adder.log_device_hit_tokens -= tokens
    adder.log_replay_tokens -= tokens
    adder.log_input_tokens += tokens
    if req.retracted_stain:
        adder.reprocessed_log_hit_tokens -= tokens
        adder.reprocessed_log_input_tokens += tokens


def _chunk_need(adder, req, cache: PenelopeRadixCache) -> int:
    """Chunk tokens `req` takes if admitted whole: its page-rounded extend and its phantoms."""
    extend = len(req.full_untruncated_fill_ids) - req.prefix_len
    return adder.ceil_paged_tokens(extend) + cache.hole_tokens(req)


def _check_budget(original, adder, req, *, extend_input_len, total_tokens, **kwargs):
    """SGLang charges a new request its whole prompt after its prefix; a hole-first request's
    prefix is its first hole, and the resident spans it jumps over hold their KV already. Charged
    to the pool budget that leaves them out (they are locked), a request with a long resident tail
    would never fit a nearly full pool, and the scheduler would wait beside it forever."""
    cache = adder.tree_cache
    if isinstance(cache, PenelopeRadixCache):
        jumped = cache.jumped_tokens(req)
        extend_input_len -= jumped
        total_tokens -= jumped
    return original(adder, req, extend_input_len=extend_input_len, total_tokens=total_tokens, **kwargs)


def _continue_chunk(original, adder, req):
    cache = adder.tree_cache
    if isinstance(cache, PenelopeRadixCache):
        before = req.prefix_len
        cap = cache.continue_chunk(req)
        # The resident span jumped over is read from the cache: a hit of this step, and of the
        # request (prepare_for_extend adds it to cached_tokens, but splits it by tier only once).
        jumped = req.prefix_len - before
        adder.log_hit_tokens += jumped
        adder.log_device_hit_tokens += jumped
        if jumped and not req.retracted_stain and req._cache_breakdown_computed:
            req.cached_tokens_device += jumped
        room = _continuation_room(adder, cache)
        if room < cache.page_size and adder.running_batch is not None and not adder.running_batch.is_empty():
            # The pool cannot take a page of this chunk now (the running requests hold it): the
            # request waits for them to finish, as SGLang parks a chunk, instead of SGLang
            # forcing a chunk the allocator must then refuse (which stops the scheduler).
            COUNTERS["parked_chunks"] += 1
            return req
        if room >= cache.page_size:
            cap = room if cap is None else min(cap, room)
        if cap is not None:
            limit = adder.chunked_req_limit
            adder.chunked_req_limit = cap if limit is None else min(limit, cap)
    return original(adder, req)


def _continuation_room(adder, cache: PenelopeRadixCache) -> int:
    """Tokens (whole pages) a chunked request's next chunk can be given slots for in this step:
    free and evictable slots, less what the step's admissions reserved and one page of the
    allocator's alignment. SGLang caps the chunk by its budget, which also counts the running
    requests' future decode tokens, but forces a whole chunk when that budget is spent."""
    page = cache.page_size
    room = (cache.token_to_kv_pool_allocator.available_size() + cache.evictable_size()
            - adder.memory_budget.current_offset - page)
    return max(room, 0) // page * page


def _reserve_hole_slots(original, adder, req, *args, **kwargs):
    reserve = original(adder, req, *args, **kwargs)
    if isinstance(adder.tree_cache, PenelopeRadixCache):
        reserve += adder.tree_cache.hole_tokens(req)
    return reserve


def _charge_hole_compute(original, adder, req, prefix_len):
    replay = original(adder, req, prefix_len)
    if isinstance(adder.tree_cache, PenelopeRadixCache):
        replay += adder.tree_cache.hole_tokens(req)
    return replay


def _add_phantoms(original, cls, reqs, req_to_token_pool, token_to_kv_pool_allocator, tree_cache, *args, **kwargs):
    holed = []  # (request, its phantoms)
    if isinstance(tree_cache, PenelopeRadixCache):
        with_phantoms = []
        for req in reqs:
            holes = tree_cache.phantom_holes(req)
            phantoms = [make_phantom(req, start, end) for start, end in holes]
            with_phantoms.extend(phantoms)
            with_phantoms.append(req)
            if phantoms:
                holed.append((req, phantoms))
        reqs = with_phantoms if holed else reqs
    batch = original(cls, reqs, req_to_token_pool, token_to_kv_pool_allocator, tree_cache, *args, **kwargs)
    if holed:
        setattr(batch, _PHANTOMS, holed)
    return batch


def _link_rows(original, batch):
    result = original(batch)
    holed = getattr(batch, _PHANTOMS, None)
    if holed:
        # Where each phantom's K/V rows are written in the batch's out_cache_loc.
        offsets, position = {}, 0
        for req, length in zip(batch.reqs, batch.extend_lens, strict=True):
            offsets[id(req)] = position
            position += length
        batch.tree_cache.link_phantoms(holed, batch.out_cache_loc, offsets)
        for req, phantoms in holed:
            if not req.retracted_stain:
                # prepare_for_extend counted the request's whole prefix as cached; its phantoms'
                # holes are computed by this batch (users bill and route on cached_tokens).
                holes = sum(p.extend_len for p in phantoms)
                req.cached_tokens -= holes
                req.cached_tokens_device = max(req.cached_tokens_device - holes, 0)
        setattr(batch, _PHANTOMS, None)
    return result


def _attach_segments(original, cls, batch, model_runner, **kwargs):
    forward_batch = original(cls, batch, model_runner, **kwargs)
    # SGLang hands copies of its batches around: look at the requests, not at batch attributes.
    if batch.forward_mode.is_extend_without_speculative() and any(map(is_phantom, batch.reqs)):
        # A host tensor: the ragged kernel plans from it without waiting for the GPU.
        setattr(forward_batch, SEGMENTS, extend_segments(batch.reqs, batch.prefix_lens, batch.extend_lens, "cpu"))
    return forward_batch


def _keep_segments(original, runner, forward_batch, **kwargs):
    static_batch, read_ends = original(runner, forward_batch, **kwargs)
    # A prefill CUDA graph replay rebuilds the ForwardBatch field by field, and attention runs
    # eagerly (between captured segments) against the rebuilt one: the segments must come along,
    # or phantom batches would leave the ragged kernel whenever a graph runs them. Set even when
    # None, so a rebuilt batch never carries another batch's segments.
    setattr(static_batch, SEGMENTS, getattr(forward_batch, SEGMENTS, None))
    return static_batch, read_ends


def extend_segments(reqs: list, prefix_lens: list[int], extend_lens: list[int], device="cpu") -> torch.Tensor:
    """int32 [len(reqs), 4] rows (req_row, q_start, pos_start, length) of an extend batch, on `device`."""
    spans = [(req.kv.req_pool_idx, prefix, length)
             for req, prefix, length in zip(reqs, prefix_lens, extend_lens, strict=True)]
    return torch.from_numpy(segment_rows(spans)).to(device)


def release_phantom_rows(reqs: list, req_to_token_pool) -> None:
    """Give back the phantoms' request rows; their KV slots belong to the tree already."""
    for req in reqs:
        if is_phantom(req) and req.kv.req_pool_idx is not None:
            req_to_token_pool.free(req)
            req.kv.mark_kv_released()


def _process_prefill(original, processor, batch, result):
    out = original(processor, batch, result)
    COUNTERS["prefill_batches"] += 1
    COUNTERS["prefill_tokens"] += sum(batch.extend_lens)
    COUNTERS["prefill_positions"] += sum(n * p + n * (n - 1) // 2 for p, n in zip(batch.prefix_lens, batch.extend_lens,
                                                                                 strict=True))
    phantoms = [req for req in batch.reqs if is_phantom(req)]
    if phantoms:
        COUNTERS["phantoms"] += len(phantoms)
        COUNTERS["phantom_tokens"] += sum(req.extend_len for req in phantoms)
        release_phantom_rows(phantoms, batch.req_to_token_pool)
    return out


def _report_counters(original, controller, recv_req):
    out = original(controller, recv_req)
    state = getattr(out, "internal_state", None)
    if isinstance(state, dict):
        scheduler = getattr(controller, "scheduler", None)
        cache = getattr(scheduler, "tree_cache", None)
        chunked = getattr(scheduler, "chunked_req", None)
        stats = cache.stats() if isinstance(cache, PenelopeRadixCache) else {}
        # The timer's readings as one copy (`cache_timer.snapshot`; its `stats` is never timed).
        state["penelope"] = {**COUNTERS, **cache_timer.snapshot(), "process_cpu_s": time.process_time(),
                             "chunked_rid": chunked.rid if chunked is not None else None, **stats}
    return out


HOOKS = {
    f"{_ADDER}.add_one_req": _admit,
    f"{_ADDER}.add_chunked_req": _continue_chunk,
    f"{_ADDER}._request_slot_reserve_for_req": _reserve_hole_slots,
    f"{_ADDER}._replay_len": _charge_hole_compute,
    f"{_ADDER}._check_prefill_budget": _check_budget,
    f"{_BATCH}.init_new": _add_phantoms,
    f"{_BATCH}.prepare_for_extend": _link_rows,
    f"{_FORWARD}.init_new": _attach_segments,
    f"{_PREFILL_GRAPH}.load_batch": _keep_segments,
    f"{_RESULTS}.process_batch_result_prefill": _process_prefill,
    f"{_STATE}.get_internal_state": _report_counters,
}


def register_hooks() -> None:
    """Register the hooks with SGLang's HookRegistry (``load_plugins`` applies them). Idempotent."""
    register_around(HOOKS)


def hooks_active() -> bool:
    """Whether every hook above has been applied to SGLang's classes in this process."""
    return applied(HOOKS)
