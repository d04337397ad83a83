"""SGLang 0.5.23's own radix eviction policies, ported into Penelope's cache as baselines.

SGLang's default cache, `UnifiedRadixCache` (the one `--radix-eviction-policy tlru` and
`--enable-session-radix-cache` require), evicts whole unlocked leaves, one at a time, from a heap
ordered by a strategy's priority (`sglang/srt/mem_cache/evict_policy.py`); a parent whose last
child went becomes a leaf and joins the heap with the priority it has then. The strategies read
per-node metadata that Penelope's tree does not keep, so these policies keep it beside the tree,
updated from the cache's `matched` / `inserted` calls exactly as SGLang's tree core updates it:

- recency: a logical counter (SGLang's `get_and_increase_time_counter`, not a clock). A match
  stamps the matched path from its deepest node up (each ancestor a hair older); splitting a node
  stamps the part below the split afresh (older than the match). An insert stamps every node it
  walks, one tick each, root first; a node it splits keeps the older stamp of its creation above
  the freshly stamped lower part; a new leaf is stamped last.
- `hit_count`: +1 for every node an insert walks or adds that ends beyond what the same request
  inserted before (its checkpoints after earlier chunks, SGLang's `inserted_len`), copied to the
  upper part of a split; matches do not count.
- T-LRU: a node's depth (`node.end`) and its branch's high-water depth, raised up the ancestors
  by every new leaf, inherited by a split's upper part, never lowered by eviction.
- sessions (`--enable-session-radix-cache`): see `SGLangSession`.

Priorities, smallest evicted first: `sglang-lru` the stamp; `sglang-lfu` (hit_count, stamp);
`sglang-slru` (hit_count >= protected_threshold, stamp); `sglang-tlru` (-1 if TEL-safe else 0,
stamp), TEL-safe when the tokens above the node cover the conversation's budget
max(history + next_prompt_estimate - threshold, 0); `sglang-session` (referenced, references,
stamp). `tests/sglang/test_policy_equivalence.py` replays the same operations through SGLang's
class and these ports and checks the same tokens are evicted in the same order.

Settings follow SGLang's `--radix-eviction-policy-config`, as `name:key=value:...` in
`--policies` (e.g. `sglang-tlru:threshold=8192:next_prompt_estimate=1024`).
"""
from __future__ import annotations

import re
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from penelope.cache.hints import FINISHED
from penelope.cache.policy import TailPolicy
from penelope.cache.registry import register
from penelope.cache.tree import Node, RadixTree, Released
from penelope.errors import UsageError

# SGLang's match stamps each ancestor of the matched node this much older than its child.
_ANCESTOR_STEP = 0.00001


@dataclass
class _Meta:
    """What SGLang's tree node keeps for eviction: `stamp` (last_access_time), `hits`
    (hit_count), `history` (T-LRU's high-water depth, tokens), `refs` (session_ref) and `marks`
    (the sessions whose frontier the node is)."""

    stamp: float
    hits: int = 0
    history: int = 0
    refs: int = 0
    marks: set[str] = field(default_factory=set)


class SGLangPolicy(TailPolicy):
    """Whole leaves from the tail in the order of SGLang's strategy priority (`strategy_priority`,
    see the module docstring). A GPU-only cache: SGLang's host tier (HiCache) is another design."""

    whole_node = True
    splits_reply_off = True
    # Settings as in SGLang's --radix-eviction-policy-config: name -> default (ints, tokens).
    settings: ClassVar[dict[str, int]] = {}

    def __init__(self, **values):
        unknown = sorted(set(values) - set(self.settings))
        if unknown:
            raise UsageError(f"eviction policy {self.name!r} has no setting {unknown[0]!r} "
                             f"(settings: {', '.join(self.settings) or 'none'})")
        negative = [key for key, value in values.items() if value < 0]
        if negative:
            raise UsageError(f"eviction policy {type(self).name!r}: setting {negative[0]}={values[negative[0]]} "
                             "must be non-negative")
        for key, default in self.settings.items():
            setattr(self, key, values.get(key, default))
        changed = [f"{key}={getattr(self, key)}" for key, default in self.settings.items()
                   if getattr(self, key) != default]
        # Settings away from the defaults are part of the name, so two configurations are two policies.
        self.name = ":".join([type(self).name, *changed])
        self.check_settings()
        self.meta: dict[int, _Meta] = {}
        self.clock = 0.0
        self.meta[0] = _Meta(self._tick())

    @classmethod
    def from_settings(cls, text: str) -> SGLangPolicy:
        """The policy configured by `key=value:key=value` (integer values)."""
        values = {}
        for item in text.split(":"):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or not key or not re.fullmatch(r"-?[0-9]+", value.strip()):
                raise UsageError(f"eviction policy {cls.name!r}: setting {item!r} is not key=integer")
            if key in values:
                raise UsageError(f"eviction policy {cls.name!r}: setting {key!r} given twice")
            values[key] = int(value)
        return cls(**values)

    def check_settings(self) -> None:
        """Refuse settings SGLang refuses (UsageError); nothing to check here."""

    def bind(self, capacity, block_size, cost_model=None) -> None:
        if self.owner is not None and capacity != self.owner.capacity:
            raise UsageError(f"{self.name} models SGLang's GPU radix cache: run it without a CPU tier")
        super().bind(capacity, block_size, cost_model)

    @abstractmethod
    def strategy_priority(self, node: Node, meta: _Meta) -> tuple:
        """The priority of SGLang's strategy (its `get_priority`) from the node's metadata."""

    def priority(self, tree: RadixTree, node: Node) -> tuple:
        return self.strategy_priority(node, self.meta[node.id])

    def _tick(self) -> float:
        self.clock += 1.0
        return self.clock

    def _split_upper(self, node: Node) -> Node | None:
        """The lower part of a split whose upper part `node` the policy has not seen yet (None
        when `node` is known)."""
        if node.id in self.meta:
            return None
        lower = next(child for child in node.children.values() if child.id in self.meta)
        below = self.meta[lower.id]
        self.meta[node.id] = _Meta(0.0, hits=below.hits, history=below.history, refs=below.refs)
        return lower

    def matched(self, tree: RadixTree, path: list[Node]) -> None:
        if not path:
            return
        lower = self._split_upper(path[-1])
        if lower is not None:
            self.meta[lower.id].stamp = self._tick()
        stamp = self._tick()
        for depth, node in enumerate(reversed(path)):
            self.meta[node.id].stamp = stamp - depth * _ANCESTOR_STEP

    def inserted(self, tree: RadixTree, path: list[Node], earlier: int = 0) -> None:
        if not path:
            return
        self._tick()
        for node in path:
            if node.id in self.meta:
                self.meta[node.id].stamp = self._tick()
            elif node.children:
                lower = self._split_upper(node)
                # SGLang touches the node, splits it (the upper part created, then the lower
                # part stamped), and goes on from the upper part.
                self._tick()
                self.meta[node.id].stamp = self._tick()
                self._tick()
                self.meta[lower.id].stamp = self._tick()
            else:
                self.meta[node.id] = _Meta(self._tick(), history=node.end)
                self._tick()
                self._raise_history(node)
            if node.end > earlier:
                self.meta[node.id].hits += 1

    def _raise_history(self, leaf: Node) -> None:
        """A new leaf raised its branch's high-water depth (T-LRU only)."""

    def _evict_leaf(self, tree, leaf, need, out: Released):
        parent = leaf.parent
        self._deleting(leaf)
        tree.free_tail(leaf, leaf.n_resident, out)
        del self.meta[leaf.id]
        return parent

    def _deleting(self, leaf: Node) -> None:
        """`leaf` leaves the tree (sessions only)."""


@register("sglang-lru", listed=False)
class SGLangLRU(SGLangPolicy):
    def strategy_priority(self, node, meta):
        return (meta.stamp,)


@register("sglang-lfu", listed=False)
class SGLangLFU(SGLangPolicy):
    def strategy_priority(self, node, meta):
        return (meta.hits, meta.stamp)


@register("sglang-slru", listed=False)
class SGLangSLRU(SGLangPolicy):
    settings = {"protected_threshold": 2}

    def strategy_priority(self, node, meta):
        return (int(meta.hits >= self.protected_threshold), meta.stamp)


@register("sglang-tlru", listed=False)
class SGLangTLRU(SGLangPolicy):
    """T-LRU. SGLang's own defaults (0, 0) are refused by its server, so the defaults here are
    the example of SGLang's --radix-eviction-policy-config help: 4096 and 512 tokens."""

    settings = {"threshold": 4096, "next_prompt_estimate": 512}

    def check_settings(self) -> None:
        if self.threshold < 0 or self.next_prompt_estimate < 0:
            raise UsageError(f"{self.name}: threshold and next_prompt_estimate must be non-negative")
        if self.threshold <= self.next_prompt_estimate:
            raise UsageError(f"{self.name}: threshold {self.threshold} must exceed next_prompt_estimate "
                             f"{self.next_prompt_estimate} (SGLang refuses it: T-LRU would be plain LRU)")

    def strategy_priority(self, node, meta):
        budget = max(meta.history + self.next_prompt_estimate - self.threshold, 0)
        return (-1 if node.start >= budget else 0, meta.stamp)

    def _raise_history(self, leaf):
        depth = leaf.end
        node = leaf.parent
        while node is not None and self.meta[node.id].history < depth:
            self.meta[node.id].history = depth
            node = node.parent


@register("sglang-session", listed=False)
class SGLangSession(SGLangPolicy):
    """`--enable-session-radix-cache` over LRU. A finished request's session marks the node its
    sequence ends on as a frontier and adds one reference to every node from there up to the
    frontier it extends (or the root); closing the session takes its frontiers' references back.
    When a frontier is evicted, its parent becomes the frontier (its reference on the evicted node
    goes; if the parent already is one, the whole path's). Unreferenced KV goes first, then the
    least referenced, least recently used first.

    The session comes with the server's `finished` hint (`Hint.session`); a session closes when
    its last request finishes (`Hint.closes`), as a client calls SGLang's close_session after
    its last turn; `close=0` never closes one (clients that never call it)."""

    settings = {"close": 1}

    def __init__(self, **values):
        super().__init__(**values)
        self.frontiers: dict[str, set[Node]] = {}
        self.closed: set[str] = set()

    def check_settings(self) -> None:
        if self.close not in (0, 1):
            raise UsageError(f"{self.name}: close must be 1 (sessions close after their last request) or 0")

    def strategy_priority(self, node, meta):
        return (meta.refs > 0, meta.refs, meta.stamp)

    def observe(self, tree: RadixTree, tokens, hint) -> None:
        if hint.event != FINISHED or hint.session is None or hint.session in self.closed:
            return
        n_blocks = len(tokens) // tree.block_size
        path, last = tree.walk(tokens, n_blocks)
        if path and last == path[-1].n_blocks:
            self._register(tree, hint.session, path[-1])
        if hint.closes and self.close:
            self._release(tree, hint.session)

    def _register(self, tree: RadixTree, session: str, leaf: Node) -> None:
        frontier = self.frontiers.setdefault(session, set())
        if leaf in frontier:
            return
        old = leaf.parent
        while old is not tree.root and old not in frontier:
            old = old.parent
        node = leaf
        while node is not old:
            self.meta[node.id].refs += 1
            node = node.parent
        self._mark(session, leaf)
        if old is not tree.root:
            self._unmark(session, old)

    def _release(self, tree: RadixTree, session: str) -> None:
        self.closed.add(session)
        for leaf in tuple(self.frontiers.get(session, ())):
            self._recede(tree, leaf, tree.root)
            self._unmark(session, leaf)

    def _deleting(self, leaf: Node) -> None:
        meta = self.meta[leaf.id]
        tree = self.owner.tree
        for session in tuple(meta.marks):
            parent = leaf.parent
            fallback = parent if parent is not tree.root and parent not in self.frontiers[session] else None
            self._recede(tree, leaf, fallback if fallback is not None else tree.root)
            self._unmark(session, leaf)
            if fallback is not None:
                self._mark(session, fallback)

    def _recede(self, tree: RadixTree, leaf: Node, stop: Node) -> None:
        node = leaf
        while node is not stop and node is not tree.root:
            self.meta[node.id].refs -= 1
            node = node.parent

    def _mark(self, session: str, node: Node) -> None:
        self.frontiers.setdefault(session, set()).add(node)
        self.meta[node.id].marks.add(session)

    def _unmark(self, session: str, node: Node) -> None:
        frontier = self.frontiers[session]
        frontier.discard(node)
        self.meta[node.id].marks.discard(session)
        if not frontier:
            del self.frontiers[session]
