"""Scheduler hooks that run phantom requests in SGLang 0.5.23 (through ``HookRegistry``).

When ``PenelopeRadixCache`` reports a match with holes (missing blocks before the last resident
span), the request is admitted at the end of that span. These hooks add one prefill-only phantom
request per hole to the same batch: its prefix is the cached history before the hole, its extend
is the hole, at the hole's original positions. Every layer stores the whole batch's K/V before
attention runs, so the real request reads the hole's K/V in the same layer that wrote it (with
SGLang's Triton backend as with Penelope's ragged kernel).

| target (AROUND hooks)                                   | what the hook adds                          |
|---------------------------------------------------------|---------------------------------------------|
| ``PrefillAdder._request_slot_reserve_for_req``          | hole tokens to the request's KV reserve     |
| ``PrefillAdder._replay_len``                            | hole tokens to the prefill compute budget   |
| ``ScheduleBatch.init_new``                              | the phantoms, each before its request       |
| ``ScheduleBatch.prepare_for_extend``                    | phantom slots copied into the request's row |
|                                                         | (and later phantoms' rows); the cache holds |
|                                                         | them as the request's until its checkpoint  |
| ``ForwardBatch.init_new``                               | ``penelope_segments`` for the attention     |
| ``ScheduleBatch.filter_batch``                          | phantoms never join the running batch       |
| ``SchedulerBatchResultProcessor.process_batch_result_prefill`` | phantoms finish unseen (no output,   |
|                                                         | no checkpoint); their rows, not their KV    |
|                                                         | slots, are freed                            |

Every hook passes batches without phantoms (and caches other than Penelope's) straight through.
Not handled: pipeline parallelism, PD disaggregation, speculative decoding, dLLM batches.
"""
from __future__ import annotations

import copy
import inspect
import logging

import torch
from sglang.srt.managers.schedule_batch import BaseFinishReason, Req
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from .radix_cache import PenelopeRadixCache

logger = logging.getLogger(__name__)

# Attribute on a phantom Req: the real request whose hole it refills.
PHANTOM_OF = "penelope_phantom_of"
# Attribute on a ForwardBatch holding phantoms: int32 [N, 4] segments (req_row, q_start,
# pos_start, length), one per request, as `penelope.kernels.ragged_prefill_attention` takes them.
SEGMENTS = "penelope_segments"

_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
_BATCH = "sglang.srt.managers.schedule_batch.ScheduleBatch"
_FORWARD = "sglang.srt.model_executor.forward_batch_info.ForwardBatch"
_RESULTS = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"


class PhantomFinished(BaseFinishReason):
    """Finish reason of a phantom: its forward ran, it never had an output."""

    def to_json(self):
        return {"type": "penelope_phantom"}


def is_phantom(req) -> bool:
    return getattr(req, PHANTOM_OF, None) is not None


def make_phantom(real: Req, start: int, end: int) -> Req:
    """A prefill-only request computing positions [start, end) of `real`'s tokens on top of the
    cached prefix [0, start) that `real`'s match holds (its lock covers the phantom too)."""
    tokens = real.full_untruncated_fill_ids[:end]
    phantom = Req(f"{real.rid}.penelope-hole-{start}-{end}", "", tokens, copy.copy(real.sampling_params),
                  lora_id=real.lora_id, vocab_size=real.vocab_size, eos_token_ids=real.eos_token_ids)
    phantom.refresh_fill_ids()
    phantom.tokenizer = real.tokenizer
    # -1: no input log-probabilities, so a logprob batch gives the phantom zero logprob rows.
    phantom.logprob_start_len = -1
    phantom.prefix_len = start
    phantom.extend_end = end
    phantom.last_node = real.last_node
    phantom.kv.cache_protected_len = start
    setattr(phantom, PHANTOM_OF, real)
    return phantom


def with_phantoms(reqs: list, cache: PenelopeRadixCache, req_to_token_pool) -> list:
    """`reqs` with each request's phantoms inserted before it (a new list). A request whose
    phantoms would not get request rows gives up its holes (``drop_holes``)."""
    rows_left = req_to_token_pool.available_size() - sum(r.kv.req_pool_idx is None for r in reqs)
    out = []
    for req in reqs:
        holes = cache.phantom_holes(req)
        if len(holes) > rows_left:
            logger.warning("penelope: no request rows for %d phantoms of %s; recomputing after its first hole",
                           len(holes), req.rid)
            cache.drop_holes(req)
            holes = []
        rows_left -= len(holes)
        out.extend(make_phantom(req, start, end) for start, end in holes)
        out.append(req)
    return out


def phantom_groups(reqs: list) -> list[tuple[Req, list[Req]]]:
    """(real request, its phantoms in position order) for every request with phantoms."""
    groups: dict[int, tuple[Req, list[Req]]] = {}
    for req in reqs:
        if is_phantom(req):
            real = getattr(req, PHANTOM_OF)
            groups.setdefault(id(real), (real, []))[1].append(req)
    return [(real, sorted(phantoms, key=lambda p: p.prefix_len)) for real, phantoms in groups.values()]


def link_phantom_rows(reqs: list, req_to_token_pool, cache: PenelopeRadixCache) -> None:
    """After allocation: the slots a phantom got for its hole go into its request's row and into
    the rows of the request's later phantoms (whose prefixes contain the hole); the request owns
    them from now on."""
    table = req_to_token_pool.req_to_token
    for real, phantoms in phantom_groups(reqs):
        for i, phantom in enumerate(phantoms):
            start, end = phantom.prefix_len, phantom.extend_end
            slots = table[phantom.kv.req_pool_idx, start:end].clone()
            for req in [real, *phantoms[i + 1:]]:
                table[req.kv.req_pool_idx, start:end] = slots
            # The hole's slots are now the request's (counted by the cache until its checkpoint);
            # SGLang's accounting must not count them for the phantom as well.
            phantom.kv.cache_protected_len = end
        cache.hold_refills(real, [(p.prefix_len, p.extend_end) for p in phantoms])


def extend_segments(reqs: list, prefix_lens: list[int], extend_lens: list[int], device) -> torch.Tensor:
    """int32 [len(reqs), 4] rows (req_row, q_start, pos_start, length) of an extend batch."""
    rows, start = [], 0
    for req, prefix, length in zip(reqs, prefix_lens, extend_lens, strict=True):
        rows.append((req.kv.req_pool_idx, start, prefix, length))
        start += length
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 4).to(device)


def retire_phantoms(reqs: list) -> None:
    """Mark phantoms finished and already streamed, so result processing skips them."""
    for req in reqs:
        if is_phantom(req) and req.finished_reason is None:
            req.finished_reason = PhantomFinished()
            req.finished_output = True


def release_phantom_rows(reqs: list, req_to_token_pool) -> None:
    """Give back the phantoms' request rows; their KV slots now belong to the real requests."""
    for req in reqs:
        if is_phantom(req) and req.kv.req_pool_idx is not None:
            req_to_token_pool.free(req)
            req.kv.mark_kv_released()


def _bind(original, args, kwargs) -> inspect.BoundArguments:
    return inspect.signature(original).bind(*args, **kwargs)


def _reserve_hole_slots(original, adder, req, *args, **kwargs):
    reserve = original(adder, req, *args, **kwargs)
    if isinstance(adder.tree_cache, PenelopeRadixCache):
        reserve += adder.tree_cache.hole_tokens(req, req.prefix_len)
    return reserve


def _charge_hole_compute(original, adder, req, prefix_len, *args, **kwargs):
    replay = original(adder, req, prefix_len, *args, **kwargs)
    if isinstance(adder.tree_cache, PenelopeRadixCache):
        replay += adder.tree_cache.hole_tokens(req, prefix_len)
    return replay


def _add_phantoms(original, *args, **kwargs):
    call = _bind(original, args, kwargs)
    cache = call.arguments["tree_cache"]
    if isinstance(cache, PenelopeRadixCache):
        call.arguments["reqs"] = with_phantoms(call.arguments["reqs"], cache, call.arguments["req_to_token_pool"])
    return original(*call.args, **call.kwargs)


def _link_rows(original, batch, *args, **kwargs):
    result = original(batch, *args, **kwargs)
    if isinstance(batch.tree_cache, PenelopeRadixCache) and any(map(is_phantom, batch.reqs)):
        link_phantom_rows(batch.reqs, batch.req_to_token_pool, batch.tree_cache)
    return result


def _attach_segments(original, *args, **kwargs):
    forward_batch = original(*args, **kwargs)
    batch = _bind(original, args, kwargs).arguments["batch"]
    if batch.forward_mode.is_extend_without_speculative() and any(map(is_phantom, batch.reqs)):
        device = batch.req_to_token_pool.req_to_token.device
        setattr(forward_batch, SEGMENTS, extend_segments(batch.reqs, batch.prefix_lens, batch.extend_lens, device))
    return forward_batch


def _exclude_phantoms(original, batch, *args, **kwargs):
    call = _bind(original, (batch, *args), kwargs)
    phantoms = [req for req in batch.reqs if is_phantom(req)]
    if phantoms and call.arguments.get("keep_indices") is None:
        excluded = call.arguments.get("reqs_to_exclude")
        excluded = [] if excluded is None else [excluded] if isinstance(excluded, Req) else list(excluded)
        call.arguments["reqs_to_exclude"] = excluded + phantoms
    return original(*call.args, **call.kwargs)


def _process_without_phantoms(original, processor, batch, *args, **kwargs):
    retire_phantoms(batch.reqs)
    result = original(processor, batch, *args, **kwargs)
    release_phantom_rows(batch.reqs, batch.req_to_token_pool)
    return result


HOOKS = {
    f"{_ADDER}._request_slot_reserve_for_req": _reserve_hole_slots,
    f"{_ADDER}._replay_len": _charge_hole_compute,
    f"{_BATCH}.init_new": _add_phantoms,
    f"{_BATCH}.prepare_for_extend": _link_rows,
    f"{_FORWARD}.init_new": _attach_segments,
    f"{_BATCH}.filter_batch": _exclude_phantoms,
    f"{_RESULTS}.process_batch_result_prefill": _process_without_phantoms,
}


def register_hooks() -> None:
    """Register the hooks with SGLang's HookRegistry (``load_plugins`` applies them). Idempotent."""
    for target, hook in HOOKS.items():
        if not any(registered is hook for _, registered, _ in HookRegistry._hooks.get(target, ())):
            HookRegistry.register(target, hook, HookType.AROUND)


def hooks_active() -> bool:
    """Whether every hook above has been applied to SGLang's classes in this process."""
    return all(target in HookRegistry._patched for target in HOOKS)
