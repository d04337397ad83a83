"""Eviction policies: where to evict in the radix tree and how much at a time.

All policies share one loop (`EvictionPolicy.evict`): take the least-recently-used unlocked leaf
that still holds resident KV, evict from it (or from the private history above it), prune what
nothing can reuse any more, repeat until enough blocks are freed. Subclasses fix two choices,
the paper's ablation grid:

- where: `leaf tail` (delete blocks from the end of the leaf, as SGLang), `leaf head` (blocks at
  the front of the leaf become a hole), `private head` (walk from the leaf toward the root to the
  earliest block of its private history and evict from there, continuing forward);
- how much: the whole node, or only the blocks still needed.

`private-head-block` is Penelope; `leaf-tail-node` is SGLang's RadixCache.

Beyond the grid (`penelope.cache.agent_policy`), policies may also choose WHICH leaf goes first
(`victim_key`, least recently used by default) from hints the cache forwards (`observe`: the kind
of wait a session is in and the time, `penelope.cache.hints`) and from the cost model (`bind`).

The same two choices order demotions in the two-tier cache (`penelope.cache.tiers`): `from_tail` and
`victim_nodes` tell which nodes a victim's blocks come from and in which direction they are taken.
"""
from __future__ import annotations

import heapq
from typing import ClassVar

from penelope.cache.tree import Node, RadixTree, Released
from penelope.costmodel.recompute import RecomputeCost, TokenCost
from penelope.errors import UsageError

# The six policies of the paper's ablation grid, SGLang's first.
PAPER_GRID = ("leaf-tail-node", "leaf-tail-block", "leaf-head-node", "leaf-head-block",
              "private-head-node", "private-head-block")

_REGISTRY: dict[str, type[EvictionPolicy]] = {}
_CANONICAL: list[str] = []


def register(name: str, *aliases: str, listed: bool = True):
    """Class decorator: make a policy available by `name` and `aliases`; returns the class. An
    ablation registers with `listed=False`: it is found by name but is not one of `policy_names()`
    (so not in `--policies all`)."""

    def decorate(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
        keys = (name, *aliases)
        taken = [key for key in keys if key in _REGISTRY]
        if taken:
            raise ValueError(f"eviction policy {taken[0]!r} registered twice")
        for key in keys:
            _REGISTRY[key] = cls
        cls.name = name
        if listed:
            _CANONICAL.append(name)
        return cls

    return decorate


def policy_names(aliases: bool = False) -> list[str]:
    """Registered policy names (canonical ones in registration order; then, if asked, the aliases
    and the unlisted ablations)."""
    if not aliases:
        return list(_CANONICAL)
    return list(_CANONICAL) + sorted(k for k in _REGISTRY if k not in _CANONICAL)


def get_policy(name: str) -> EvictionPolicy:
    """A new policy object by name or alias, optionally followed by settings
    (`name:key=value:...`, for the policies that take some); unknown names raise UsageError
    listing the known."""
    base, colon, settings = name.partition(":") if isinstance(name, str) else ("", "", "")
    cls = _REGISTRY.get(base)
    if cls is None:
        known = ", ".join(policy_names(aliases=True))
        raise UsageError(f"unknown eviction policy {name!r} (known: {known})")
    return cls.from_settings(settings) if colon else cls()


def is_candidate(tree: RadixTree, node: Node) -> bool:
    """An eviction victim: a live unlocked leaf that still holds resident KV."""
    return (node.alive and node is not tree.root and not node.children
            and node.lock_ref == 0 and node.n_resident > 0)


class EvictionPolicy:
    """Chooses which blocks to free. Subclasses set `whole_node` and implement `_evict_leaf`.

    `from_tail`: the victim's blocks are taken from its end (else from the front of the chain
    that starts at `first_node`). `uses_foresight`: the policy may receive the future in hints
    (the offline oracle only). A policy object keeps state for one cache: do not share it."""

    name: ClassVar[str] = ""
    whole_node: ClassVar[bool] = False
    from_tail: ClassVar[bool] = False
    uses_foresight: ClassVar[bool] = False
    # Asks a two-tier cache to prefetch `prefetch_candidates` when the caller advances the time;
    # a prefetch displaces GPU victims only when it is worth PREFETCH_MARGIN times more than they are.
    prefetches: ClassVar[bool] = False
    PREFETCH_MARGIN: ClassVar[float] = 2.0
    # The server this policy models inserts a finished request's prompt once more after its prompt
    # + reply, so the reply is a leaf of its own (SGLang's `checkpoint_into_tree`); a simulated
    # scheduler does the same (`penelope.sim.scheduler.Scheduler.release`).
    splits_reply_off: ClassVar[bool] = False

    capacity: int = 0
    block_size: int = 0
    # The cache the policy serves (set by it): one policy object per cache.
    owner: object = None
    cost_model: RecomputeCost = TokenCost()

    @classmethod
    def from_settings(cls, text: str) -> EvictionPolicy:
        """The policy configured by `text` (what follows `name:` in `get_policy`); none here."""
        raise UsageError(f"eviction policy {cls.name!r} takes no settings (got {text!r})")

    def bind(self, capacity: int, block_size: int, cost_model: RecomputeCost | None = None) -> None:
        """Called by the cache that owns the policy: its size in tokens (GPU + CPU for two tiers:
        a tiered cache binds again once it knows its CPU tier), its block and its cost model
        (None: every token costs the same, `TokenCost`)."""
        self.capacity, self.block_size = capacity, block_size
        self.cost_model = cost_model if cost_model is not None else TokenCost()

    def prepare(self, tree: RadixTree, candidates: list[Node]) -> None:
        """Called with every victim candidate before they are ordered (a policy whose keys are
        normalized over the candidates computes the normalization here); nothing here."""

    def victim_key(self, tree: RadixTree, node: Node) -> tuple:
        """Order of eviction victims, smallest first: least recently used here."""
        return (node.last_access,)

    def observe(self, tree: RadixTree, tokens, hint) -> None:
        """A hint about the request of `tokens` (int64 [n]; `penelope.cache.hints.Hint`); ignored here."""

    def advance(self, now: float) -> None:
        """The caller's clock reads `now` seconds; ignored by policies without time-based rules."""

    def matched(self, tree: RadixTree, path: list[Node]) -> None:
        """`KVCache.match` walked `path` (root first, stamped); its last node may be the upper
        part of a split just made. Ignored here."""

    def inserted(self, tree: RadixTree, path: list[Node], earlier: int = 0) -> None:
        """`KVCache.insert` walked `path` (root first, stamped); a node may be the upper part
        of a split just made, the last one a new leaf. `earlier`: the first tokens of the path
        the same request inserted before (its checkpoints). Ignored here."""

    def evicted(self, tree: RadixTree, released: Released) -> None:
        """What one `evict` call deleted; ignored here."""

    def prefetch_candidates(self, tree: RadixTree) -> list[tuple[float, Node]]:
        """(value, node) of histories whose CPU blocks should come back to the GPU before their
        request, most valuable first (policies with `prefetches`); none here."""
        return []

    def first_node(self, tree: RadixTree, leaf: Node) -> Node:
        """Where eviction from victim `leaf` starts: the leaf itself unless a policy walks up."""
        return leaf

    def victim_nodes(self, tree: RadixTree, leaf: Node) -> list[Node]:
        """The nodes eviction (and a two-tier cache's demotion) takes blocks from, for victim
        `leaf`, in order: from `first_node` down to the leaf. Blocks are taken from the end of the
        leaf when `from_tail`, else from the front of each node in turn."""
        chain = [self.first_node(tree, leaf)]
        while chain[-1] is not leaf:
            # Between the start and the leaf every node has exactly one child (see first_node).
            chain.append(next(iter(chain[-1].children.values())))
        return chain

    # Whether victim keys can change while other victims are evicted (they read more than the
    # victim's own recency): then every step orders the current candidates afresh.
    fresh_keys: ClassVar[bool] = False

    def evict(self, tree: RadixTree, n_blocks: int) -> Released:
        """Free at least `n_blocks` resident blocks, or all that are evictable. Never touches a
        locked node. Node policies may free more than asked."""
        out = Released()
        root = tree.root
        # `is_candidate`, inline: this runs over every leaf of the tree.
        candidates = [leaf for leaf in tree.leaves if leaf.lock_ref == 0 and leaf.n_resident > 0
                      and not leaf.children and leaf.alive and leaf is not root]
        if self.fresh_keys:
            return self._evict_fresh(tree, n_blocks, candidates, out)
        heap = [(self.victim_key(tree, leaf), leaf.id, leaf) for leaf in candidates]
        heapq.heapify(heap)
        while out.blocks < n_blocks and heap:
            leaf = heapq.heappop(heap)[2]
            if not is_candidate(tree, leaf):
                continue
            survivor = tree.prune(self._evict_leaf(tree, leaf, n_blocks - out.blocks, out))
            if survivor is not None and is_candidate(tree, survivor):
                heapq.heappush(heap, (self.victim_key(tree, survivor), survivor.id, survivor))
        if out.blocks:
            self.evicted(tree, out)
        return out

    def _evict_fresh(self, tree: RadixTree, n_blocks: int, candidates: list[Node], out: Released) -> Released:
        """The same loop, each victim the smallest key among the candidates as they are now
        (pruning a sibling can lengthen a private history, changing its key)."""
        while out.blocks < n_blocks:
            candidates = [leaf for leaf in candidates if is_candidate(tree, leaf)]
            if not candidates:
                break
            self.prepare(tree, candidates)
            leaf = min(candidates, key=lambda node: (self.victim_key(tree, node), node.id))
            survivor = tree.prune(self._evict_leaf(tree, leaf, n_blocks - out.blocks, out))
            if survivor is not None and survivor not in candidates and is_candidate(tree, survivor):
                candidates.append(survivor)
        if out.blocks:
            self.evicted(tree, out)
        return out

    def _evict_leaf(self, tree: RadixTree, leaf: Node, need: int, out: Released) -> Node:
        """Free up to `need` blocks starting from victim `leaf`; return the node to prune from."""
        raise NotImplementedError


class TailPolicy(EvictionPolicy):
    """Delete blocks from the end of the leaf: nothing is left behind, no holes appear."""

    from_tail = True

    def _evict_leaf(self, tree, leaf, need, out):
        parent = leaf.parent
        tree.free_tail(leaf, leaf.n_resident if self.whole_node else need, out)
        return leaf if leaf.alive else parent


class HeadPolicy(EvictionPolicy):
    """Turn the front of a history into a hole, continuing forward along it toward the leaf."""

    def _evict_leaf(self, tree, leaf, need, out):
        for node in self.victim_nodes(tree, leaf):
            before = out.blocks
            tree.free_front(node, node.n_resident if self.whole_node else need, out)
            need -= out.blocks - before
            if not self.whole_node and out.blocks > before:
                tree.split_missing_front(node)
            if need <= 0:
                break
        return leaf


class PrivateHeadPolicy(HeadPolicy):
    def prefetch_candidates(self, tree: RadixTree) -> list[tuple[float, Node]]:
        """(value, node) of histories whose CPU blocks should come back to the GPU before their
        request, most valuable first (policies with `prefetches`); none here."""
        return []

    def first_node(self, tree: RadixTree, leaf: Node) -> Node:
        """Walk from the leaf toward the root to the earliest evictable block of its private
        history: stop before a parent that is the root, is shared (more than one child), is
        locked by a running request, or already holds no resident KV."""
        node = leaf
        while True:
            parent = node.parent
            if (parent is tree.root or len(parent.children) > 1 or parent.lock_ref > 0
                    or parent.n_resident == 0):
                return node
            node = parent


@register("leaf-tail-node", "sglang")
class LeafTailNode(TailPolicy):
    whole_node = True


@register("leaf-tail-block")
class LeafTailBlock(TailPolicy):
    whole_node = False


@register("leaf-head-node")
class LeafHeadNode(HeadPolicy):
    whole_node = True


@register("leaf-head-block")
class LeafHeadBlock(HeadPolicy):
    whole_node = False


@register("private-head-node")
class PrivateHeadNode(PrivateHeadPolicy):
    whole_node = True


@register("private-head-block", "penelope")
class PrivateHeadBlock(PrivateHeadPolicy):
    whole_node = False


# The agent-aware and cost-aware policies register themselves after the grid, then SGLang's own
# policies (unlisted: not in `--policies all`).
from penelope.cache import agent_policy, sglang_policies  # noqa: E402, F401
