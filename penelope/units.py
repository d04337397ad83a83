"""Parsing of sizes given on the command line: 512, 8K, 1.5M (K = 1024 tokens)."""
from __future__ import annotations

import math

from penelope.errors import UsageError

_SUFFIXES = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}
# Every size is a token count or position; the cache addresses slots with 31 bits, and no
# context or capacity of a real model comes near 2G tokens.
MAX_SIZE = 2**31 - 1


def parse_size(text: str | int, what: str = "size", allow_zero: bool = False, maximum: int = MAX_SIZE) -> int:
    """An integer size from `text` with an optional K/M/G suffix (powers of 1024), at most `maximum`."""
    if isinstance(text, bool):
        raise UsageError(f"{what}: cannot read {text!r} as a size (examples: 512, 8K, 1M)")
    if isinstance(text, int):
        value = text
    else:
        raw = str(text).strip().upper()
        suffix = raw[-1:] if raw[-1:] in ("K", "M", "G") else ""
        number = raw[: len(raw) - len(suffix)]
        try:
            scaled = float(number) * _SUFFIXES[suffix]
        except ValueError:
            raise UsageError(f"{what}: cannot read {text!r} as a size (examples: 512, 8K, 1M)") from None
        if math.isnan(scaled):
            raise UsageError(f"{what}: {text!r} is not a number")
        if math.isinf(scaled) or abs(scaled) > maximum:
            raise UsageError(f"{what}: {text!r} is beyond the largest size, {maximum:,} tokens")
        if scaled != int(scaled):
            raise UsageError(f"{what}: {text!r} is not a whole number of tokens")
        value = int(scaled)
    if value < 0 or (value == 0 and not allow_zero):
        raise UsageError(f"{what} must be {'non-negative' if allow_zero else 'positive'}, got {text!r}")
    if value > maximum:
        raise UsageError(f"{what}: {text!r} is beyond the largest size, {maximum:,} tokens")
    return value


def parse_size_list(text: str, what: str = "sizes", maximum: int = MAX_SIZE) -> list[int]:
    """A comma-separated list of sizes, each once (in the order first given: `64K,65536` is one)."""
    items = [item for item in str(text).split(",") if item.strip()]
    if not items:
        raise UsageError(f"{what}: empty list")
    return list(dict.fromkeys(parse_size(item, what, maximum=maximum) for item in items))


def format_size(tokens: int) -> str:
    """Shortest exact K/M/G form of a size: 131072 -> '128K', 1000 -> '1000'."""
    for suffix, factor in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if tokens and tokens % factor == 0:
            return f"{tokens // factor}{suffix}"
    return str(tokens)
