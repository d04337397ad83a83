"""The cost of recomputing KV by position.

- `recompute`: `CostModel`, the recompute cost of a token at position p, and the paper's speedups.
- `shapes`: `ModelShape`, what that cost depends on, read from HF-style configs.
- `hf_configs`: the built-in configs (published config.json figures of the supported models).
"""

# The names most callers want, importable from the package (loaded on first use).
_EXPORTS = {"CostModel": "recompute", "RecomputeCost": "recompute", "ModelShape": "shapes", "get_model": "shapes"}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'penelope.costmodel' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"penelope.costmodel.{_EXPORTS[name]}"), name)
