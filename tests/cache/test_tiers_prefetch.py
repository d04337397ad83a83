"""penelope-agent's prefetch over two tiers, by hand: a tool-waiting session whose blocks went to
the CPU comes back to the GPU before its request, when what it displaces is worth less than half
as much to the policy (`PREFETCH_MARGIN`); `penelope-agent-no-prefetch` never does."""
import numpy as np
import pytest
from cache_helpers import serve

from penelope.cache import policy_names
from penelope.cache.hints import Hint
from penelope.cache.tiers import TwoTierCache
from penelope.cache.tree import BlockState

BS = 4


def history(base: int, blocks: int) -> np.ndarray:
    return np.arange(base, base + blocks * BS, dtype=np.int64)


def turn(cache, tokens, now, kind):
    """A request of `tokens` arrives, is served and finishes at `now`; its session waits for `kind`."""
    cache.hint(tokens, Hint(now, "arrived"))
    serve(cache, tokens)
    cache.hint(tokens, Hint(now, "finished", kind))


def observe(cache, kind, waits, base):
    """Sessions of one block that waited `waits` seconds each for `kind` (back and gone again)."""
    for i, wait in enumerate(waits):
        tokens = history(base + 100 * i, 1)
        cache.hint(tokens, Hint(0.0, "finished", kind))
        cache.hint(tokens, Hint(wait, "arrived"))
        cache.hint(tokens, Hint(wait, "finished", kind))


def on_cpu(cache, tokens) -> int:
    """Blocks of `tokens` the CPU tier holds."""
    return sum(span.state == BlockState.CPU for span in cache.match(tokens).spans for _ in range(len(span) // BS))


def scenario(policy: str, other_waits_for: str):
    """Session A (3 blocks) waits for a tool; session B (4 blocks) then fills the 6-block GPU,
    pushing A's front block to the CPU, and waits for `other_waits_for`. Tools came back within
    seconds so far, people after minutes."""
    cache = TwoTierCache(6 * BS, 8 * BS, block_size=BS, policy=policy, swap_buffer=2 * BS)
    observe(cache, "tool", [1.0, 2.0, 3.0], base=5000)
    observe(cache, "human", [300.0, 400.0, 500.0], base=7000)
    a, b = history(100, 3), history(300, 4)
    turn(cache, a, 1000.0, "tool")
    turn(cache, b, 1000.5, other_waits_for)
    cache.take_plans()
    assert on_cpu(cache, a) == 1 and on_cpu(cache, b) == 0
    return cache, a, b


def test_a_tool_waiting_session_comes_back_before_its_request():
    cache, a, b = scenario("penelope-agent", "human")
    cache.advance(1001.0)
    assert on_cpu(cache, a) == 0 and on_cpu(cache, b) == 1
    assert cache.counters.prefetches == 1 and cache.counters.prefetched_tokens == BS
    # The copies: A's block comes in (plainly or through the swap buffer), B's front block goes out.
    plans = cache.take_plans()
    assert sum(len(plan.to_gpu_host) + len(plan.exchange_in_host) for plan in plans) == BS
    assert sum(len(plan.to_host_gpu) + len(plan.exchange_out_gpu) for plan in plans) == BS
    cache.check_invariants()


def test_no_prefetch_when_the_victims_are_worth_as_much():
    """B waits for a tool too and finished later: expected back as soon, worth more than half."""
    cache, a, b = scenario("penelope-agent", "tool")
    cache.advance(1001.0)
    assert on_cpu(cache, a) == 1 and cache.counters.prefetches == 0


@pytest.mark.parametrize("waits_for", ["human", "tool"])
def test_the_ablation_never_prefetches(waits_for):
    cache, a, _ = scenario("penelope-agent-no-prefetch", waits_for)
    cache.advance(1001.0)
    assert on_cpu(cache, a) == 1 and cache.counters.prefetches == 0
    assert "penelope-agent-no-prefetch" not in policy_names() and "penelope-agent" in policy_names()
