"""Every plot of the package goes through here: matplotlib on a headless backend (a clear error
when it is missing), the axes of a capacity sweep, and writing a figure whole."""
from __future__ import annotations

from penelope.errors import UsageError
from penelope.outputs import MISSING_MATPLOTLIB, save_figure


def pyplot():
    """`matplotlib.pyplot` on the Agg backend (no display needed)."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError(MISSING_MATPLOTLIB) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def capacity_axis(axis, x, labels, ylabel: str) -> None:
    """An axis of a capacity sweep: the GPU capacities on x, `ylabel` on y, a light grid."""
    axis.set_xticks(x, labels)
    axis.set_xlabel("GPU KV cache (tokens)")
    axis.set_ylabel(ylabel)
    axis.grid(True, alpha=0.3)


def shade_oracle_bracket(axis, x, bounds, oracle_costs, labels) -> None:
    """The recompute-cost panel of a capacity sweep: the oracle bracket (lower bound to the
    oracle's cost) shaded, capacities on the x axis (the policies' curves are drawn by the caller)."""
    axis.fill_between(x, bounds, oracle_costs, color="grey", alpha=0.3, label="oracle bracket")
    capacity_axis(axis, x, labels, "recompute cost (attention-pair units)")
    axis.legend(fontsize=8)


def save(fig, path: str, title: str | None = None) -> None:
    """Lay `fig` out (under `title`), write it whole to `path` (`penelope.outputs.save_figure`)
    and close it."""
    if title is not None:
        fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    pyplot().close(fig)
