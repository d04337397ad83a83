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
| ``refill``    | ``PENELOPE_REFILL``    | auto       | how holes are refilled (``backends.py``): ``auto``, |
|               |                        |            | ``phantoms`` (refused where unsafe), ``hole-first`` |

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

from .backends import REFILL_MODES, prefill_backend

logger = logging.getLogger(__name__)

BACKEND_NAME = "penelope"
ATTENTION_MODES = ("ragged", "sglang")
COPY_MODES = ("auto", "triton", "naive")
_ENV = {"policy": "PENELOPE_POLICY", "block_size": "PENELOPE_BLOCK_SIZE",
        "swap_buffer": "PENELOPE_SWAP_BUFFER", "phantoms": "PENELOPE_PHANTOMS",
        "attention": "PENELOPE_ATTENTION", "cpu_cache": "PENELOPE_CPU_CACHE", "copy": "PENELOPE_COPY",
        "tool_call_token": "PENELOPE_TOOL_CALL_TOKEN", "refill": "PENELOPE_REFILL"}
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
    refill: str = "auto"

    def __post_init__(self):
        from penelope.cache.sglang_policies import SGLangPolicy

        known = policy_names(aliases=True)
        servable = [name for name in known
                    if not get_policy(name).uses_foresight and not isinstance(get_policy(name), SGLangPolicy)]
        if self.policy not in known:
            raise UsageError(f"penelope: unknown policy {self.policy!r} (known: {', '.join(servable)})")
        if isinstance(get_policy(self.policy), SGLangPolicy):
            raise UsageError(f"penelope: {self.policy!r} is the simulator's port of SGLang's own policy; serve "
                             "SGLang's with --radix-eviction-policy (without --radix-cache-backend penelope)")
        if get_policy(self.policy).uses_foresight:
            raise UsageError(f"penelope: policy {self.policy!r} is an offline reference that must be told the "
                             "future (penelope simulate, penelope verify --engine reference); a server cannot run it")
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
        if self.refill not in REFILL_MODES:
            raise UsageError(f"penelope: refill must be one of {', '.join(REFILL_MODES)}, got {self.refill!r}")
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
    backend, the scheduler hooks, the start-up check of Penelope's options, the prefix-aware CPU
    attention backend ``torch_native_prefix`` (``cpu_attention``) and, unless
    ``PENELOPE_ATTENTION=sglang``, the Triton attention backend subclass that runs phantom batches
    through Penelope's ragged kernel. Never raises: SGLang would log the error and start without
    the plugin; a bad option stops the server at start-up instead (``check_server_args``).
    Safe to call more than once in a process."""
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

    from . import clock, cpu_attention, hooks

    if BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND_NAME, create_penelope_cache)
    hooks.register_hooks()
    clock.register_hooks()
    register_around({_SERVER_ARGS_CHECK: _check_server_args})
    cpu_attention.register()
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


def _check_server_args(original, server_args, *args, **kwargs):
    # After SGLang's own check, on the resolved arguments (``startup.py``).
    from .startup import check_server_args

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
    # The CPU tier's copies are ordered against the stream SGLang's forwards run on.
    forward_stream = getattr(getattr(getattr(ctx, "tp_worker", None), "model_runner", None), "forward_stream", None)
    try:
        # hicache_size / hicache_ratio as the user gave them (resolution defaults the ratio for HiCache).
        return PenelopeRadixCache(ctx.params, options, phantoms=phantoms,
                                  backend=prefill_backend(getattr(ctx, "tp_worker", None), server_args),
                                  hicache_size_gb=getattr(server_args, "hicache_size", 0) or 0,
                                  hicache_ratio=getattr(server_args, "hicache_ratio", None),
                                  cost_model=served_cost_model(getattr(ctx, "model_config", None), server_args),
                                  forward_stream=forward_stream)
    except UsageError as error:
        message = str(error)
        raise UsageError(message if message.startswith("penelope:") else f"penelope: {message}") from None


def served_cost_model(model_config, server_args=None):
    """The recompute cost model of the served model, which the cost-aware policies weigh blocks by:
    from the HF config SGLang loaded (`model_config.hf_config`, whatever `--model-path` named: a
    folder or a hub id), else from the config.json at `server_args.model_path`; None (every token
    costs the same) when neither can be read. Logs which one is used."""
    from penelope.costmodel.recompute import CostModel
    from penelope.costmodel.shapes import get_model, shape_from_config

    hf_config = getattr(model_config, "hf_config", None)
    path = str(getattr(model_config, "model_path", None) or getattr(server_args, "model_path", None))
    name = Path(path).name or path
    try:
        if hf_config is not None:
            shape = shape_from_config(hf_config.to_dict(), name=name, where=f"the config of {path}")
        else:
            shape = get_model(path)
    except (UsageError, OSError, ValueError) as error:
        logger.warning("penelope: no cost model for %s (%s); the policies weigh every token the same", path, error)
        return None
    logger.info("penelope: cost model %s (%d layers, hidden %d) from the served model's config", shape.name,
                shape.num_layers, shape.hidden_size)
    return CostModel(shape)


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
