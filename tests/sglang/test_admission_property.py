"""Admission never stalls: SGLang 0.5.23's real PrefillAdder with every Penelope hook applied, on
SGLang's real CPU pools, over random cache states (a history whose front or middle was evicted
while other histories fill the pool), chunk sizes, ``max_prefill_tokens``, chunk alignment,
backends with and without phantoms, and phantoms on or off.

A stand-in for the scheduler's loop drives the steps (``step``: continue the chunked request,
then offer the waiting one, then the batch's forward and result processing, as
``get_new_batch_prefill`` does). The property: while nothing else runs, every step makes progress
(the waiting request is admitted or its chunk continues), and the request's prefill completes
with every position of its row holding that position's KV. While another request runs, waiting
is allowed; once it finishes, the same holds. SGLang's real Engine runs the same hooks in
``tests/sglang/test_engine.py`` (the front-hole and 32K tests)."""
from __future__ import annotations

import contextlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.schedule_policy import PrefillAdder
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang_env import Serving, blocks, sglang_config

from penelope.integration.sglang import hooks

PAGE = 64
_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder."


@contextlib.contextmanager
def adder_hooks():
    """Penelope's hooks around PrefillAdder's methods, as HookRegistry applies them."""
    saved = {}
    for target, hook in hooks.HOOKS.items():
        if target.startswith(_ADDER):
            name = target.removeprefix(_ADDER)
            original = saved[name] = PrefillAdder.__dict__[name]
            setattr(PrefillAdder, name, lambda self, *a, _o=original, _h=hook, **k: _h(_o, self, *a, **k))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(PrefillAdder, name, original)


@st.composite
def scenarios(draw):
    system = draw(st.integers(0, 3))
    history = draw(st.integers(4, 30))
    others = draw(st.lists(st.integers(1, 12), max_size=3))
    slack = draw(st.integers(1, 6))
    new = draw(st.integers(1, 3 * PAGE))
    chunk = draw(st.one_of(st.none(), st.integers(1, 64).map(lambda k: k * PAGE)))
    # SGLang admits a request only when its prompt, a decode token and a page of slack fit the pool.
    fits = system + history + new // PAGE + 3
    return {
        "system": system, "history": history, "others": others,
        "pool_blocks": max(system + history + sum(others) + slack, fits),
        "evictions": draw(st.lists(st.integers(1, 12), min_size=1, max_size=3)),
        "new": new,
        "chunk": chunk,
        "max_prefill": draw(st.sampled_from([None, 2048, 16384])),
        "align": draw(st.sampled_from([None, 256])) if chunk is not None and chunk % 256 == 0 else None,
        "policy": draw(st.sampled_from(["penelope", "leaf-head-block", "private-head-node"])),
        "backend": draw(st.sampled_from(["torch_native", "flashinfer"])),
        "phantoms": draw(st.booleans()),
        "running": draw(st.booleans()),
        "rows": draw(st.integers(2, 8)),
    }


def lay_out(s: dict) -> tuple[Serving, list[int]]:
    """Cache the history, then the other histories (the history is least recently used), then
    evict in rounds, each followed by a touch of another history, so holes form in the history."""
    serving = Serving(size=s["pool_blocks"] * PAGE, page_size=PAGE, rows=s["rows"], policy=s["policy"],
                      phantoms=s["phantoms"], backend=s["backend"], max_context=8192)
    system = blocks(100_000, s["system"])
    history = system + blocks(1, s["history"])
    serving.prefill([history + [7]])
    others = [system + blocks(200_000 + 1000 * i, n) for i, n in enumerate(s["others"])]
    for other in others:
        serving.prefill([other + [8]])
    for i, n in enumerate(s["evictions"]):
        serving.cache.evict(EvictParams(num_tokens=n * PAGE))
        if others:
            serving.prefill([others[i % len(others)] + [9]])
    return serving, history + blocks(900_000, s["new"] // PAGE) + [5] * (s["new"] % PAGE or 1)


def new_adder(serving: Serving, s: dict) -> PrefillAdder:
    return PrefillAdder(PAGE, serving.cache, serving.allocator, ScheduleBatch(reqs=[]), 0.5,
                        s["max_prefill"] or 16384, s["chunk"])


def serve(serving: Serving, s: dict, tokens: list[int], blocker=None) -> int:
    """Steps until the request's prefill completes; returns how many. Fails on a step that makes
    no progress while nothing else runs."""
    req, chunked = None, None
    for steps in range(1, 200):
        adder = new_adder(serving, s)
        if chunked is not None:
            chunked.init_next_round_input()
            left = adder.add_chunked_req(chunked)
            assert chunked in adder.can_run_list, "a continuing chunk was not scheduled"
        else:
            req = serving.new_request(tokens)
            req.init_next_round_input(serving.cache)
            result = adder.add_one_req(req, has_chunked_req=False, truncation_align_size=s["align"])
            if req not in adder.can_run_list:
                assert blocker is not None, f"step {steps}: {result} beside an idle scheduler ({req.prefix_len=})"
                # Another request runs: the waiting one may wait until it finishes.
                serving.release(blocker)
                blocker = None
                continue
            left = adder.new_chunked_req
        batch = serving.build_batch(adder.can_run_list)
        serving.forward(batch)
        serving.check_row(req)
        done = req.extend_end == len(tokens)
        serving.finish(batch, keep_running=not done)
        if done:
            assert left is None
            return steps
        serving.running.remove(req)
        chunked = req
    raise AssertionError("the request's prefill did not complete in 200 steps")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_a_waiting_request_is_admitted_unless_something_else_runs(s):
    with sglang_config(), adder_hooks():
        serving, tokens = lay_out(s)
        blocker = None
        if s["running"] and s["others"]:
            # Another session's turn is running: it holds its path and its slots.
            [blocker] = serving.prefill([blocks(100_000, s["system"]) + blocks(200_000, s["others"][0]) + [3]],
                                       keep_running=True) or [None]
        serve(serving, s, tokens, blocker)
        if blocker is not None and blocker in serving.running:
            serving.release(blocker)
        assert serving.accounting()[0] == serving.total
        serving.cache.check_invariants()
        serving.check_tree_kv()


def test_the_idle_scheduler_check_can_fail():
    """Without the budget hook a hole-first request in a nearly full pool waits beside an idle
    scheduler: the property above sees it."""
    s = {"system": 2, "history": 28, "others": [8], "pool_blocks": 40, "evictions": [6], "new": 65,
         "chunk": 128, "max_prefill": None, "align": None, "policy": "penelope", "backend": "torch_native",
         "phantoms": True, "running": False, "rows": 8}
    with sglang_config(), adder_hooks():
        serving, tokens = lay_out(s)
        PrefillAdder._check_prefill_budget = SGLANGS_BUDGET_CHECK
        with pytest.raises(AssertionError, match="beside an idle scheduler"):
            serve(serving, s, tokens)


SGLANGS_BUDGET_CHECK = PrefillAdder._check_prefill_budget
