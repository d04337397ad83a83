"""Tensor parallelism: every TP rank runs its own PenelopeRadixCache, and every rank must make the
same decisions, or ranks report different prefixes and batch shapes (an NCCL hang or garbage).

Two caches on SGLang 0.5.23's real CPU pools (`sglang_env.Serving`) play two ranks: they are fed
the same operations, while each rank's wall clocks (`time.monotonic`, `time.time`,
`time.perf_counter`) read its own time: rank 1's is shifted by a few milliseconds and jittered at
every call, as two processes' clocks are. The time the cache is told comes only from what every
rank receives identically: rank 0's reading, broadcast with the requests (`clock.py`)."""
import contextlib
import pickle
import random
import time
from types import SimpleNamespace

import numpy as np
import pytest
from sglang_env import Serving, blocks, sglang_config

from penelope.cache.hints import MIN_OBSERVED
from penelope.cache.policies import get_policy, policy_names
from penelope.integration.sglang import clock

TOOL_CALL = 49_999
# Every distinct policy class in the registry (aliases and unlisted ablations included), but the
# offline oracle, which a server refuses.
# What the plugin serves: not the offline oracle, not the simulator's ports of SGLang's own policies.
POLICIES = sorted({get_policy(name).name for name in policy_names(aliases=True)
                   if not get_policy(name).name.startswith("sglang-")} - {"oracle"})
# Rank 1's clocks: shifted by this much and jittered by up to JITTER at every call (seconds).
SHIFT, JITTER = 0.004, 0.002


@pytest.fixture(autouse=True)
def _config():
    with sglang_config():
        yield


@contextlib.contextmanager
def wall_clocks(now: float, skew=None):
    """Every wall clock of the process reads `now` (rank 0) or `now` plus `skew()` at each call."""
    def reading(base):
        return lambda: base + now + (skew() if skew else 0.0)

    saved = time.monotonic, time.time, time.perf_counter
    time.monotonic, time.time, time.perf_counter = reading(1_000.0), reading(1.7e9), reading(50.0)
    try:
        yield
    finally:
        time.monotonic, time.time, time.perf_counter = saved


class Rank:
    """One TP rank: its cache on SGLang's pools, and what its decisions were."""

    def __init__(self, policy: str, cpu_cache: int, skew=None):
        self.serving = Serving(size=64 * 19, page_size=64, policy=policy, cpu_cache=cpu_cache,
                               swap_buffer=128, tool_call_token=TOOL_CALL)
        self.skew = skew
        self.evictions: list[tuple] = []
        self.prefixes: list[tuple] = []
        inner = self.serving.cache.cache
        evict = inner.evict

        def logged_evict(num_tokens):
            result = evict(num_tokens)
            self.evictions.append((num_tokens, result.freed_tokens, result.hashes.tolist()))
            return result

        inner.evict = logged_evict
        self.pins_set = 0
        policy = inner.policy
        if hasattr(policy, "ttl"):
            finished = policy.finished

            def counted_finished(tree, record):
                finished(tree, record)
                self.pins_set += record.pin_until > record.since

            policy.finished = counted_finished

    def step(self, now: float, broadcast: bytes, work):
        """One scheduler iteration: the broadcast requests (rank 0's clock reading with them), then
        `work` on this rank's cache, under this rank's own wall clocks."""
        with wall_clocks(now, self.skew):
            dispatched = clock._take_readings(lambda scheduler, reqs: reqs, self, pickle.loads(broadcast))
            assert all(isinstance(req, str) for req in dispatched), "a clock reading reached SGLang's dispatcher"
            return work(self.serving)

    @property
    def tree_cache(self):
        return self.serving.cache

    def tree(self) -> list[tuple]:
        return [(n.start, n.end, n.state.tolist(), n.tokens.tolist(), n.slots.tolist(), n.lock_ref)
                for n in self.serving.cache.cache.tree.nodes()]


def rank0_broadcast(now: float, pulled: list, busy: bool) -> bytes:
    """What rank 0 sends every rank in one iteration, through the plugin's hook around SGLang's
    broadcast (pickled, as ``broadcast_pyobj`` sends it): the requests it `pulled` (stand-ins: the
    operations themselves are the test's) and its clock reading."""
    receiver = SimpleNamespace(server_args=SimpleNamespace(radix_cache_backend="penelope"),
                               get_last_batch=lambda: object() if busy else None)
    with wall_clocks(now):
        return clock._stamp(lambda _, reqs, local: pickle.dumps([*reqs, *(local or [])]), receiver, pulled, None)


def agent_traffic(seed: int = 5, sessions: int = 5, turns: int = 9):
    """Closed-loop agent sessions on millisecond scales, so that a few milliseconds of clock skew
    would reorder victims, flip TTL pins and shift observed waits: (tokens, reply, think seconds)
    per turn, sessions 0-2 waiting for tools, 3-4 for people."""
    rng = random.Random(seed)
    system = blocks(40_000, 2)
    plans = []
    for s in range(sessions):
        history = list(system)
        turns_of = []
        for turn in range(turns):
            history = history + blocks(1_000 * (s + 1) * 10 + 64 * 3 * turn, 1 + turn % 2) + [s, turn]
            tool = s < 3
            reply = [7, TOOL_CALL, 8] if tool else [7, 8]
            think = rng.uniform(0.002, 0.02) if tool else rng.uniform(0.02, 0.15)
            turns_of.append((list(history), reply, think))
            history = history + reply
        plans.append(turns_of)
    return plans


def serve_agents(ranks: list[Rank]) -> float:
    """Every session's turns through every rank, one request per iteration (arrival, then finish
    a few milliseconds later), in the order rank 0's clock sends them; after every iteration the
    ranks must agree on the reported prefix, the evictions and the whole tree. Returns rank 0's
    last time (seconds from the start)."""
    plans = agent_traffic()
    rng = random.Random(11)
    next_send = [rng.uniform(0, 0.01) for _ in plans]
    turn = [0] * len(plans)
    now = 0.0

    def agree():
        first = ranks[0]
        for other in ranks[1:]:
            assert other.prefixes == first.prefixes, "the ranks reported different prefixes"
            assert other.evictions == first.evictions, "the ranks evicted different blocks"
            assert other.tree() == first.tree(), "the ranks' trees differ"

    for _ in range(10 * sum(len(p) for p in plans)):
        if all(t == len(p) for t, p in zip(turn, plans, strict=True)):
            break
        s = min((i for i in range(len(plans)) if turn[i] < len(plans[i])), key=lambda i: (next_send[i], i))
        tokens, reply, think = plans[s][turn[s]]
        now = max(now, next_send[s]) + rng.uniform(0.0002, 0.001)
        # The request arrives: rank 0 pulls it (a stand-in for its TokenizedGenerateReqInput).
        broadcast = rank0_broadcast(now, [f"request {s}.{turn[s]}"], busy=False)

        def arrive(serving, tokens=tokens):
            (req,) = serving.admit([tokens])
            if not serving.fits([req]):
                serving.cache.unlock(req.lock)
                return None
            batch = serving.build_batch([req])
            serving.forward(batch)
            return req, batch

        started = [rank.step(now, broadcast, arrive) for rank in ranks]
        for rank, out in zip(ranks, started, strict=True):
            rank.prefixes.append(None if out is None else (out[0].prefix_len, out[0].extend_len))
        agree()
        if started[0] is None:
            next_send[s] = now + 0.001
            continue
        now += rng.uniform(0.001, 0.004)
        # It finishes in the next iteration: nothing pulled, but a batch ran in the one before.
        broadcast = rank0_broadcast(now, [], busy=True)

        def finish(serving, out, reply=reply):
            req, batch = out
            req.output_ids.extend(reply)
            serving.finish(batch)

        for rank, out in zip(ranks, started, strict=True):
            rank.step(now, broadcast, lambda serving, out=out: finish(serving, out))
        agree()
        turn[s] += 1
        next_send[s] = now + think
    else:
        raise AssertionError("requests kept waiting for memory that never came")
    for rank in ranks:
        rank.serving.cache.check_invariants()
    return now


@pytest.mark.parametrize("cpu_cache", [0, 64 * 6], ids=["gpu", "two-tiers"])
@pytest.mark.parametrize("policy", POLICIES)
def test_ranks_with_skewed_clocks_make_identical_evictions(policy, cpu_cache):
    jitter = np.random.default_rng(3)
    ranks = [Rank(policy, cpu_cache), Rank(policy, cpu_cache, skew=lambda: SHIFT + jitter.uniform(-JITTER, JITTER))]
    last = serve_agents(ranks)
    # Both caches were told rank 0's clock, the last reading included, and read no other.
    assert [rank.serving.cache.now for rank in ranks] == [1_000.0 + last] * 2
    serving = ranks[0].serving
    assert ranks[0].evictions and serving.cache.cache.stats.evicted_tokens > 0, "the workload never evicted"
    assert any(prefix and prefix[0] for prefix in ranks[0].prefixes), "no request reused a cached prefix"
    book = getattr(serving.cache.cache.policy, "book", None)
    if book is not None:
        # The time-based rules had data to act on: tool waits observed and, for ttl, pins set.
        assert len(book.observed["tool"]) >= MIN_OBSERVED and min(book.observed["tool"]) > 0
        if policy == "ttl":
            assert ranks[0].pins_set > 0


def test_rank0_stamps_only_iterations_with_something_to_say_and_only_for_penelope():
    def receiver(backend="penelope", busy=False):
        return SimpleNamespace(server_args=SimpleNamespace(radix_cache_backend=backend),
                               get_last_batch=lambda: object() if busy else None)

    def broadcast(_, reqs, local):
        return reqs

    with wall_clocks(2.5):
        assert clock._stamp(broadcast, receiver(), ["req"], None) == ["req", clock.ClockReading(1_002.5)]
        assert clock._stamp(broadcast, receiver(busy=True), [], None) == [clock.ClockReading(1_002.5)]
        assert clock._stamp(broadcast, receiver(), [], ["abort"]) == [clock.ClockReading(1_002.5)]
        # An idle scheduler broadcasts what it broadcast before; the other ranks hold no list.
        assert clock._stamp(broadcast, receiver(), [], None) == []
        assert clock._stamp(broadcast, receiver(busy=True), None, None) is None
        # SGLang's own cache never sees a reading.
        assert clock._stamp(broadcast, receiver("radix", busy=True), ["req"], None) == ["req"]


def test_every_rank_takes_the_readings_out_before_sglang_dispatches():
    serving = Serving(size=64 * 4, page_size=64, policy="ttl")
    readings = [clock.ClockReading(3.0), clock.ClockReading(5.0)]
    seen = []
    scheduler = SimpleNamespace(tree_cache=serving.cache)
    clock._take_readings(lambda _, reqs: seen.append(reqs), scheduler, ["a", readings[1], "b", readings[0]])
    assert seen == [["a", "b"]] and serving.cache.now == 5.0
    # Time never goes back, and another cache is not told anything.
    clock._take_readings(lambda _, reqs: seen.append(reqs), scheduler, [clock.ClockReading(4.0)])
    assert seen[-1] == [] and serving.cache.now == 5.0
    clock._take_readings(lambda _, reqs: seen.append(reqs), SimpleNamespace(tree_cache=object()), readings)
    assert seen[-1] == []
