"""Loading a workload by format name: the one place that knows every trace reader."""

from __future__ import annotations

from pathlib import Path

from penelope.errors import UsageError
from penelope.sim.workloads.mooncake import load_mooncake
from penelope.sim.workloads.synthetic import SyntheticConfig, generate
from penelope.sim.workloads.types import Workload
from penelope.sim.workloads.weka import load_weka

FORMATS = ("weka", "mooncake", "synthetic")


def load_workload(
    format: str,
    path: str | Path | list[str | Path] | None = None,
    *,
    max_context: int | None = None,
    seed: int = 0,
    **options,
) -> Workload:
    """Load a workload by format name (`FORMATS`). `path` is required except for `synthetic`;
    `options` go to the format's loader (`load_weka`, `load_mooncake`, `SyntheticConfig`)."""
    if format == "weka":
        if path is None:
            raise UsageError("the weka format needs a trace folder or files")
        return load_weka(path, max_context=max_context, **options)
    if format == "mooncake":
        if path is None:
            raise UsageError("the mooncake format needs a JSONL file")
        return load_mooncake(path, max_context=max_context, **options)
    if format == "synthetic":
        if path is not None:
            raise UsageError("the synthetic format takes no trace path")
        if max_context is not None:
            options["max_context"] = max_context
        return generate(SyntheticConfig(seed=seed, **options))
    raise UsageError(f"unknown workload format {format!r}; choose from {', '.join(FORMATS)}")
