"""A slow, obvious model of the cache manager, for property tests.

One Python object per block, a trie keyed by the whole block's tokens, no numpy and no
counters: everything is recomputed by walking. Radix-tree nodes are modelled by a flag on the
block that starts each node, because the node policies (SGLang's) evict whole nodes, so node
boundaries are part of the behaviour. A node is named by its LAST block, which stays the same
when its front is split off.

Rules (DESIGN.md section 3, written out per block):
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
"""
from __future__ import annotations

GPU, MISSING = "GPU", "MISSING"


class Block:
    def __init__(self, tokens, parent, index):
        self.tokens, self.parent, self.index = tokens, parent, index
        self.children: dict[tuple, Block] = {}
        self.state, self.slots = MISSING, None
        self.starts_node, self.stamp, self.lock = True, 0, 0


class ReferenceCache:
    def __init__(self, capacity: int, block_size: int, policy: str):
        aliases = {"sglang": "leaf-tail-node", "penelope": "private-head-block"}
        policy = aliases.get(policy, policy)
        self.where, self.how = policy.rsplit("-", 1)
        self.capacity, self.bs = capacity, block_size
        self.root = Block((), None, -1)
        self.clock = 0
        # Every whole-block prefix ever inserted: what statistics call "cached before".
        self.ever: set[tuple] = set()

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
        while len(freed) < need * self.bs:
            leaves = self.candidates()
            if not leaves:
                break
            leaf = min(leaves, key=lambda b: b.stamp)
            want = need - len(freed) // self.bs
            if self.where == "leaf-tail":
                blocks = self.node_of(leaf)
                resident = self.resident(blocks)
                k = len(resident) if self.how == "node" else min(want, len(resident))
                cut = blocks.index(resident[-k])
                for b in resident[-k:]:
                    freed.extend(b.slots)
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
                    b.state, b.slots = MISSING, None
                want -= len(take)
                rest = self.resident(blocks)
                if self.how == "block" and take and rest and blocks.index(rest[0]) > 0:
                    rest[0].starts_node = True
                if want <= 0:
                    break
            self.prune(leaf)
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
