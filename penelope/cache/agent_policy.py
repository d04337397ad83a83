"""Agent-aware and cost-aware eviction: the published alternatives, `private-head-block` with an
agent-aware choice of victim, and the offline oracle.

The grid (`penelope.cache.policy`) answers WHERE to evict inside a history. These policies also
choose WHICH history goes first (their `priority`), from what the server tells the cache
(`penelope.cache.hints`: the kind of wait a session is in, the time) and from the cost model:

- `ttl` (Continuum / CacheTTL, Li et al., arXiv 2511.02230): after a request whose reply ends in a
  tool call, its session's KV is pinned for a time-to-live; SGLang's tail eviction (whole leaves,
  least recently used) otherwise, pinned leaves last. The TTL maximizes the pin's expected benefit
  minus its memory cost over the tool waits observed so far: tau* = argmax_tau F(tau) * B - tau * M,
  with F the observed tool-wait distribution, B the recompute cost of the session's private history
  times (1 + the other requests in the system, who queue behind that recompute) and M the cost of
  holding its tokens (their share of the capacity times the recompute cost the cache has been
  deleting per second). A pin expires on its own. Our reading of the paper, not its code.
- `flop-recency` (Marconi, Pan et al., MLSys 2025): whole leaves from the tail, ordered by
  normalized recency + alpha * normalized FLOP efficiency (recompute cost saved per token held);
  alpha = 1 (Marconi tunes alpha online; fixed here).
- `penelope-agent`: `private-head-block`'s position (the front of the private history, only the
  blocks needed) with the victim session chosen by the expected cost of losing its blocks: the
  recompute cost of the next block to go (the cost model) times the chance that its session
  returns within a short window h, about h / R for a session whose remaining wait is R. R is the
  median remaining wait of the waits observed so far in this run of the session's kind (tool or
  person) that outlast the wait it has had (inf when none does: it waited longer than anyone came
  back after); h drops out of the order. So it is the oracle's rule below with the next use
  replaced by its expectation. Histories no waiting session or arrived request holds (branches a
  rewritten turn left) go first; histories of arrived requests last. With a CPU tier it also
  prefetches (KVFlow, Pan et al., arXiv 2507.07400, loads an agent's KV before its next step): a
  tool-waiting session's CPU blocks come back to the GPU, through the swap buffer when both tiers
  are full, when the GPU victims they displace are worth less than half as much.
  `penelope-agent-no-prefetch` (an ablation, not in `--policies all`) is the same without it.
- `oracle`: offline, told every session's next send time and how much of its history the next
  request reuses. It deletes dead blocks first (the part of a history the next request does not
  reuse, from its tail, and histories no session will use again), then evicts from the front of
  the private history of the session with the largest time to next use per unit of recompute cost
  of its next block (cost-aware farthest next use). A reference, never a deployable policy;
  `penelope.sim.bound` bounds the optimum from below.

Hints come with the caller's time; recency stays the tree's logical clock. Without hints every
policy here still runs: sessions without a record tie and go least recently used first.
"""
from __future__ import annotations

import math

import numpy as np

from penelope.cache.hints import ARRIVED, TOOL, WaitBook, Waiting
from penelope.cache.policy import EvictionPolicy, PrivateHeadPolicy, TailPolicy, private_history_start
from penelope.cache.registry import register
from penelope.cache.tree import BlockState, Node, RadixTree, Released

_MISSING = int(BlockState.MISSING)
# Expected remaining waits below this (seconds) count as this: the session is back any moment.
_SHORTEST_WAIT = 1e-3


def sequence_hashes(tree: RadixTree, tokens: np.ndarray) -> np.ndarray:
    """Prefix hashes (uint64 [whole blocks]) of `tokens`, as the tree stamps its blocks."""
    bs = tree.block_size
    return tree.hasher.extend(0, 0, tokens[:len(tokens) // bs * bs])


def _end_node(tree: RadixTree, tokens: np.ndarray) -> Node | None:
    """The node where the whole blocks of `tokens` end, if the tree holds a node ending there."""
    n_blocks = len(tokens) // tree.block_size
    path, last = tree.walk(tokens, n_blocks)
    if path and last == path[-1].n_blocks and path[-1].end == n_blocks * tree.block_size:
        return path[-1]
    return None


class HintedPolicy(EvictionPolicy):
    """A policy that reads hints: the book of waiting sessions and what it has deleted so far."""

    fresh_keys = True

    def __init__(self):
        self.book = WaitBook()
        self.deleted_cost = 0.0
        self.first_deletion: float | None = None

    def advance(self, now: float) -> None:
        self.book.advance(now)

    def observe(self, tree: RadixTree, tokens, hint) -> None:
        self.book.advance(hint.now)
        hashes = sequence_hashes(tree, tokens)
        if hint.event == ARRIVED:
            self.book.arrived(hashes, hint.now)
            return
        record = self.book.finished(hashes, hint)
        record.node = _end_node(tree, tokens)
        self.finished(tree, record)

    def finished(self, tree: RadixTree, record: Waiting) -> None:
        """A session started waiting (`record`); nothing more here."""

    def evicted(self, tree: RadixTree, released: Released) -> None:
        if self.first_deletion is None:
            self.first_deletion = self.book.now
        self.deleted_cost += sum(self.cost_model.span_cost(a, b) for a, b in released.ranges)

    def records_for(self, tree: RadixTree, node: Node) -> list[Waiting]:
        """Waiting sessions whose sequence contains the sequence ending at `node`."""
        return self.book.sessions_of(node.end // tree.block_size, int(node.hashes[-1]))

    def in_use(self, tree: RadixTree, node: Node) -> bool:
        """Whether a request that arrived and has not finished holds the sequence ending at `node`."""
        return self.book.arrived_holds(node.end // tree.block_size, int(node.hashes[-1]))

    def deleted_cost_rate(self) -> float:
        """Recompute cost of the KV deleted per second since the first deletion (0 before)."""
        elapsed = self.book.now - (self.first_deletion if self.first_deletion is not None else self.book.now)
        return self.deleted_cost / elapsed if elapsed > 0 else 0.0


@register("ttl")
class TtlPolicy(HintedPolicy, TailPolicy):
    """Continuum-style time-to-live pins after tool calls over SGLang's eviction (see the module
    docstring)."""

    whole_node = True

    def finished(self, tree: RadixTree, record: Waiting) -> None:
        if record.kind == TOOL and record.node is not None:
            record.pin_until = record.since + self.ttl(tree, record.node)

    def ttl(self, tree: RadixTree, end: Node) -> float:
        """tau* = argmax over tau in {0} + observed tool waits of F(tau) * B - tau * M (seconds)."""
        waits = np.asarray(self.book.observed[TOOL])
        if not len(waits):
            # Cold start: no tool wait observed yet, nothing to size a pin with.
            return 0.0
        private = private_history_start(tree, end).start
        held = end.end - private
        benefit = self.cost_model.span_cost(private, end.end) * (1 + self.book.in_system)
        hold_cost = held / max(self.capacity, 1) * self.deleted_cost_rate()
        utility = np.arange(1, len(waits) + 1) / len(waits) * benefit - waits * hold_cost
        best = int(np.argmax(utility))
        return float(waits[best]) if utility[best] > 0 else 0.0

    def priority(self, tree: RadixTree, node: Node) -> tuple:
        now = self.book.now
        pinned = any(record.pin_until > now for record in self.records_for(tree, node))
        return (pinned, node.last_access)


@register("flop-recency")
class FlopRecency(TailPolicy):
    """Marconi-style utility: normalized recency + alpha * normalized recompute cost saved per
    token held, whole leaves from the tail (see the module docstring)."""

    whole_node = True
    fresh_keys = True
    alpha = 1.0
    # (low, high) of the candidates' recency and efficiency, set by `prepare`.
    _recency: tuple[float, float] | None = None
    _efficiency_range: tuple[float, float] | None = None

    def prepare(self, tree: RadixTree, candidates: list[Node]) -> None:
        stamps = [node.last_access for node in candidates] or [0]
        efficiency = [self._efficiency(node) for node in candidates] or [0.0]
        self._recency = (min(stamps), max(stamps))
        self._efficiency_range = (min(efficiency), max(efficiency))

    def priority(self, tree: RadixTree, node: Node) -> tuple:
        low, high = self._recency or (node.last_access, node.last_access)
        recency = (node.last_access - low) / (high - low) if high > low else 1.0
        low, high = self._efficiency_range or (0.0, 0.0)
        efficiency = (self._efficiency(node) - low) / (high - low) if high > low else 1.0
        return (recency + self.alpha * efficiency, node.last_access)

    def _efficiency(self, node: Node) -> float:
        """Recompute cost the node's tokens save per token (Marconi: FLOPs saved per byte)."""
        return self.cost_model.span_cost(node.start, node.end) / max(node.end - node.start, 1)


def front_block_cost(policy: PrivateHeadPolicy, tree: RadixTree, node: Node) -> float:
    """Recompute cost of the next block `policy` (`private-head-block`'s eviction point) would take
    from the private history that ends at `node` (its first resident block); 0 when none is
    resident."""
    bs = tree.block_size
    for part in policy.victim_nodes(tree, node):
        resident = np.flatnonzero(part.state != _MISSING)
        if len(resident):
            position = part.start + int(resident[0]) * bs
            return float(policy.cost_model.span_cost(position, position + bs))
    return 0.0


@register("penelope-agent")
class PenelopeAgent(HintedPolicy, PrivateHeadPolicy):
    """`private-head-block`'s eviction point, the victim session by expected loss (see the module
    docstring)."""

    whole_node = False
    prefetches = True
    # A prefetch displaces GPU victims only when it is worth this many times more than they are.
    PREFETCH_MARGIN = 2.0

    def priority(self, tree: RadixTree, node: Node) -> tuple:
        return (self.expected_loss(tree, node), node.last_access)

    def expected_loss(self, tree: RadixTree, node: Node) -> float:
        """Recompute cost of the next block to go x the chance its session returns within a short
        window h, about h / (its expected remaining wait); h is the same for every candidate and is
        left out. inf for a history an arrived request holds, -1 for an orphan (no waiting session
        or arrived request holds it), 0 for a session expected never to return."""
        records = self.records_for(tree, node)
        if not records:
            return math.inf if self.in_use(tree, node) else -1.0
        remaining = min(self.book.expected_remaining(record) for record in records)
        return front_block_cost(self, tree, node) / max(remaining, _SHORTEST_WAIT)

    def prefetch_candidates(self, tree: RadixTree) -> list[tuple[float, Node]]:
        """Tool-waiting sessions whose history has blocks on the CPU tier, most valuable first:
        (expected loss, the node where the history ends)."""
        out = []
        for record in self.book.waiting:
            node = record.node
            if record.kind != TOOL or node is None or not node.alive or node.children:
                continue
            if all(part.n_resident == part.n_gpu for part in tree.path_to_root(node)):
                continue
            out.append((self.expected_loss(tree, node), node))
        out.sort(key=lambda item: (-item[0], item[1].id))
        return out


@register("penelope-agent-no-prefetch", listed=False)
class PenelopeAgentNoPrefetch(PenelopeAgent):
    """`penelope-agent` without its prefetch: the ablation that measures the prefetch alone."""

    prefetches = False


@register("oracle")
class Oracle(HintedPolicy, PrivateHeadPolicy):
    """Offline reference: dead blocks first, then cost-aware farthest next use, from the front of
    the private history (see the module docstring). Needs `Foresight` in its finished hints."""

    whole_node = False
    uses_foresight = True

    def _future(self, tree: RadixTree, node: Node) -> tuple[float, int]:
        """(next use, reused tokens) of the sequence ending at `node`: now for an arrived request's,
        the soonest next send of the waiting sessions that hold it, and never (reusing nothing)
        for an orphan."""
        if self.in_use(tree, node):
            return (self.book.now, node.end)
        # A record whose next send has passed is stale: its session came back with a sequence
        # that does not continue this one (a rewritten turn) and holds what it reuses itself.
        futures = [(r.foresight.next_send, r.foresight.reuse) for r in self.records_for(tree, node)
                   if r.foresight is not None and r.foresight.next_send >= self.book.now]
        return min(futures) if futures else (math.inf, 0)

    def _dead_blocks(self, node: Node, reuse: int) -> np.ndarray:
        """Resident blocks of `node` at positions the session's next request does not reuse."""
        bs = len(node.slots) // node.n_blocks
        starts = node.start + np.arange(node.n_blocks) * bs
        return np.flatnonzero((starts + bs > reuse) & (node.state != _MISSING))

    def priority(self, tree: RadixTree, node: Node) -> tuple:
        """Dead blocks first; then the largest time to next use per unit of recompute cost of the
        next block to go (farthest next use, weighed by what losing the block costs)."""
        next_use, reuse = self._future(tree, node)
        if len(self._dead_blocks(node, reuse)):
            return (0, 0.0, node.last_access)
        cost = max(front_block_cost(self, tree, node), 1e-30)
        return (1, -(next_use - self.book.now) / cost, node.last_access)

    def _evict_leaf(self, tree: RadixTree, leaf: Node, need: int, out: Released) -> Node:
        dead = self._dead_blocks(leaf, self._future(tree, leaf)[1])
        if len(dead):
            parent = leaf.parent
            # Dead blocks are the leaf's last ones: delete them from its tail.
            tree.free_tail(leaf, min(need, len(dead)), out)
            return leaf if leaf.alive else parent
        return super()._evict_leaf(tree, leaf, need, out)
