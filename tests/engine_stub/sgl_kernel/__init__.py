"""Test-only stand-in for SGLang's CPU kernel package ``sgl_kernel`` (no CPU build is on PyPI).

SGLang 0.5.23's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) imports these names when its modules
load. On a CPU without AMX every op but ``assign_req_to_token_pool_cpu`` takes SGLang's
``forward_native`` torch path, so that one is written here in plain torch; the others raise if
anything ever calls them, and a name not listed here fails at import time. Put this folder on the
Engine's PYTHONPATH in tests only: the product never imports it.
"""
from __future__ import annotations

import torch


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, max_context_len: int) -> None:
    """Write request i's new slots ``out_cache_loc[...]`` into row ``req_pool_indices[i]`` of
    ``req_to_token`` at positions ``[start_offset[i], end_offset[i])``, requests in order."""
    written = 0
    starts, ends = start_offset.tolist(), end_offset.tolist()
    for i, row in enumerate(req_pool_indices.tolist()):
        n = ends[i] - starts[i]
        if not 0 <= starts[i] <= ends[i] <= max_context_len:
            raise ValueError(f"request {i}: positions [{starts[i]}, {ends[i]}) outside the row")
        req_to_token[row, starts[i]:ends[i]] = out_cache_loc[written:written + n].to(req_to_token.dtype)
        written += n
    if written != len(out_cache_loc):
        raise ValueError(f"{len(out_cache_loc)} slots for {written} positions")


def _not_implemented(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel stand-in: {name} is not implemented (tests only)")

    op.__name__ = name
    return op


# Imported at module load by SGLang's CPU paths (KV copy, speculative decoding); never called by
# the tests' Engines.
for _name in ("copy_all_layer_kv_cache_cpu", "build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu",
              "assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu",
              "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu"):
    globals()[_name] = _not_implemented(_name)
