"""Eviction policies: which victim, where in its history, and how much at a time.

One loop (`EvictionPolicy.evict`) frees blocks until enough are free, pruning what nothing can
reuse any more. It asks the policy three things:

- which victim: `priority(tree, leaf)` orders the unlocked leaves that still hold resident KV,
  smallest first; least recently used here. `penelope.cache.agent_policy` and
  `penelope.cache.sglang_policies` override it from hints, the cost model or SGLang's strategies.
- where in the victim's history: `first_node` (the node eviction starts from), `from_tail`
  (blocks come from the end of the leaf, else from the front of each node from `first_node` on)
  and `_evict_leaf` (abstract: frees them). One base class per where: `TailPolicy` (the leaf's
  tail, as SGLang), `HeadPolicy` (the leaf's head, which becomes a hole) and `PrivateHeadPolicy`
  (the head of the private history: walk from the leaf toward the root to its earliest evictable
  block, then continue forward).
- how much: `whole_node` (every resident block of each node taken) or only the blocks needed.

The paper's ablation grid is the six where x how-much classes at the end of this module, all
least recently used first: `private-head-block` is Penelope's policy, `leaf-tail-node` is SGLang's
RadixCache. The two-tier cache (`penelope.cache.tiers`) demotes in the same places
(`victim_nodes`, `from_tail`). `penelope.cache.policies` finds a policy by name.
"""
from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from typing import ClassVar

from penelope.cache.registry import register
from penelope.cache.tree import Node, RadixTree, Released
from penelope.costmodel.recompute import RecomputeCost, TokenCost
from penelope.errors import UsageError

# The six policies of the paper's ablation grid, SGLang's first.
PAPER_GRID = ("leaf-tail-node", "leaf-tail-block", "leaf-head-node", "leaf-head-block",
              "private-head-node", "private-head-block")


def is_candidate(tree: RadixTree, node: Node) -> bool:
    """An eviction victim: a live unlocked leaf that still holds resident KV."""
    return (node.alive and node is not tree.root and not node.children
            and node.lock_ref == 0 and node.n_resident > 0)


def private_history_start(tree: RadixTree, leaf: Node) -> Node:
    """The first node of `leaf`'s private history: walk from the leaf toward the root and stop
    before a parent that is the root, is shared (more than one child), is locked by a running
    request, or already holds no resident KV. Every node from there to the leaf has one child."""
    node = leaf
    while True:
        parent = node.parent
        if (parent is tree.root or len(parent.children) > 1 or parent.lock_ref > 0
                or parent.n_resident == 0):
            return node
        node = parent


class EvictionPolicy(ABC):
    """Chooses which blocks to free (see the module docstring). A policy subclasses one where
    (`TailPolicy`, `HeadPolicy`, `PrivateHeadPolicy`), sets `whole_node` and may override
    `priority`.

    `uses_foresight`: the policy may receive the future in hints (the offline oracle only). A
    policy object keeps state for one cache: do not share it."""

    name: ClassVar[str] = ""
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

    # Which victim: `priority`, after `prepare`. `fresh_keys`: priorities can change while other
    # victims are evicted (they read more than the victim's own recency), so every step orders
    # the current candidates afresh.
    fresh_keys: ClassVar[bool] = False

    def prepare(self, tree: RadixTree, candidates: list[Node]) -> None:  # noqa: B027 - a hook, empty unless a policy needs it
        """Called with every victim candidate before they are ordered (a policy whose priorities
        are normalized over the candidates computes the normalization here); nothing here."""

    def priority(self, tree: RadixTree, node: Node) -> tuple:
        """Order of eviction victims, smallest first (ties: the smaller node id): least recently
        used here."""
        return (node.last_access,)

    # Where in the victim's history: `from_tail`, `first_node` and `victim_nodes` say which blocks
    # eviction (and a two-tier cache's demotion) takes; `_evict_leaf` frees them.
    from_tail: ClassVar[bool] = False

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

    @abstractmethod
    def _evict_leaf(self, tree: RadixTree, leaf: Node, need: int, out: Released) -> Node:
        """Free up to `need` blocks (all of each node's when `whole_node`) starting from victim
        `leaf`, adding them to `out`; return the node to prune from."""

    # How much: every resident block of each node the where visits, or only the blocks needed.
    whole_node: ClassVar[bool] = False

    # What the cache tells the policy: hooks for policies that keep state of their own.
    def observe(self, tree: RadixTree, tokens, hint) -> None:  # noqa: B027 - a hook, empty unless a policy needs it
        """A hint about the request of `tokens` (int64 [n]; `penelope.cache.hints.Hint`); ignored here."""

    def advance(self, now: float) -> None:  # noqa: B027 - a hook, empty unless a policy needs it
        """The caller's clock reads `now` seconds; ignored by policies without time-based rules."""

    def matched(self, tree: RadixTree, path: list[Node]) -> None:  # noqa: B027 - a hook, empty unless a policy needs it
        """`KVCache.match` walked `path` (root first, stamped); its last node may be the upper
        part of a split just made. Ignored here."""

    def inserted(self, tree: RadixTree, path: list[Node], earlier: int = 0) -> None:  # noqa: B027 - a hook, empty unless a policy needs it
        """`KVCache.insert` walked `path` (root first, stamped); a node may be the upper part
        of a split just made, the last one a new leaf. `earlier`: the first tokens of the path
        the same request inserted before (its checkpoints). Ignored here."""

    def evicted(self, tree: RadixTree, released: Released) -> None:  # noqa: B027 - a hook, empty unless a policy needs it
        """What one `evict` call deleted; ignored here."""

    def prefetch_candidates(self, tree: RadixTree) -> list[tuple[float, Node]]:
        """(value, node) of histories whose CPU blocks should come back to the GPU before their
        request, most valuable first (policies with `prefetches`); none here."""
        return []

    # The loop every policy shares: candidates in priority order, each evicted where the policy
    # says, until enough blocks are free.
    def evict(self, tree: RadixTree, n_blocks: int) -> Released:
        """Free at least `n_blocks` resident blocks, or all that are evictable. Never touches a
        locked node. Node policies may free more than asked."""
        out = Released()
        if type(self).priority is EvictionPolicy.priority and not self.fresh_keys:
            # Least recently used, the default `priority`: the tree's heap of leaves by stamp.
            return self._evict_by_recency(tree, n_blocks, out)
        root = tree.root
        # `is_candidate`, inline: this runs over every leaf of the tree.
        candidates = [leaf for leaf in tree.leaves if leaf.lock_ref == 0 and leaf.n_resident > 0
                      and not leaf.children and leaf.alive and leaf is not root]
        if self.fresh_keys:
            return self._evict_fresh(tree, n_blocks, candidates, out)
        heap = [(self.priority(tree, leaf), leaf.id, leaf) for leaf in candidates]
        heapq.heapify(heap)
        while out.blocks < n_blocks and heap:
            leaf = heapq.heappop(heap)[2]
            if not is_candidate(tree, leaf):
                continue
            survivor = tree.prune(self._evict_leaf(tree, leaf, n_blocks - out.blocks, out))
            if survivor is not None and is_candidate(tree, survivor):
                heapq.heappush(heap, (self.priority(tree, survivor), survivor.id, survivor))
        if out.blocks:
            self.evicted(tree, out)
        return out

    def _evict_by_recency(self, tree: RadixTree, n_blocks: int, out: Released) -> Released:
        """The same loop in least-recently-used order, on the tree's recency heap
        (`RadixTree.recency_heap`): the victims are the candidates, oldest stamp first, as the
        loop above would order them, without a scan of every leaf. A leaf that a victim's removal
        leaves behind joins the heap as the tree removes the victim."""
        heap = tree.recency_heap()
        # Entries of current leaves that cannot be evicted now (locked, or holding no resident
        # block): pushed back afterwards, since they stay leaves with these stamps.
        kept = []
        while out.blocks < n_blocks and heap:
            entry = heapq.heappop(heap)
            stamp, _, leaf = entry
            if not leaf.alive or leaf.children or leaf.last_access != stamp:
                continue  # stale
            if leaf.lock_ref or not leaf.n_resident:
                kept.append(entry)
                continue
            tree.prune(self._evict_leaf(tree, leaf, n_blocks - out.blocks, out))
            if leaf.alive and not leaf.children:
                # Part of it is left: still a leaf, with its stamp.
                heapq.heappush(heap, entry)
        for entry in kept:
            heapq.heappush(heap, entry)
        if out.blocks:
            self.evicted(tree, out)
        return out

    def _evict_fresh(self, tree: RadixTree, n_blocks: int, candidates: list[Node], out: Released) -> Released:
        """The same loop, each victim the smallest priority among the candidates as they are now
        (pruning a sibling can lengthen a private history, changing its priority)."""
        while out.blocks < n_blocks:
            candidates = [leaf for leaf in candidates if is_candidate(tree, leaf)]
            if not candidates:
                break
            self.prepare(tree, candidates)
            leaf = min(candidates, key=lambda node: (self.priority(tree, node), node.id))
            survivor = tree.prune(self._evict_leaf(tree, leaf, n_blocks - out.blocks, out))
            if survivor is not None and survivor not in candidates and is_candidate(tree, survivor):
                candidates.append(survivor)
        if out.blocks:
            self.evicted(tree, out)
        return out


class TailPolicy(EvictionPolicy):
    """Where: the leaf's tail. Blocks go from the end of the leaf: nothing is left behind, no
    holes appear."""

    from_tail = True

    def _evict_leaf(self, tree, leaf, need, out):
        parent = leaf.parent
        tree.free_tail(leaf, leaf.n_resident if self.whole_node else need, out)
        return leaf if leaf.alive else parent


class HeadPolicy(EvictionPolicy):
    """Where: the leaf's head. The front of the history becomes a hole, continuing forward along
    `victim_nodes` toward the leaf."""

    from_tail = False

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
    """Where: the head of the private history. Eviction starts at `private_history_start` and
    continues forward, as `HeadPolicy`."""

    def first_node(self, tree: RadixTree, leaf: Node) -> Node:
        """The earliest evictable node of the leaf's private history (`private_history_start`)."""
        return private_history_start(tree, leaf)


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
