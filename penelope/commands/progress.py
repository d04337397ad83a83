"""The progress bar of long commands (replays, load runs, A/B rounds)."""

from __future__ import annotations

import sys


def progress_bar(total: int, disabled: bool):
    """A tqdm bar on stderr over replayed requests, or None when off or stderr is not a terminal."""
    if disabled or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc="replay", leave=False)
