"""The one way the GPU stages record what they measure: one JSON object per line, appended at once.

Each ``PointLog.write`` opens the file, appends one line and closes it, so a point is in the file
(the kernel's page cache) the moment it is measured: a stage killed at its limit loses only the
point it was measuring. A line cut short by a kill is ended before the next point is appended (so
it does not swallow that point), and ``read_points`` skips it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from penelope.jsonfile import json_ready

POINTS_FILE = "points.jsonl"


def _plain(value: Any):
    """JSON for what ``json`` does not know: numpy and torch arrays and scalars, dtypes, paths."""
    # ``tolist`` before ``item``: both give a scalar its Python value, only ``tolist`` takes an
    # array of several values (``item`` raises there).
    for method in ("tolist", "item"):
        if callable(getattr(value, method, None)):
            return getattr(value, method)()
    return str(value)


class PointLog:
    """Appends the points of one stage to ``path`` (JSON lines), each tagged with the stage's name,
    the point's ``kind`` and the seconds since the log was opened."""

    def __init__(self, path: str | Path, stage: str):
        self.path = Path(path)
        self.stage = stage
        self.started = time.monotonic()

    def write(self, kind: str, **fields) -> dict:
        """Append one point; returns it as written."""
        point = {"stage": self.stage, "kind": kind, "at_s": round(time.monotonic() - self.started, 3), **fields}
        line = json.dumps(json_ready(json.loads(json.dumps(point, default=_plain))), allow_nan=False)
        with self.path.open("ab+") as handle:
            handle.write(_line_start(handle) + line.encode() + b"\n")
        return point


def _line_start(handle) -> bytes:
    """A newline when the file open in ``handle`` ends inside a line (one cut by a kill), else nothing."""
    if handle.seek(0, 2) == 0:
        return b""
    handle.seek(-1, 2)
    return b"" if handle.read(1) == b"\n" else b"\n"


def read_points(path: str | Path, stage: str | None = None, kind: str | None = None) -> list[dict]:
    """The points in ``path`` (empty when it does not exist), optionally those of one stage and kind.
    A line that does not parse (the last one, cut by a kill) is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    points = []
    for line in path.read_text().splitlines():
        try:
            point = json.loads(line)
        except ValueError:
            continue
        if not isinstance(point, dict):
            continue
        if (stage is None or point.get("stage") == stage) and (kind is None or point.get("kind") == kind):
            points.append(point)
    return points
