"""Every eviction policy, by name: what callers use to choose one.

    policy = get_policy("private-head-block")     # or an alias, or "name:key=value:..."
    policy_names()                                # the names `--policies all` runs, in order

Importing this module registers every policy: the paper's grid (`penelope.cache.policy`), then the
agent- and cost-aware policies (`penelope.cache.agent_policy`), then SGLang's own policies, which
are found by name but not listed (`penelope.cache.sglang_policies`). `policy_names()` lists the
grid first, in `PAPER_GRID` order, then `ttl`, `flop-recency`, `penelope-agent` and `oracle`.
"""
from __future__ import annotations

# isort: off
# The order of these imports is the order of `policy_names()`.
from penelope.cache import policy
from penelope.cache import agent_policy
from penelope.cache import sglang_policies
# isort: on
from penelope.cache.registry import register, registered, registered_names
from penelope.errors import UsageError

__all__ = ["DEFAULT_POLICY", "PAPER_GRID", "POLICY_MODULES", "get_policy", "policy_names", "register"]

# The modules whose policies are registered, in registration order.
POLICY_MODULES = (policy, agent_policy, sglang_policies)
PAPER_GRID = policy.PAPER_GRID
# The policy a cache gets when none is named: Penelope's (also registered as "penelope").
DEFAULT_POLICY = "private-head-block"


def policy_names(aliases: bool = False) -> list[str]:
    """Registered policy names (canonical ones in registration order; then, if asked, the aliases
    and the unlisted ablations)."""
    return registered_names(aliases)


def get_policy(name: str) -> policy.EvictionPolicy:
    """A new policy object by name or alias, optionally followed by settings
    (`name:key=value:...`, for the policies that take some); unknown names raise UsageError
    listing the known."""
    base, colon, settings = name.partition(":") if isinstance(name, str) else ("", "", "")
    cls = registered(base)
    if cls is None:
        known = ", ".join(policy_names(aliases=True))
        raise UsageError(f"unknown eviction policy {name!r} (known: {known})")
    return cls.from_settings(settings) if colon else cls()
