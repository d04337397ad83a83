"""The table of eviction policies by name, and `register`, the class decorator that fills it.

It imports no policy, so every policy module can import it. `penelope.cache.policies` imports the
policy modules (so every policy is registered) and looks names up.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from penelope.cache.policy import EvictionPolicy

# Name or alias -> class, and the canonical names of the listed policies in registration order.
_REGISTRY: dict[str, type[EvictionPolicy]] = {}
_CANONICAL: list[str] = []


def register(name: str, *aliases: str, listed: bool = True):
    """Class decorator: make a policy available by `name` and `aliases`; returns the class. An
    ablation registers with `listed=False`: it is found by name but is not one of `policy_names()`
    (so not in `--policies all`). A name registered twice raises ValueError."""

    def decorate(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
        keys = (name, *aliases)
        taken = [key for key in keys if key in _REGISTRY]
        if taken:
            raise ValueError(f"eviction policy {taken[0]!r} registered twice")
        for key in keys:
            _REGISTRY[key] = cls
        cls.name = name
        if listed:
            _CANONICAL.append(name)
        return cls

    return decorate


def registered(name: str) -> type[EvictionPolicy] | None:
    """The class registered under `name` (a name or an alias), None when there is none."""
    return _REGISTRY.get(name)


def registered_names(aliases: bool = False) -> list[str]:
    """The canonical names in registration order; then, if asked, the aliases and the unlisted
    policies, sorted."""
    if not aliases:
        return list(_CANONICAL)
    return list(_CANONICAL) + sorted(k for k in _REGISTRY if k not in _CANONICAL)
