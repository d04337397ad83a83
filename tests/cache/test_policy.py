"""The eviction policy registry."""
from __future__ import annotations

import pytest

from penelope.cache import registry
from penelope.cache.manager import KVCache
from penelope.cache.policies import DEFAULT_POLICY, PAPER_GRID, get_policy, policy_names, register
from penelope.cache.policy import EvictionPolicy, LeafTailNode, PrivateHeadBlock, TailPolicy
from penelope.cache.tiers import TwoTierCache
from penelope.errors import UsageError

SIX = ["leaf-tail-node", "leaf-tail-block", "leaf-head-node", "leaf-head-block",
       "private-head-node", "private-head-block"]


BEYOND = ["ttl", "flop-recency", "penelope-agent", "oracle"]
# SGLang's own policies, unlisted: by name only, not in `--policies all`.
SGLANG = ["sglang-lru", "sglang-lfu", "sglang-slru", "sglang-tlru", "sglang-session"]


def test_the_ablation_grid_is_registered_first_with_aliases():
    assert policy_names() == SIX + BEYOND
    assert list(PAPER_GRID) == SIX
    assert set(policy_names(aliases=True)) == set(SIX + BEYOND + SGLANG) | {"sglang", "penelope",
                                                                           "penelope-agent-no-prefetch"}
    assert isinstance(get_policy("sglang"), LeafTailNode)
    assert isinstance(get_policy("penelope"), PrivateHeadBlock)
    assert get_policy("penelope").name == "private-head-block"
    assert KVCache(64, block_size=4, policy="sglang").stats.policy == "leaf-tail-node"


def test_unknown_policy_lists_the_known_ones():
    with pytest.raises(UsageError, match="unknown eviction policy 'lru' \\(known: leaf-tail-node, .*penelope"):
        get_policy("lru")
    with pytest.raises(UsageError):
        get_policy(None)


def test_register_returns_the_class_and_refuses_duplicates():
    class Mine(TailPolicy):
        pass

    try:
        assert register("test-only-policy")(Mine) is Mine
        assert isinstance(get_policy("test-only-policy"), Mine)
    finally:
        registry._REGISTRY.pop("test-only-policy")
        registry._CANONICAL.remove("test-only-policy")
    with pytest.raises(ValueError, match="'penelope' registered twice"):
        register("another", "penelope")(Mine)
    assert "another" not in policy_names(aliases=True)


def test_a_policy_object_can_be_passed_directly():
    cache = KVCache(64, block_size=4, policy=PrivateHeadBlock())
    assert cache.policy.name == "private-head-block"


def test_the_default_policy_is_private_head_block():
    assert DEFAULT_POLICY == "private-head-block"
    assert isinstance(KVCache(64, block_size=4).policy, PrivateHeadBlock)
    assert isinstance(TwoTierCache(64, 64, block_size=4, swap_buffer=4).policy, PrivateHeadBlock)


def test_a_policy_without_a_where_cannot_be_made():
    class WhichOnly(EvictionPolicy):
        def priority(self, tree, node):
            return (-node.last_access,)

    with pytest.raises(TypeError, match="_evict_leaf"):
        WhichOnly()
