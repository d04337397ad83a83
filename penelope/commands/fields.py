"""Library errors name the fields of a set-up in backquotes (`gpu_cache`); a command names the
flag a user typed. This module maps one to the other from the command's own parser: a field is
its option's dest (`--gpu-cache` -> `gpu_cache`), a positional its metavar or upper-cased name."""

from __future__ import annotations

import argparse
import re

_FIELD = re.compile(r"`([a-z][a-z0-9_]*)`")


def field_flags(parser: argparse.ArgumentParser, **renamed: str) -> dict[str, str]:
    """{field: what the user typed} for every argument of `parser`; `renamed`: fields a command
    fills from an argument of another name (`trace="path"`: analyze's PATH is the `trace` field)."""
    flags = {}
    for action in parser._actions:
        if action.dest in (argparse.SUPPRESS, "help"):
            continue
        if action.option_strings:
            flags[action.dest] = action.option_strings[-1]
        else:
            flags[action.dest] = action.metavar or action.dest.upper()
    for field, dest in renamed.items():
        if dest in flags:
            flags[field] = flags[dest]
    return flags


def as_flags(message: str, flags: dict[str, str]) -> str:
    """`message` with every backquoted field the command has a flag for named by that flag."""
    return _FIELD.sub(lambda m: flags.get(m.group(1), m.group(0)), message)
