"""Routers: every decision of the cache-aware router against a slow reference that rescans the
whole routing history, the balance thresholds, the tree's eviction, and the simple routers."""

import dataclasses

import numpy as np
import pytest

from penelope.errors import UsageError
from penelope.sim.fleet.router import RouterConfig, least_loaded, make_router, router_names
from penelope.sim.fleet.router_tree import PrefixTree
from penelope.sim.workloads.types import HUMAN, Request

B = 512


def request(keys, input_tokens=None):
    keys = np.asarray(keys, dtype=np.int64)
    return Request(keys=keys, input_tokens=input_tokens or len(keys) * B, output_tokens=1, think_time=0.0,
                   arrival=0.0, kind=HUMAN, tail_key=10**12, source="test")


class ReferenceCacheAware:
    """SGLang's cache-aware rule written out over the raw history of routed requests: the match
    is the longest common prefix with any request routed so far, the replica named is the one
    that first routed a request through that prefix (no eviction)."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.history: list[tuple[tuple[int, ...], int]] = []

    def route(self, req: Request, loads) -> int:
        config = self.config
        high, low = max(loads), min(loads)
        least = int(np.argmin(loads))
        keys = tuple(req.keys.tolist())
        if high - low > config.balance_abs_threshold and high > low * config.balance_rel_threshold:
            chosen = least
        else:
            best, owner = 0, None
            for seen, replica in self.history:
                common = 0
                while common < min(len(seen), len(keys)) and seen[common] == keys[common]:
                    common += 1
                if common > best:
                    best, owner = common, replica
            rate = min(best * B, req.input_tokens) / req.input_tokens
            chosen = owner if owner is not None and rate > config.cache_threshold else least
        self.history.append((keys, chosen))
        return chosen


def random_requests(rng, n):
    """Requests sharing prefixes: a shared first block, a few shared system prompts, conversations
    that grow, and fresh ones."""
    made = []
    next_key = 1000
    for _ in range(n):
        kind = rng.integers(4)
        if made and kind == 0:
            # A follow-up of an earlier request: its blocks, minus some, plus new ones.
            base = made[rng.integers(len(made))].keys.tolist()
            base = base[: rng.integers(1, len(base) + 1)]
        elif kind == 1:
            base = [0, int(rng.integers(1, 4))]
        else:
            base = [0]
        fresh = int(rng.integers(0, 6))
        keys = base + list(range(next_key, next_key + fresh))
        next_key += fresh
        tail = int(rng.integers(0, B))
        made.append(request(keys, len(keys) * B - (tail if fresh else 0)))
    return made


@pytest.mark.parametrize("config", [
    RouterConfig(),
    RouterConfig(cache_threshold=0.0, balance_abs_threshold=2, balance_rel_threshold=1.2),
    RouterConfig(cache_threshold=0.7, balance_abs_threshold=0, balance_rel_threshold=1.0),
])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cache_aware_matches_the_slow_reference_decision_by_decision(config, seed):
    rng = np.random.default_rng(seed)
    replicas = 5
    router = make_router("cache-aware", replicas, B, config)
    reference = ReferenceCacheAware(config)
    loads = [0] * replicas
    decisions = set()
    for i, req in enumerate(random_requests(rng, 400)):
        # Loads drift as the replay's would: each routed request adds one, finishes take some away.
        for replica in range(replicas):
            loads[replica] = max(0, loads[replica] - int(rng.integers(0, 2)))
        chosen = router.route(req, i, list(loads), now=float(i))
        assert chosen == reference.route(req, list(loads)), f"request {i}"
        loads[chosen] += int(rng.integers(1, 4))
    decisions = {kind for kind, count in router.decisions.items() if count}
    # Every branch of the rule was exercised at least by the default thresholds' runs.
    assert decisions <= {"balance", "match", "least-load"} and len(decisions) >= 2


def test_imbalance_needs_both_the_absolute_and_the_relative_threshold():
    router = make_router("cache-aware", 2, B, RouterConfig(balance_abs_threshold=64, balance_rel_threshold=1.5))
    assert not router.imbalanced([100, 40])   # difference 60 <= 64
    assert not router.imbalanced([200, 135])  # difference 65 > 64, but 200 <= 1.5 * 135
    assert router.imbalanced([200, 133])      # 67 > 64 and 200 > 199.5
    # Imbalanced: the least loaded replica wins even against a full prefix match.
    warm = request([0, 1, 2, 3])
    assert router.route(warm, 0, [0, 0], now=0.0) == 0
    assert router.route(warm, 1, [0, 0], now=1.0) == 0
    assert router.route(warm, 2, [200, 133], now=2.0) == 1
    assert router.decisions == {"balance": 1, "match": 1, "least-load": 1}


def test_a_low_match_goes_to_the_least_loaded_replica_and_a_high_one_to_its_owner():
    router = make_router("cache-aware", 3, B, RouterConfig(cache_threshold=0.5))
    assert router.route(request([0, 1, 2, 3]), 0, [5, 1, 3], now=0.0) == 1
    # 3 of 4 blocks match: replica 1 owns them although it is now the busiest.
    assert router.route(request([0, 1, 2, 9]), 1, [5, 9, 3], now=1.0) == 1
    # 1 of 4 blocks (25%) is not enough: the least loaded replica.
    assert router.route(request([0, 7, 8, 9]), 2, [5, 9, 3], now=2.0) == 2
    # The shared first block now names its first owner, replica 1, to a short request (1 of 1).
    assert router.route(request([0]), 3, [5, 9, 3], now=3.0) == 1
    # Exactly the threshold (2 of 4 blocks, 50%) is not above it (SGLang: match_rate > cache_threshold).
    assert router.route(request([0, 1, 5, 6]), 4, [5, 9, 3], now=4.0) == 2


def test_tree_eviction_keeps_each_replica_under_its_limit_leaves_and_oldest_first():
    tree = PrefixTree(B)
    tree.insert([0, 1, 2], tenant=0, now=1.0)
    tree.insert([0, 5, 6], tenant=0, now=2.0)
    tree.insert([0, 1, 2], tenant=1, now=3.0)
    assert (tree.size(0), tree.size(1)) == (5 * B, 3 * B)
    assert tree.evict(max_tokens=3 * B) == 2
    # Replica 0 lost its oldest branch from the leaf up (blocks 2 then 1); 0, 5, 6 stay.
    assert tree.size(0) == 3 * B and tree.size(1) == 3 * B
    assert tree.match([0, 1, 2]) == (3, 1)
    assert tree.match([0, 5, 6, 7]) == (3, 0)
    # Replica 0 attached to block 0 first: it stays the block's named owner.
    assert tree.match([0, 9]) == (1, 0)


def test_the_router_evicts_on_its_interval_of_simulated_time():
    config = RouterConfig(eviction_interval=10.0, max_tree_tokens=2 * B)
    router = make_router("cache-aware", 2, B, config)
    router.route(request([0, 1, 2, 3]), 0, [0, 0], now=0.0)
    assert router.tree.size(0) == 4 * B
    router.route(request([7]), 1, [1, 0], now=9.9)
    assert router.tree.size(0) == 4 * B
    router.route(request([8]), 2, [1, 1], now=10.0)
    assert router.tree.size(0) <= 2 * B + B


def test_round_robin_least_load_and_sticky_sessions():
    req = request([0])
    rr = make_router("round-robin", 3, B)
    assert [rr.route(req, i, [9, 0, 0], 0.0) for i in range(5)] == [0, 1, 2, 0, 1]
    ll = make_router("least-load", 3, B)
    assert ll.route(req, 0, [3, 1, 1], 0.0) == 1 and least_loaded([2, 2, 2]) == 0
    sticky = make_router("session", 3, B)
    assert sticky.route(req, 7, [3, 1, 2], 0.0) == 1
    # Session 7 stays on replica 1 whatever the loads; a new session goes to the least loaded.
    assert sticky.route(req, 7, [0, 50, 0], 1.0) == 1
    assert sticky.route(req, 8, [4, 50, 2], 1.0) == 2


@pytest.mark.parametrize("changes, message", [
    ({"cache_threshold": 1.5}, "`cache_threshold` must be in"),
    ({"balance_rel_threshold": 0.9}, "`balance_rel_threshold` must be at least 1"),
    ({"balance_abs_threshold": -1}, "`balance_abs_threshold` must be a non-negative integer"),
    ({"eviction_interval": 0}, "eviction interval must be positive"),
    ({"cache_threshold": float("nan")}, "must be a number"),
])
def test_router_config_rejects_bad_values(changes, message):
    with pytest.raises(UsageError, match=message):
        dataclasses.replace(RouterConfig(), **changes)


def test_unknown_router_and_bad_replica_counts():
    with pytest.raises(UsageError, match="`router` 'random' is not a router; choose from"):
        make_router("random", 2, B)
    with pytest.raises(UsageError, match="`replicas` must be a positive integer"):
        make_router("least-load", 0, B)
    assert router_names() == ["round-robin", "least-load", "session", "cache-aware"]
