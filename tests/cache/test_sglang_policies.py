"""The sglang-* policies as simulator policies: names and settings, one-line errors, what they
evict on hand-built trees, and the session cache fed by the replay. That they evict what
SGLang's own class evicts: tests/sglang/test_policy_equivalence.py."""
from __future__ import annotations

import numpy as np
import pytest

from penelope.cache.hints import FINISHED, Hint
from penelope.cache.manager import KVCache
from penelope.cache.policies import get_policy, policy_names
from penelope.cache.tiers import TwoTierCache
from penelope.cli import main
from penelope.costmodel.recompute import CostModel
from penelope.costmodel.shapes import get_model
from penelope.errors import UsageError
from penelope.sim.replay import Replay
from penelope.sim.run import parse_policies
from penelope.sim.timemodel import TimeModel
from penelope.sim.workloads.synthetic import SyntheticConfig, generate

SGLANG = ["sglang-lru", "sglang-lfu", "sglang-slru", "sglang-tlru", "sglang-session"]


def test_registered_by_name_but_not_in_all():
    assert not set(SGLANG) & set(policy_names())
    assert not set(SGLANG) & set(parse_policies("all"))
    assert set(SGLANG) <= set(policy_names(aliases=True))
    assert parse_policies(",".join(SGLANG)) == ["sglang", *SGLANG]


def test_settings_name_the_policy_and_defaults_are_dropped():
    tlru = get_policy("sglang-tlru:threshold=8192:next_prompt_estimate=1024")
    assert (tlru.threshold, tlru.next_prompt_estimate) == (8192, 1024)
    assert tlru.name == "sglang-tlru:threshold=8192:next_prompt_estimate=1024"
    assert get_policy("sglang-tlru").name == "sglang-tlru"
    assert (get_policy("sglang-tlru").threshold, get_policy("sglang-tlru").next_prompt_estimate) == (4096, 512)
    assert get_policy("sglang-tlru:threshold=4096:next_prompt_estimate=512").name == "sglang-tlru"
    assert get_policy("sglang-slru:protected_threshold=3").protected_threshold == 3
    # One configuration counts once; two are two policies.
    assert parse_policies("sglang-tlru,sglang-tlru:next_prompt_estimate=512") == ["sglang", "sglang-tlru"]
    assert parse_policies("sglang-tlru,sglang-tlru:threshold=2048") == ["sglang", "sglang-tlru",
                                                                        "sglang-tlru:threshold=2048"]


@pytest.mark.parametrize(
    "policies, message",
    [
        ("sglang-tlru:threshold=512:next_prompt_estimate=512", "threshold 512 must exceed next_prompt_estimate 512"),
        ("sglang-tlru:threshold=100:next_prompt_estimate=200", "threshold 100 must exceed"),
        ("sglang-tlru:threshold=-1", "must be non-negative"),
        ("sglang-tlru:budget=3", "has no setting 'budget' (settings: threshold, next_prompt_estimate)"),
        ("sglang-lru:threshold=3", "has no setting 'threshold' (settings: none)"),
        ("sglang-tlru:threshold=lots", "setting 'threshold=lots' is not key=integer"),
        ("sglang-tlru:threshold", "setting 'threshold' is not key=integer"),
        ("sglang-tlru:", "setting '' is not key=integer"),
        ("sglang-tlru:threshold=--5", "setting 'threshold=--5' is not key=integer"),
        ("sglang-tlru:threshold=\u00b2", "is not key=integer"),
        ("sglang-tlru:threshold=\u0663\u0660\u0660\u0660", "is not key=integer"),
        ("sglang-tlru:threshold=4096:threshold=8192", "setting 'threshold' given twice"),
        ("sglang-slru:protected_threshold=-1", "setting protected_threshold=-1 must be non-negative"),
        ("sglang-session:close=2", "close must be 1"),
        ("penelope:threshold=3", "eviction policy 'private-head-block' takes no settings"),
        ("sglang-mru", "unknown eviction policy 'sglang-mru'"),
    ],
)
def test_bad_names_and_settings_are_one_line_errors(policies, message, capsys):
    assert main(["simulate", "--policies", policies, "--limit-sessions", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("penelope: error: ") and err.count("\n") == 1
    assert message in err


def test_refused_with_a_cpu_tier():
    with pytest.raises(UsageError, match="sglang-lru models SGLang's GPU radix cache: run it without a CPU tier"):
        TwoTierCache(64, 64, block_size=4, policy="sglang-lru", swap_buffer=4)


def test_a_closing_hint_needs_a_finished_request_of_a_session():
    with pytest.raises(UsageError, match="closes=True goes with a finished request of a session"):
        Hint(0.0, FINISHED, closes=True)
    with pytest.raises(UsageError, match="session must be a string"):
        Hint(0.0, FINISHED, session=3)


def serve(cache: KVCache, tokens, session: str | None = None, closes: bool = False) -> None:
    """One request of `tokens`: matched, locked, its new tokens allocated, inserted, unlocked."""
    tokens = np.asarray(tokens, dtype=np.int64)
    match = cache.match(tokens)
    handle = cache.lock(match)
    new = cache.alloc(len(tokens) - match.hit_tokens)
    prefix = match.spans[0].slots if match.hit_tokens else np.empty(0, dtype=np.int64)
    cache.insert(tokens, np.concatenate([prefix, new]))
    cache.unlock(handle)
    if session is not None:
        cache.hint(tokens, Hint(0.0, FINISHED, session=session, closes=closes))


def evicted(cache: KVCache, n: int) -> list[tuple[int, int]]:
    return cache.evict(n).ranges


def test_tlru_evicts_the_tail_past_the_budget_before_older_history():
    # Conversation A: turns of 5 then 3 tokens (history L = 8); conversation B: 4 tokens, older
    # than A's second turn. T = 4, Q = 1: A keeps L + Q - T = 5 tokens, its 3-token tail
    # [5, 8) is TEL-safe and goes first; plain LRU takes B's older leaf instead.
    for name, first in (("sglang-tlru:threshold=4:next_prompt_estimate=1", (5, 8)), ("sglang-lru", (0, 4))):
        cache = KVCache(32, block_size=1, policy=name)
        serve(cache, range(100, 105))
        serve(cache, range(200, 204))
        serve(cache, [*range(100, 105), *range(300, 303)])
        assert evicted(cache, 1) == [first], name


def test_tlru_keeps_the_high_water_history_after_its_tail_went():
    cache = KVCache(32, block_size=1, policy="sglang-tlru:threshold=4:next_prompt_estimate=1")
    serve(cache, range(100, 105))
    serve(cache, [*range(100, 105), *range(300, 303)])
    serve(cache, range(200, 204))
    # A's tail [5, 8) is TEL-safe although it is newer than B; then A's [0, 5) is not (its
    # history stays 8, so its budget stays 5 and it starts at 0) and is older than B.
    assert evicted(cache, 1) == [(5, 8)]
    assert evicted(cache, 1) == [(0, 5)]
    assert evicted(cache, 1) == [(0, 4)]


def test_lfu_keeps_the_prefix_inserted_most():
    cache = KVCache(32, block_size=1, policy="sglang-lfu")
    serve(cache, range(100, 104))
    serve(cache, range(100, 104))
    serve(cache, range(200, 204))
    # The first sequence was inserted twice: the newer, once-inserted one goes first.
    assert evicted(cache, 1) == [(0, 4)]
    assert cache.match(np.arange(100, 104)).hit_tokens == 4


def test_session_cache_evicts_closed_sessions_first_then_the_least_referenced():
    cache = KVCache(64, block_size=1, policy="sglang-session")
    system = list(range(10, 14))
    serve(cache, [*system, *range(100, 104)], session="a")
    serve(cache, [*system, *range(200, 204)], session="b", closes=True)
    serve(cache, [*system, *range(300, 304)], session="c")
    # b closed: its private history is unreferenced, evicted before a's (older, referenced).
    assert evicted(cache, 1) == [(4, 8)]
    # a and c hold one reference each on their histories, two on the shared system prompt.
    assert evicted(cache, 1) == [(4, 8)]
    assert cache.match(np.array([*system, *range(100, 104)])).hit_tokens == 4
    assert evicted(cache, 1) == [(4, 8)]
    assert evicted(cache, 1) == [(0, 4)]


def test_replay_tells_the_session_cache_its_sessions_and_closes_them():
    workload = generate(SyntheticConfig(sessions=3, requests_per_session=6, prefix_tokens=512,
                                        first_prompt_median=300.0, tool_result_median=100.0,
                                        output_median=50.0, summary_median=1000.0, max_context=8192))
    ids = {session.id for session in workload.sessions}
    for name, closed in (("sglang-session", ids), ("sglang-session:close=0", set())):
        cache = KVCache(64 * 1024, 64, name)
        Replay(workload, cache, TimeModel.estimate("qwen3-8b"), CostModel(get_model("qwen3-8b")), sessions=2).run()
        policy = cache.policy
        assert policy.closed == closed
        refs = sum(meta.refs for meta in policy.meta.values())
        if closed:
            assert not policy.frontiers and refs == 0
        else:
            assert set(policy.frontiers) == ids and refs > 0
