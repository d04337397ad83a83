"""SGLang plugin entry point: registers the radix-cache backend ``penelope`` and its scheduler hooks.

SGLang 0.5.23 runs every function of the entry-point group ``sglang.srt.plugins`` early in each of
its processes (``sglang.srt.plugins.load_plugins``), then applies the hooks they registered. The
user then launches with ``--radix-cache-backend penelope``.

Options come from ``--radix-eviction-policy-config`` (SGLang hands that JSON object to the cache
factory as ``CacheInitParams.eviction_policy_config``) and from environment variables; a JSON key
overrides the variable of the same option:

| JSON key      | variable               | default    | meaning                                          |
|---------------|------------------------|------------|--------------------------------------------------|
| ``policy``    | ``PENELOPE_POLICY``    | penelope   | eviction policy name (``penelope.cache.policy``)       |
| ``block_size``| ``PENELOPE_BLOCK_SIZE``| page size  | tokens per cached block, a multiple of the page, at most 2**20 |
| ``swap_buffer``| ``PENELOPE_SWAP_BUFFER``| 1024     | CPU swap buffer in tokens (two-tier cache only)  |
| ``phantoms``  | ``PENELOPE_PHANTOMS``  | true       | refill holes with phantom prefills               |
| ``attention`` | ``PENELOPE_ATTENTION`` | ragged     | ``ragged``: phantom batches use Penelope's kernel |
| ``tool_call_token`` | ``PENELOPE_TOOL_CALL_TOKEN`` | none | token id opening a tool call in a reply (``hints.py``) |

By default a block is one SGLang page, so the cache keeps what SGLang's own radix cache would keep
(every token with page size 1, whole pages otherwise). ``attention`` is read when the plugin loads
(before any cache exists), so only its variable counts.
"""
from __future__ import annotations

import json
import logging
import numbers
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

from penelope.cache.policy import get_policy, policy_names
from penelope.errors import UsageError

logger = logging.getLogger(__name__)

BACKEND_NAME = "penelope"
ATTENTION_MODES = ("ragged", "sglang")
COPY_MODES = ("auto", "triton", "naive")
_ENV = {"policy": "PENELOPE_POLICY", "block_size": "PENELOPE_BLOCK_SIZE",
        "swap_buffer": "PENELOPE_SWAP_BUFFER", "phantoms": "PENELOPE_PHANTOMS",
        "attention": "PENELOPE_ATTENTION", "cpu_cache": "PENELOPE_CPU_CACHE", "copy": "PENELOPE_COPY",
        "tool_call_token": "PENELOPE_TOOL_CALL_TOKEN"}
_INTEGERS = ("block_size", "swap_buffer", "cpu_cache", "tool_call_token")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
# A block is one unit of eviction; a million tokens is beyond any context (and any KV pool) served.
MAX_BLOCK_SIZE = 2**20
# Digits of an integer variable: every option's range ends well below 10**18.
_MAX_DIGITS = 18
_SERVER_ARGS_CHECK = "sglang.srt.server_args.ServerArgs.check_server_args"


@dataclass(frozen=True)
class PenelopeOptions:
    """Options of the ``penelope`` backend, validated on construction (UsageError, one line).

    `block_size` None means one SGLang page; sizes are in tokens. `cpu_cache`: tokens of a CPU
    tier (0: GPU only, unless SGLang's ``--hicache-size`` / ``--hicache-ratio`` size one);
    `swap_buffer`: its reserved host rows for exchanges. `copy`: how tier moves copy K/V ("auto":
    the swap-copy kernel on a GPU, torch's indexed copy on CPU).
    """

    policy: str = "penelope"
    block_size: int | None = None
    swap_buffer: int = 1024
    phantoms: bool = True
    attention: str = "ragged"
    cpu_cache: int = 0
    copy: str = "auto"
    tool_call_token: int | None = None

    def __post_init__(self):
        known = policy_names(aliases=True)
        if self.policy not in known:
            raise UsageError(f"penelope: unknown policy {self.policy!r} (known: {', '.join(known)})")
        if get_policy(self.policy).uses_foresight:
            raise UsageError(f"penelope: policy {self.policy!r} is an offline reference that must be told the "
                             "future (penelope simulate, penelope verify); a server cannot run it")
        if self.block_size is not None:
            _positive(self.block_size, "block_size")
            if self.block_size > MAX_BLOCK_SIZE:
                raise UsageError(f"penelope: block_size must be at most {MAX_BLOCK_SIZE} tokens, got "
                                 f"{_shown(self.block_size)}")
        _positive(self.swap_buffer, "swap_buffer")
        if not isinstance(self.phantoms, bool):
            raise UsageError(f"penelope: phantoms must be true or false, got {self.phantoms!r}")
        if self.attention not in ATTENTION_MODES:
            raise UsageError(f"penelope: attention must be one of {', '.join(ATTENTION_MODES)}, "
                             f"got {self.attention!r}")
        if isinstance(self.cpu_cache, bool) or not isinstance(self.cpu_cache, numbers.Integral) or self.cpu_cache < 0:
            raise UsageError(f"penelope: cpu_cache must be a non-negative integer (tokens), got "
                             f"{_shown(self.cpu_cache)}")
        if self.cpu_cache and self.block_size is not None:
            for name in ("cpu_cache", "swap_buffer"):
                if getattr(self, name) < self.block_size:
                    raise UsageError(f"penelope: {name} {getattr(self, name)} is smaller than one block of "
                                     f"{self.block_size} tokens" + (" (0 turns the CPU tier off)"
                                                                    if name == "cpu_cache" else ""))
        if self.tool_call_token is not None and (isinstance(self.tool_call_token, bool) or not isinstance(
                self.tool_call_token, numbers.Integral) or not 0 <= self.tool_call_token < 2**31):
            raise UsageError(f"penelope: tool_call_token must be a token id (an integer in [0, 2**31)), "
                             f"got {_shown(self.tool_call_token)}")
        if self.copy not in COPY_MODES:
            raise UsageError(f"penelope: copy must be one of {', '.join(COPY_MODES)}, got {self.copy!r}")

    def resolved_block_size(self, page_size: int) -> int:
        """Block size in tokens for SGLang's `page_size`: blocks must hold whole pages, because
        evicting a block hands its pages back to SGLang's allocator."""
        if self.block_size is None:
            return page_size
        if self.block_size % page_size:
            raise UsageError(f"penelope: block_size {self.block_size} is not a multiple of SGLang's "
                             f"page size {page_size}")
        return self.block_size


def options_from(config: Mapping | None = None, environ: Mapping[str, str] | None = None) -> PenelopeOptions:
    """Options from the ``--radix-eviction-policy-config`` object and the environment; a JSON key
    wins over its variable (a variable is not even read then).

    Raises UsageError naming the offending key or variable."""
    environ = os.environ if environ is None else environ
    if isinstance(config, str):
        # The CLI parses the flag's JSON; the Python Engine API passes what it was given.
        try:
            config = json.loads(config)
        except json.JSONDecodeError as error:
            raise UsageError(f"penelope: --radix-eviction-policy-config is not valid JSON ({error})") from None
        except RecursionError:
            raise UsageError("penelope: --radix-eviction-policy-config is nested too deeply") from None
        except ValueError:
            # Python refuses to read an integer literal of more than 4300 digits.
            raise UsageError("penelope: --radix-eviction-policy-config holds an integer of more than 4300 "
                             "digits") from None
    values: dict = {}
    if config is not None:
        if not isinstance(config, Mapping):
            raise UsageError(f"penelope: --radix-eviction-policy-config must be a JSON object, got {config!r}")
        known = [f.name for f in fields(PenelopeOptions)]
        for key, value in config.items():
            if key == "attention":
                raise UsageError("penelope: attention is chosen when the plugin loads, before this config is "
                                 "read: set PENELOPE_ATTENTION instead")
            if key not in known:
                raise UsageError(f"penelope: unknown key {key!r} in --radix-eviction-policy-config "
                                 f"(known: {', '.join(k for k in known if k != 'attention')})")
            values[key] = value
    for name, variable in _ENV.items():
        if variable in environ and name not in values:
            value = _parse_env(name, variable, environ[variable])
            try:
                PenelopeOptions(**{name: value})
            except UsageError as error:
                raise UsageError(f"{error} (from {variable})") from None
            values[name] = value
    return PenelopeOptions(**values)


def register() -> None:
    """Entry point of the ``sglang.srt.plugins`` group: registers the ``penelope`` radix-cache
    backend, the scheduler hooks, the start-up check of Penelope's options and, unless
    ``PENELOPE_ATTENTION=sglang``, the Triton attention backend subclass that runs phantom batches
    through Penelope's ragged kernel. Never raises: SGLang would log the error and start without
    the plugin; a bad option stops the server at start-up instead (``check_server_args``).
    Safe to call more than once in a process."""
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

    from . import clock, hooks

    if BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND_NAME, create_penelope_cache)
    hooks.register_hooks()
    clock.register_hooks()
    register_around({_SERVER_ARGS_CHECK: _check_server_args})
    try:
        attention = options_from(None).attention
    except UsageError:
        attention = "sglang"  # reported by the start-up check when the backend is selected
    if attention == "ragged":
        from sglang.srt.layers.attention.attention_registry import register_attention_backend

        from .attention import create_penelope_triton_backend

        # Overwrites the "triton" entry: --attention-backend triton then builds the subclass, which
        # hands every batch without phantoms to SGLang's own code.
        register_attention_backend("triton")(create_penelope_triton_backend)


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


def check_server_args(server_args) -> None:
    """Raise UsageError (one line) for a Penelope configuration the scheduler process would only
    trip over later: options from ``--radix-eviction-policy-config`` and the environment, a block
    that does not hold whole pages, features the backend does not support."""
    if getattr(server_args, "radix_cache_backend", None) != BACKEND_NAME:
        return
    options = options_from(server_args.radix_eviction_policy_config)
    for flag, on in (("--enable-hierarchical-cache", server_args.enable_hierarchical_cache),
                     ("--disable-radix-cache", server_args.disable_radix_cache),
                     ("speculative decoding", server_args.speculative_algorithm is not None),
                     ("--enable-streaming-session", getattr(server_args, "enable_streaming_session", False)),
                     ("--enable-session-radix-cache", getattr(server_args, "enable_session_radix_cache", False)),
                     ("pipeline parallelism", (getattr(server_args, "pp_size", 1) or 1) > 1),
                     ("PD disaggregation", getattr(server_args, "disaggregation_mode", "null") not in (None, "null"))):
        if on:
            raise UsageError(f"penelope: --radix-cache-backend penelope does not support {flag}")
    policy = getattr(server_args, "radix_eviction_policy", "lru")
    if policy not in (None, "lru"):
        raise UsageError(f"penelope: --radix-eviction-policy {policy} applies to SGLang's own radix cache; choose "
                         "Penelope's policy with --radix-eviction-policy-config '{\"policy\": ...}'")
    page = server_args.page_size or 1
    block = options.resolved_block_size(page)
    pool = getattr(server_args, "max_total_tokens", None)
    if pool and block > pool:
        raise UsageError(f"penelope: block_size {block} is larger than the KV pool (--max-total-tokens {pool})")
    _check_host_memory(options, server_args)


def _check_host_memory(options: PenelopeOptions, server_args) -> None:
    """The CPU tier (``cpu_cache`` tokens or ``--hicache-size`` GB) must fit the free host memory;
    checked here from the model's config when it is a local checkpoint (the scheduler checks the
    exact size again when it builds the pool)."""
    from .host_tier import check_fits, estimated_bytes_per_token

    size_gb = getattr(server_args, "hicache_size", 0) or 0
    if not options.cpu_cache and size_gb <= 0:
        return
    if size_gb > 0 and not options.cpu_cache:
        check_fits(1, int(size_gb * (1 << 30)))
        return
    per_token = estimated_bytes_per_token(str(server_args.model_path), str(server_args.dtype),
                                          getattr(server_args, "tp_size", 1) or 1)
    if per_token:
        check_fits(options.cpu_cache + options.swap_buffer, per_token)


def _check_server_args(original, server_args, *args, **kwargs):
    result = original(server_args, *args, **kwargs)
    try:
        check_server_args(server_args)
    except UsageError as error:
        if Path(sys.argv[0]).name in ("launch_server.py", "sglang"):
            # The command line: one line and a non-zero exit, no traceback.
            raise SystemExit(str(error)) from None
        raise
    return result


def create_penelope_cache(ctx):
    """Radix-cache factory (`TreeCacheBuildContext` -> `PenelopeRadixCache`)."""
    from . import clock, hooks
    from .radix_cache import PenelopeRadixCache

    unsupported = [flag for flag, on in (
        ("a hybrid sliding-window model", ctx.is_hybrid_swa),
        ("a model with mamba state", ctx.is_hybrid_ssm),
        ("--enable-hierarchical-cache", ctx.enable_hierarchical_cache),
        ("--disable-radix-cache", ctx.disable_radix_cache),
        ("a DSA model", ctx.is_dsa),
    ) if on]
    if unsupported:
        raise UsageError(f"penelope: --radix-cache-backend penelope does not support {unsupported[0]}")
    options = options_from(ctx.params.eviction_policy_config)
    phantoms = options.phantoms and hooks.hooks_active()
    if options.phantoms and not phantoms:
        logger.warning("penelope: scheduler hooks are not applied (was the plugin loaded through "
                       "load_plugins?); holes are recomputed with everything after them")
    if not clock.hooks_active():
        logger.warning("penelope: the clock hooks are not applied (was the plugin loaded through load_plugins?); "
                       "the agent-aware policies see no time pass")
    server_args = getattr(ctx, "server_args", None)
    try:
        return PenelopeRadixCache(ctx.params, options, phantoms=phantoms,
                                  hicache_size_gb=getattr(server_args, "hicache_size", 0) or 0,
                                  hicache_ratio=getattr(server_args, "hicache_ratio", None),
                                  cost_model=served_cost_model(server_args))
    except UsageError as error:
        message = str(error)
        raise UsageError(message if message.startswith("penelope:") else f"penelope: {message}") from None


def served_cost_model(server_args):
    """The recompute cost model of the served checkpoint (its config.json), which the cost-aware
    policies weigh blocks by; None (every token costs the same) when it cannot be read, logged."""
    from penelope.costmodel.recompute import CostModel
    from penelope.costmodel.shapes import get_model

    path = getattr(server_args, "model_path", None)
    try:
        return CostModel(get_model(str(path)))
    except (UsageError, OSError, ValueError) as error:
        logger.warning("penelope: no cost model for %s (%s); the policies weigh every token the same", path, error)
        return None


def _positive(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise UsageError(f"penelope: {name} must be a positive integer, got {_shown(value)}")


def _shown(value) -> str:
    """`value` for an error message: a huge integer by its size (its digits would fill the screen,
    or not convert at all past 4300 of them)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value).bit_length() > 64:
        return f"an integer of {int(value).bit_length()} bits"
    return repr(value)


def _parse_env(name: str, variable: str, text: str):
    text = text.strip()
    if name in _INTEGERS:
        if not (text.isascii() and text.lstrip("-").isdigit()):
            raise UsageError(f"penelope: {variable} must be an integer, got {text[:40]!r}")
        if len(text.lstrip("-")) > _MAX_DIGITS:
            raise UsageError(f"penelope: {variable} must be an integer of at most {_MAX_DIGITS} digits, got "
                             f"{len(text.lstrip('-'))} digits")
        return int(text)
    if name == "phantoms":
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise UsageError(f"penelope: {variable} must be 1/0 or true/false, got {text!r}")
    return text
