"""Matplotlib import with a headless backend and a clear error when it is missing, and the
styling the capacity-sweep plots share."""
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


def shade_oracle_bracket(axis, x, bounds, oracle_costs, labels) -> None:
    """The recompute-cost panel of a capacity sweep: the oracle bracket (lower bound to the
    oracle's cost) shaded, capacities on the x axis (the policies' curves are drawn by the caller)."""
    axis.fill_between(x, bounds, oracle_costs, color="grey", alpha=0.3, label="oracle bracket")
    axis.set_xticks(x, labels)
    axis.set_xlabel("GPU KV cache (tokens)")
    axis.set_ylabel("recompute cost (attention-pair units)")
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8)
