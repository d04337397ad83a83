"""Options of the ``penelope`` radix-cache backend (``PenelopeOptions``), validated on construction.

Options come from ``--radix-eviction-policy-config`` (SGLang hands that JSON object to the cache
factory as ``CacheInitParams.eviction_policy_config``) and from environment variables; a JSON key
overrides the variable of the same option:

| JSON key      | variable               | default    | meaning                                          |
|---------------|------------------------|------------|--------------------------------------------------|
| ``policy``    | ``PENELOPE_POLICY``    | penelope   | eviction policy name (``penelope.cache.policies``)     |
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
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from penelope.cache.policies import DEFAULT_POLICY, get_policy, policy_names
from penelope.errors import UsageError

from .backends import REFILL_MODES

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


@dataclass(frozen=True)
class PenelopeOptions:
    """Options of the ``penelope`` backend, validated on construction (UsageError, one line).

    `block_size` None means one SGLang page; sizes are in tokens. `cpu_cache`: tokens of a CPU
    tier (0: GPU only, unless SGLang's ``--hicache-size`` / ``--hicache-ratio`` size one);
    `swap_buffer`: its reserved host rows for exchanges. `copy`: how tier moves copy K/V ("auto":
    the swap-copy kernel on a GPU, torch's indexed copy on CPU).
    """

    policy: str = DEFAULT_POLICY
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
        return yes_or_no(text, variable)
    return text


def yes_or_no(text: str, variable: str) -> bool:
    """`text` as a switch: 1/true/yes/on or 0/false/no/off, in any case, spaces around ignored;
    UsageError naming `variable` otherwise."""
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise UsageError(f"penelope: {variable} must be 1/0 or true/false, got {text!r}")
