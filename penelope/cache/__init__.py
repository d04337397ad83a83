"""The KV cache: what is kept, where, and what a request must recompute (layers and where a new
class goes: `penelope/cache/README.md`).

- `tree`: the radix tree over whole KV blocks, a state per block (GPU, CPU, MISSING).
- `policy`: the eviction policies' interface (which victim: `priority`; where in its history:
  `TailPolicy`, `HeadPolicy`, `PrivateHeadPolicy`; how much: `whole_node`) and the paper's grid;
  `agent_policy`: agent- and cost-aware policies and the offline oracle; `sglang_policies`:
  SGLang's own policies, ported (baselines); `hints`: what a server tells the policies.
- `registry`: the `register` decorator and its table; `policies`: every policy by name
  (`get_policy`, `policy_names`, `DEFAULT_POLICY` = `private-head-block`).
- `manager`: `KVCache`, the GPU-only cache manager (match, lock, alloc, insert, unlock, evict).
- `host_tier`, `tiers`: the second tier (host memory and its swap buffer) and `TwoTierCache`;
  `swap_executor` runs the tier plans on real KV pools.
- `admission`: one request's admission (match, lock, load, allocate, roll back), used by the
  reference engine, the simulator and the SGLang adapter; `phantom`: the batch layout of
  phantom refills; `refill`: refilling holes under a chunk budget.
- `baselines`: caches that imitate other systems (the HiCache-like two-tier cache).
- `slots`: the slot pools (device and host rows) behind one allocator interface.
- `arguments`: the checks of the public methods' arguments (one UsageError each).
"""

# The names most callers want, importable from the package (loaded on first use, so importing
# one module of the package does not import them all).
_EXPORTS = {
    "KVCache": "manager", "TieredCache": "host_tier", "TwoTierCache": "tiers",
    "HiCacheLikeCache": "baselines.hicache", "admit": "admission", "get_policy": "policies",
    "policy_names": "policies", "DEFAULT_POLICY": "policies",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'penelope.cache' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"penelope.cache.{_EXPORTS[name]}"), name)


def __dir__():
    return sorted([*globals(), *_EXPORTS])
