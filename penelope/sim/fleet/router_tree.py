"""The approximate prefix tree of SGLang's cache-aware router: which replica saw which prefix.

SGLang's router (`sgl-model-gateway/src/policies/tree.rs`, the `sglang-router` package) keeps one
radix tree over the text of every routed request; each node lists the workers ("tenants") whose
requests went through it, with a last-access time. It never asks a worker what it cached: the
tree says where a prefix was SENT, so it is approximate (a worker may have evicted it since).
A match walks as far as the request's text goes in the tree and names one tenant of the deepest
node reached; routing inserts the request's text under the chosen worker; a background task
evicts each tenant's least recently used leaves when its share of the tree exceeds a size limit.

Here the text is the request's block keys (`Request.keys`): equal keys mean equal tokens and
equal history before them (see `penelope.sim.workloads.types`), so a node per (position, key) pair is
the per-block form of SGLang's character tree. Sizes are in tokens (one block each). Of the
tenants of the deepest node, the one attached first (still attached) is named: SGLang names an
arbitrary one (the first its hash map yields) and caches that choice on the node, so a node keeps
naming the same worker while it stays attached. The input's partial tail past its keys (unique
to the request) is neither stored nor counted.
"""

from __future__ import annotations

from penelope.errors import UsageError


class PrefixTree:
    """Per-block multi-tenant prefix tree (see the module docstring).

    block_size: tokens per key. Tenants are replica numbers."""

    def __init__(self, block_size: int):
        if block_size < 1:
            raise UsageError(f"block size must be positive, got {block_size}")
        self.block_size = block_size
        # (position, key) -> {tenant: last access}, tenants in the order they attached.
        self._nodes: dict[tuple[int, int], dict[int, float]] = {}
        self._owned: dict[int, set[tuple[int, int]]] = {}

    def match(self, keys) -> tuple[int, int | None]:
        """(blocks matched, the tenant named by the deepest matched node, or None)."""
        nodes = self._nodes
        depth = 0
        tenants = None
        for position, key in enumerate(keys):
            found = nodes.get((position, key))
            if found is None:
                break
            tenants = found
            depth += 1
        if not tenants:
            return 0, None
        return depth, next(iter(tenants))

    def insert(self, keys, tenant: int, now: float) -> None:
        """Attach `tenant` to every block of `keys` and refresh its access time there."""
        nodes = self._nodes
        owned = self._owned.setdefault(tenant, set())
        for position, key in enumerate(keys):
            node = (position, key)
            tenants = nodes.get(node)
            if tenants is None:
                tenants = nodes[node] = {}
            if tenant not in tenants:
                owned.add(node)
            tenants[tenant] = now

    def size(self, tenant: int) -> int:
        """Tokens of the tree attached to `tenant`."""
        return len(self._owned.get(tenant, ())) * self.block_size

    def evict(self, max_tokens: int) -> int:
        """Detach every tenant from its least recently used blocks until it holds at most
        `max_tokens` tokens; leaves go first (a block is refreshed with every insert through it,
        so its descendants are never more recent). Returns the blocks detached."""
        limit = max_tokens // self.block_size
        detached = 0
        for tenant, owned in self._owned.items():
            excess = len(owned) - limit
            if excess <= 0:
                continue
            nodes = self._nodes
            order = sorted(owned, key=lambda node: (nodes[node][tenant], -node[0], node[1]))
            for node in order[:excess]:
                owned.discard(node)
                tenants = nodes[node]
                del tenants[tenant]
                if not tenants:
                    del nodes[node]
            detached += excess
        return detached
