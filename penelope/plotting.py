"""Matplotlib import with a headless backend and a clear error when it is missing."""
from __future__ import annotations

from penelope.errors import UsageError


def pyplot():
    """`matplotlib.pyplot` on the Agg backend (no display needed)."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError("plots need matplotlib: pip install 'penelope-kv[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
