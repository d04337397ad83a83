"""Patching SGLang through its ``HookRegistry``: the hook modules (``hooks.py``, ``clock.py``) and the
entry point (``plugin.py``) register their hooks AROUND SGLang's methods with ``register_around`` and ask
whether ``load_plugins`` applied them with ``applied``."""
from __future__ import annotations

from collections.abc import Mapping


def register_around(targets: Mapping) -> None:
    """Register each hook of `targets` ({dotted target: hook}) AROUND its target with SGLang's
    HookRegistry, once: registering again in the same process changes nothing."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook in targets.items():
        if not any(registered is hook for _, registered, _ in HookRegistry._hooks.get(target, ())):
            HookRegistry.register(target, hook, HookType.AROUND)


def applied(targets: Mapping) -> bool:
    """Whether every target of `targets` has been patched in this process (``load_plugins``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    return all(target in HookRegistry._patched for target in targets)
