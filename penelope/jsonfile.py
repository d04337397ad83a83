"""JSON files. Reading those given on the command line: every way a file can be wrong is one
UsageError naming the file (missing, a folder, not a regular file, too large, unreadable, not
UTF-8, not JSON, nested too deeply). Writing: `json_ready` makes values standard JSON."""
from __future__ import annotations

import json
import math
from pathlib import Path

from penelope.errors import UsageError
from penelope.memory import check_memory, format_bytes

# Python objects of parsed JSON take about this many times the file's bytes.
PARSED_BYTES_PER_FILE_BYTE = 16


def read_json(path: str | Path, what: str, max_bytes: int | None = None, error=UsageError):
    """The parsed contents of the JSON file `path`; `what` names it in messages ("calibration file").

    max_bytes: refuse larger files (None: whatever the available memory can parse). `error`: the
    UsageError subclass to raise."""
    if "\0" in str(path):
        raise error(f"{what} {str(path)!r}: a file name cannot hold a NUL byte")
    path = Path(path)
    try:
        if not path.exists():
            raise error(f"{what} not found: {path}")
        if path.is_dir():
            raise error(f"{what} {path} is a folder, not a file")
        if not path.is_file():
            raise error(f"{what} {path} is not a regular file")
        size = path.stat().st_size
    except OSError as err:
        raise error(f"{what} {path}: cannot read it ({err.strerror})") from None
    if max_bytes is not None and size > max_bytes:
        raise error(f"{what} {path} is {format_bytes(size)}, larger than the {format_bytes(max_bytes)} expected")
    check_memory(size * PARSED_BYTES_PER_FILE_BYTE, f"{what} {path} ({format_bytes(size)})")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise error(f"{what} {path}: cannot read it ({err.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{what} {path}: not UTF-8 text (byte {err.start}); expected JSON") from None
    return parse_json(text, f"{what} {path}", error)


def parse_json(text: str, where: str, error=UsageError):
    """`json.loads(text)` with its failures as one `error` naming `where`."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise error(f"{where}: not valid JSON ({err.msg} at line {err.lineno})") from None
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply") from None
    except ValueError as err:
        # Integers of more than 4,300 digits, among others.
        raise error(f"{where}: not valid JSON ({err})") from None


def json_ready(value):
    """NaN and infinities become None, so the JSON is standard."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(item) for item in value]
    return value
