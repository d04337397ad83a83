"""A slow, obvious model of the cache manager, for property tests.

One Python object per block, a trie keyed by the whole block's tokens, no numpy and no
counters: everything is recomputed by walking. Radix-tree nodes are modelled by a flag on the
block that starts each node, because the node policies (SGLang's) evict whole nodes, so node
boundaries are part of the behaviour. A node is named by its LAST block, which stays the same
when its front is split off.

Rules (docs/design.md section 3, written out per block):
- match/insert walk whole blocks through any state; when the walk stops inside a node, the node
  is split there; every block on the path gets the new clock value.
- insert refills MISSING blocks on the path with the passed slots, keeps resident slots (other
  passed slots are returned), and adds the remaining blocks as one new node.
- eviction victim: the unlocked leaf node with resident KV and the smallest clock value.
  tail policies delete blocks from its end; head policies mark blocks from the front of a start
  node MISSING (leaf-head: the leaf; private-head: walk up while the parent node is not the root,
  has one child, is unlocked and holds resident KV), continuing down toward the leaf; block
  policies free only what is needed and split the missing front off; node policies free whole
  nodes. Then prune: an unlocked childless node without resident KV is deleted, and so on up.

Policies beyond the grid (`penelope.cache.agent_policy`) change only WHICH leaf goes first (ttl and
flop-recency evict like leaf-tail-node, penelope-agent and oracle like private-head-block; the
oracle first deletes dead blocks from a leaf's tail). Their order is recomputed here from hints
kept as plain token tuples, before every victim:
- sessions: a finished request's whole blocks wait (kind, since, foresight, pin); an arrival
  whose tokens repeat all but 1/256 of a waiting sequence's blocks ends that wait (observed);
  a leaf's sequence (root to its end) is held by the waiting sequences and arrived requests that
  start with it;
- ttl: leaves held by a session whose pin has not expired go last; the pin after a tool call is
  the observed tool wait w maximizing (rank of w) / n * B - w * M, written out below;
- flop-recency: recency and cost per token of the leaf's node, each scaled to [0, 1] over the
  candidates, summed;
- penelope-agent: -1 for a leaf nobody holds, inf for one an arrived request holds, else the
  cost of the first resident block of its private history / the median remaining wait among
  observed waits longer than the elapsed one (its kind's if 3 were seen, else all kinds', else
  the elapsed wait);
- oracle: dead blocks (past what the next request reuses, or no future at all) first, else
  -(time to next use) / (cost of the first resident private block).
Ties break on recency.
"""
from __future__ import annotations

import bisect
import math

GPU, MISSING = "GPU", "MISSING"
BEYOND = {"ttl": "leaf-tail-node", "flop-recency": "leaf-tail-node", "penelope-agent": "private-head-block",
          "oracle": "private-head-block"}


class Block:
    def __init__(self, tokens, parent, index):
        self.tokens, self.parent, self.index = tokens, parent, index
        self.children: dict[tuple, Block] = {}
        self.state, self.slots = MISSING, None
        self.starts_node, self.stamp, self.lock = True, 0, 0


class ReferenceCache:
    def __init__(self, capacity: int, block_size: int, policy: str, cost_model=None):
        aliases = {"sglang": "leaf-tail-node", "penelope": "private-head-block"}
        self.policy = aliases.get(policy, policy)
        self.where, self.how = BEYOND.get(self.policy, self.policy).rsplit("-", 1)
        self.capacity, self.bs = capacity, block_size
        self.cost = cost_model
        self.root = Block((), None, -1)
        self.clock = 0
        # Every whole-block prefix ever inserted: what statistics call "cached before".
        self.ever: set[tuple] = set()
        # Hints: the time, waiting sessions, arrived requests, observed waits, deletions.
        self.now = 0.0
        self.waiting: list[dict] = []
        self.arrived: list[tuple] = []
        self.observed = {"tool": [], "human": []}
        self.deleted_cost = 0.0
        self.first_deletion = None

    # -- node helpers --------------------------------------------------------------------
    def blocks(self):
        stack = list(self.root.children.values())
        while stack:
            block = stack.pop()
            yield block
            stack.extend(block.children.values())

    def node_of(self, last):
        """Blocks of the node whose last block is `last`, first to last."""
        out = [last]
        while not out[-1].starts_node:
            out.append(out[-1].parent)
        return out[::-1]

    def node_last(self, block):
        """Last block of the node that contains `block`."""
        while len(block.children) == 1 and not next(iter(block.children.values())).starts_node:
            block = next(iter(block.children.values()))
        return block

    def resident(self, blocks):
        return [b for b in blocks if b.state != MISSING]

    def set_node(self, last, **values):
        for block in self.node_of(last):
            for key, value in values.items():
                setattr(block, key, value)

    def node_lasts(self):
        return [b for b in self.blocks() if self.node_last(b) is b]

    # -- sizes ---------------------------------------------------------------------------
    def cached_tokens(self, locked: bool | None = None):
        return sum(self.bs for b in self.blocks()
                   if b.state == GPU and (locked is None or (b.lock > 0) == locked))

    def evictable(self):
        return self.cached_tokens(locked=False)

    def protected(self):
        return self.cached_tokens(locked=True)

    # -- walking -------------------------------------------------------------------------
    def _walk(self, tokens):
        chunks = [tuple(tokens[i:i + self.bs]) for i in range(0, len(tokens) // self.bs * self.bs, self.bs)]
        path, block = [], self.root
        for chunk in chunks:
            if chunk not in block.children:
                break
            block = block.children[chunk]
            path.append(block)
        if path and len(block.children) == 1:
            only = next(iter(block.children.values()))
            only.starts_node = True
        self.clock += 1
        for b in path:
            b.stamp = self.clock
        return chunks, path

    def match(self, tokens):
        _, path = self._walk(tokens)
        spans = []
        for b in path:
            start = b.index * self.bs
            if spans and spans[-1][2] == b.state:
                spans[-1][1] = start + self.bs
                spans[-1][3].extend(b.slots or ())
            else:
                spans.append([start, start + self.bs, b.state, list(b.slots or ())])
        resident = [s for s in spans if s[2] != MISSING]
        compute_from = resident[-1][1] if resident else 0
        holes = [(s[0], s[1]) for s in spans if s[2] == MISSING and s[1] <= compute_from]
        seen = len(path) * self.bs
        while seen + self.bs <= len(tokens) and tuple(tokens[:seen + self.bs]) in self.ever:
            seen += self.bs
        recomputed = holes + ([(compute_from, seen)] if seen > compute_from else [])
        spans = [(a, b, st, tuple(sl)) for a, b, st, sl in spans]
        return spans, holes, compute_from, recomputed, (path[-1] if path else None)

    def insert(self, tokens, slots):
        """Returns the slots handed back to the free list."""
        chunks, path = self._walk(tokens)
        self.ever.update(tuple(tokens[:end]) for end in range(self.bs, len(chunks) * self.bs + 1, self.bs))
        returned = []
        for b in path:
            mine = tuple(slots[b.index * self.bs:(b.index + 1) * self.bs])
            if b.state == MISSING:
                b.state, b.slots = GPU, mine
            else:
                returned.extend(x for x, y in zip(mine, b.slots, strict=True) if x != y)
        parent = path[-1] if path else self.root
        for i in range(len(path), len(chunks)):
            block = Block(chunks[i], parent, i)
            block.state, block.slots = GPU, tuple(slots[i * self.bs:(i + 1) * self.bs])
            block.starts_node, block.stamp = i == len(path), self.clock
            parent.children[chunks[i]] = block
            parent = block
        returned.extend(slots[len(chunks) * self.bs:])
        return returned

    def lock(self, last, delta):
        block = last
        while block is not None and block is not self.root:
            block.lock += delta
            block = block.parent

    def unlock(self, last):
        self.lock(last, -1)
        if last is not None:
            self.prune(self.node_last(last))

    # -- hints ---------------------------------------------------------------------------
    def block_cost(self, position):
        if self.cost is None:
            return float(self.bs)
        return float(self.cost.span_cost(position, position + self.bs))

    def span_cost(self, start, end):
        return float(end - start) if self.cost is None else float(self.cost.span_cost(start, end))

    def advance(self, now):
        self.now = max(self.now, float(now))

    def same_session(self, old, new):
        blocks = len(old) // self.bs
        need = (blocks - blocks // 256) * self.bs
        return need > 0 and len(new) >= need and old[:need] == new[:need]

    def hint(self, tokens, now, event, kind=None, foresight=None):
        self.advance(now)
        whole = tuple(tokens[:len(tokens) // self.bs * self.bs])
        if event == "arrived":
            self.arrived.append(whole)
            back = [w for w in self.waiting if self.same_session(w["tokens"], whole)]
            for w in back:
                if w["kind"] is not None:
                    bisect.insort(self.observed[w["kind"]], max(0.0, float(now) - w["since"]))
            self.waiting = [w for w in self.waiting if all(w is not b for b in back)]
            return
        # The request leaves the system: the longest arrival its sequence continues.
        continued = [a for a in self.arrived if whole[:len(a)] == a]
        if continued:
            self.arrived.remove(max(continued, key=len))
        record = dict(tokens=whole, kind=kind, since=float(now), foresight=foresight, pin_until=-math.inf)
        if whole:
            self.waiting = [w for w in self.waiting if not self.same_session(w["tokens"], whole)]
            self.waiting.append(record)
        end = self.end_block(whole)
        if self.policy == "ttl" and kind == "tool" and end is not None:
            record["pin_until"] = float(now) + self.ttl(end)

    def end_block(self, whole):
        """The last block of a node that ends exactly where `whole` ends, if there is one."""
        block = self.root
        for i in range(0, len(whole), self.bs):
            block = block.children.get(whole[i:i + self.bs])
            if block is None:
                return None
        return block if block is not self.root and self.node_last(block) is block else None

    def ttl(self, end):
        waits = self.observed["tool"]
        if not waits:
            return 0.0
        start = self.private_start(end)
        private = self.node_of(start)[0].index * self.bs
        stop = (end.index + 1) * self.bs
        benefit = self.span_cost(private, stop) * (1 + len(self.arrived))
        rate = 0.0
        if self.first_deletion is not None and self.now - self.first_deletion > 0:
            rate = self.deleted_cost / (self.now - self.first_deletion)
        hold = (stop - private) / max(self.capacity, 1) * rate
        best, best_wait = -math.inf, 0.0
        for i, wait in enumerate(waits):
            utility = (i + 1) / len(waits) * benefit - wait * hold
            if utility > best:
                best, best_wait = utility, wait
        return best_wait if best > 0 else 0.0

    def sequence(self, last):
        blocks = []
        while last is not self.root:
            blocks.append(last.tokens)
            last = last.parent
        return tuple(t for chunk in reversed(blocks) for t in chunk)

    def holders(self, last):
        seq = self.sequence(last)
        records = [w for w in self.waiting if w["tokens"][:len(seq)] == seq]
        in_use = any(a[:len(seq)] == seq for a in self.arrived)
        return records, in_use

    def private_start(self, leaf):
        start = leaf
        while True:
            parent = self.node_of(start)[0].parent
            if (parent is self.root or len(parent.children) > 1 or parent.lock > 0
                    or not self.resident(self.node_of(parent))):
                return start
            start = parent

    def front_cost(self, leaf):
        chain = [leaf]
        start = self.private_start(leaf)
        while chain[-1] is not start:
            chain.append(self.node_of(chain[-1])[0].parent)
        for last in reversed(chain):
            resident = self.resident(self.node_of(last))
            if resident:
                return self.block_cost(resident[0].index * self.bs)
        return 0.0

    def remaining(self, w):
        elapsed = max(0.0, self.now - w["since"])
        pooled = sorted(self.observed["tool"] + self.observed["human"])
        for waits in ([self.observed[w["kind"]]] if w["kind"] is not None else []) + [pooled]:
            if len(waits) >= 3:
                longer = [x for x in waits if x > elapsed]
                return longer[len(longer) // 2] - elapsed if longer else math.inf
        return elapsed

    def future(self, leaf):
        records, in_use = self.holders(leaf)
        if in_use:
            return self.now, (leaf.index + 1) * self.bs
        futures = [w["foresight"] for w in records
                   if w["foresight"] is not None and w["foresight"][0] >= self.now]
        return min(futures) if futures else (math.inf, 0)

    def dead(self, leaf):
        _, reuse = self.future(leaf)
        return [b for b in self.resident(self.node_of(leaf)) if b.index * self.bs + self.bs > reuse]

    def victim_key(self, leaf, leaves):
        if self.policy == "ttl":
            records, _ = self.holders(leaf)
            return (any(w["pin_until"] > self.now for w in records), leaf.stamp)
        if self.policy == "flop-recency":
            def efficiency(last):
                blocks = self.node_of(last)
                start, end = blocks[0].index * self.bs, (last.index + 1) * self.bs
                return self.span_cost(start, end) / (end - start)
            stamps = [x.stamp for x in leaves]
            effs = [efficiency(x) for x in leaves]
            recency = (leaf.stamp - min(stamps)) / (max(stamps) - min(stamps)) if max(stamps) > min(stamps) else 1.0
            low, high = min(effs), max(effs)
            eff = (efficiency(leaf) - low) / (high - low) if high > low else 1.0
            return (recency + eff, leaf.stamp)
        if self.policy == "penelope-agent":
            records, in_use = self.holders(leaf)
            if not records:
                return (math.inf if in_use else -1.0, leaf.stamp)
            remaining = min(self.remaining(w) for w in records)
            return (self.front_cost(leaf) / max(remaining, 1e-3), leaf.stamp)
        if self.policy == "oracle":
            next_use, _ = self.future(leaf)
            if self.dead(leaf):
                return (0, 0.0, leaf.stamp)
            return (1, -(next_use - self.now) / max(self.front_cost(leaf), 1e-30), leaf.stamp)
        return (leaf.stamp,)

    # -- eviction ------------------------------------------------------------------------
    def detach(self, block):
        del block.parent.children[block.tokens]

    def prune(self, last):
        while last is not self.root and not last.children:
            blocks = self.node_of(last)
            if blocks[0].lock > 0 or self.resident(blocks):
                return
            self.detach(blocks[0])
            last = blocks[0].parent

    def candidates(self):
        out = [last for last in self.node_lasts()
               if not last.children and last.lock == 0 and self.resident(self.node_of(last))]
        stamps = [last.stamp for last in out]
        assert len(set(stamps)) == len(stamps), "two candidate leaves share a recency stamp"
        return out

    def evict(self, need):
        """Free at least `need` resident blocks (or all evictable). Returns their slots."""
        freed = []
        freed_cost = 0.0
        while len(freed) < need * self.bs:
            leaves = self.candidates()
            if not leaves:
                break
            leaf = min(leaves, key=lambda b: self.victim_key(b, leaves))
            want = need - len(freed) // self.bs
            dead = self.dead(leaf) if self.policy == "oracle" else []
            if dead or self.where == "leaf-tail":
                # The oracle deletes the blocks no request will reuse from the leaf's tail; the
                # tail rules delete the leaf's last resident blocks (all of them, node-wise).
                blocks = self.node_of(leaf)
                resident = self.resident(blocks)
                if dead:
                    k = min(want, len(dead))
                else:
                    k = len(resident) if self.how == "node" else min(want, len(resident))
                cut = blocks.index(resident[-k])
                for b in resident[-k:]:
                    freed.extend(b.slots)
                    freed_cost += self.block_cost(b.index * self.bs)
                self.detach(blocks[cut])
                self.prune(blocks[cut - 1] if cut else self.node_last(blocks[0].parent))
                continue
            start = leaf
            while self.where == "private-head":
                parent = self.node_of(start)[0].parent
                if (parent is self.root or len(parent.children) > 1 or parent.lock > 0
                        or not self.resident(self.node_of(parent))):
                    break
                start = parent
            chain = [leaf]
            while chain[-1] is not start:
                chain.append(self.node_of(chain[-1])[0].parent)
            for last in reversed(chain):
                blocks = self.node_of(last)
                resident = self.resident(blocks)
                take = resident if self.how == "node" else resident[:want]
                for b in take:
                    freed.extend(b.slots)
                    freed_cost += self.block_cost(b.index * self.bs)
                    b.state, b.slots = MISSING, None
                want -= len(take)
                rest = self.resident(blocks)
                if self.how == "block" and take and rest and blocks.index(rest[0]) > 0:
                    rest[0].starts_node = True
                if want <= 0:
                    break
            self.prune(leaf)
        if freed:
            if self.first_deletion is None:
                self.first_deletion = self.now
            self.deleted_cost += freed_cost
        return freed

    # -- comparison ------------------------------------------------------------------------
    def dump(self):
        """Nodes as (start, tokens, states, slots, lock, stamp), sorted."""
        out = []
        for last in self.node_lasts():
            blocks = self.node_of(last)
            tokens = tuple(t for b in blocks for t in b.tokens)
            slots = tuple(s for b in blocks for s in (b.slots or (-1,) * self.bs))
            states = "".join("G" if b.state == GPU else "M" for b in blocks)
            out.append((blocks[0].index * self.bs, tokens, states, slots, blocks[0].lock, blocks[0].stamp))
        return sorted(out)


def dump_real(cache):
    """The same view of a penelope KVCache."""
    out = []
    for node in cache.tree.nodes():
        states = "".join("G" if s == 0 else "C" if s == 1 else "M" for s in node.state)
        out.append((node.start, tuple(node.tokens.tolist()), states, tuple(node.slots.tolist()),
                    node.lock_ref, node.last_access))
    return sorted(out)
