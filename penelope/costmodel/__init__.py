"""The cost of recomputing KV by position.

- `recompute`: `CostModel`, the recompute cost of a token at position p, and the paper's speedups.
- `shapes`: `ModelShape`, what that cost depends on, read from HF-style configs.
- `hf_configs`: the built-in configs (published config.json figures of the supported models).
"""
