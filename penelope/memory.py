"""Memory checks before large allocations: a size that cannot fit is a clear error, not an OOM kill."""
from __future__ import annotations

import os

from penelope.errors import UsageError


def available_bytes() -> int | None:
    """Memory this machine can still hand out without swapping (Linux MemAvailable), or None when
    unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def format_bytes(n: float) -> str:
    """1.5 GiB, 320.0 MiB, 12 B."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{int(n)} B"


def check_memory(nbytes: float, what: str) -> None:
    """Raise UsageError when `nbytes` exceed the memory available now; `what` names the input."""
    available = available_bytes()
    if available is not None and nbytes > available:
        raise UsageError(f"{what}: {format_bytes(nbytes)} needed, more than the {format_bytes(available)} of "
                         "memory available")
