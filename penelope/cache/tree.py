"""Radix tree over whole KV blocks, with a state per block.

A node holds a run of blocks: their tokens (`key`, raw int64 bytes), one slot per token and, per
block, a `BlockState` and a prefix hash. Blocks of one node may be in different states, so a
history whose front was evicted keeps its tokens (MISSING) and its later blocks (GPU or CPU).
Per-block numpy arrays rather than per-token objects keep metadata small and let a second tier
(blocks on CPU) reuse the same arrays.

The tree keeps the accounting of both tiers up to date in every primitive: GPU tokens
(`evictable_tokens`, `protected_tokens`) and CPU tokens (`cpu_evictable_tokens`,
`cpu_protected_tokens`, always 0 in a GPU-only cache); a node counts as locked while
`lock_ref > 0` (locks are held on whole root paths).
Recency is a logical clock bumped once per access: all nodes stamped with one value lie on one
root path, so two leaves never share a stamp. Once a policy asks for it (`recency_heap`), the tree
keeps a heap of its leaves by stamp up to date, so least-recently-used eviction finds its victims
without scanning every leaf.
"""
from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass, field

import numpy as np

from penelope.cache import path_loops
from penelope.cache.path_loops import MASK64 as _MASK64
from penelope.errors import InvariantError

NO_SLOT = -1
# Slots are stored as int32 (4 bytes per cached token; pools stay below 2**31 rows) and handed
# out as int64.
SLOT_DTYPE = np.int32
# Runs of at most this many blocks are hashed on Python ints (`PrefixHasher.extend`).
_SHORT_RUN = 16
_ONE = np.uint64(1)


class BlockState(enum.IntEnum):
    """Where the KV of one block lives."""

    GPU = 0
    CPU = 1
    MISSING = 2


_GPU, _CPU, _MISSING = int(BlockState.GPU), int(BlockState.CPU), int(BlockState.MISSING)


class Node:
    """A run of blocks. `slots[i]` (int32) is the slot of token i, NO_SLOT when its block is
    MISSING."""

    __slots__ = ("id", "parent", "children", "key", "slots", "state", "hashes", "start",
                 "lock_ref", "last_access", "n_gpu", "n_resident", "alive", "n_blocks", "end")

    def __init__(self, node_id: int, parent: Node | None, key: bytes, slots: np.ndarray,
                 state: np.ndarray, hashes: np.ndarray, start: int, last_access: int, all_gpu: bool = False):
        self.id = node_id
        self.parent = parent
        self.children: dict[bytes, Node] = {}
        self.key = key
        self.slots = slots
        self.state = state
        self.hashes = hashes
        self.start = start
        self.lock_ref = 0
        self.last_access = last_access
        self.alive = True
        if all_gpu:
            # A new leaf: every block on the GPU, no need to count the states.
            self.n_blocks = self.n_gpu = self.n_resident = len(state)
            self.end = start + len(slots)
        else:
            self.recount()

    def recount(self) -> None:
        """Set the counts read on every walk from the arrays: `n_gpu`, `n_resident`, `n_blocks`
        and `end` (the absolute position just after the node's last token)."""
        self.n_blocks = len(self.state)
        self.end = self.start + len(self.slots)
        gpu, _, missing = np.bincount(self.state, minlength=3).tolist()
        self.n_gpu = gpu
        self.n_resident = self.n_blocks - missing

    @property
    def tokens(self) -> np.ndarray:
        """The node's tokens, a read-only int64 view of `key`."""
        return np.frombuffer(self.key, dtype=np.int64)

    def __repr__(self) -> str:
        states = "".join("GCM"[s] for s in self.state)
        return f"Node(id={self.id}, start={self.start}, [{states}], lock={self.lock_ref}, t={self.last_access})"


@dataclass
class Released:
    """What an eviction step freed: slot arrays per tier, position ranges, block count, and the
    prefix hashes of the blocks whose last copy was deleted (uint64 arrays)."""

    gpu_slots: list[np.ndarray] = field(default_factory=list)
    cpu_slots: list[np.ndarray] = field(default_factory=list)
    ranges: list[tuple[int, int]] = field(default_factory=list)
    blocks: int = 0
    hashes: list[np.ndarray] = field(default_factory=list)


class PrefixHasher:
    """Polynomial hash of every block-aligned token prefix, computed vectorized.

    Prefix hash after block i: H_i = H_{i-1} * R + d_i (mod 2**64) with d_i a digest of block i.
    Written as H_i = R**i * sum_j d_j R**-j, a run of blocks needs one cumulative sum. Used only
    for statistics (recognizing tokens that were cached before and deleted), never for matching.
    """

    _RADIX = 0x9E3779B97F4A7C15

    def __init__(self, block_size: int, compiled=None):
        # `compiled`: the compiled recurrence (`path_loops`' `prefix_hashes`), used for every run
        # where it was built.
        self._compiled = compiled
        rng = np.random.default_rng(20250101)
        self._mix = rng.integers(1, 1 << 63, size=block_size, dtype=np.uint64) | np.uint64(1)
        self._mix_first = int(self._mix[0])
        self._pow = np.ones(1, dtype=np.uint64)
        self._inv = np.ones(1, dtype=np.uint64)
        self.block_size = block_size

    def _grow(self, n: int) -> None:
        size = len(self._pow)
        if n < size:
            return
        size = max(2 * size, n + 1)
        inverse = pow(self._RADIX, -1, 1 << 64)
        self._pow = np.ones(size, dtype=np.uint64)
        self._pow[1:] = np.cumprod(np.full(size - 1, self._RADIX, dtype=np.uint64))
        self._inv = np.ones(size, dtype=np.uint64)
        self._inv[1:] = np.cumprod(np.full(size - 1, inverse, dtype=np.uint64))

    def extend(self, base_hash: int, base_block: int, tokens: np.ndarray) -> np.ndarray:
        """Prefix hashes of blocks base_block+1 .. base_block+k given H_{base_block}.

        `tokens`: int64, k * block_size tokens. Returns uint64 [k]."""
        k = len(tokens) // self.block_size
        if k == 0:
            return np.empty(0, dtype=np.uint64)
        if self._compiled is not None and tokens.flags.c_contiguous:
            out = np.empty(k, dtype=np.uint64)
            self._compiled(base_hash, tokens[:k * self.block_size], self._mix, self._RADIX, out)
            return out
        short = k <= _SHORT_RUN
        if short and self.block_size == 1:
            # The same digests, without an array operation.
            mix = self._mix_first
            digests = [(token & _MASK64) * mix & _MASK64 for token in tokens.tolist()]
        elif self.block_size == 1:
            # The same digests; a (k, 1) @ (1,) product costs numpy more than a multiply.
            g = tokens.view(np.uint64) * self._mix[0]
        else:
            g = tokens.view(np.uint64).reshape(k, self.block_size) @ self._mix
            digests = g.tolist() if short else None
        if short:
            # A few blocks (a turn's new tokens at small pages): the recurrence H_i = H_{i-1} * R
            # + d_i on Python ints costs less than the vectorized form's array operations, each
            # of which costs microseconds whatever its size.
            hashes, radix = [], self._RADIX
            for digest in digests:
                base_hash = (base_hash * radix + digest + 1) & _MASK64
                hashes.append(base_hash)
            return np.array(hashes, dtype=np.uint64)
        self._grow(base_block + k)
        # In place, on the one array: the digests, then their weighted prefix sums, then the hashes.
        g += _ONE
        span = slice(base_block + 1, base_block + k + 1)
        g *= self._inv[span]
        np.add.accumulate(g, out=g)
        g += np.uint64((base_hash * int(self._inv[base_block])) & _MASK64)
        g *= self._pow[span]
        return g


def _empty_state() -> np.ndarray:
    return np.empty(0, dtype=np.int8)


class RadixTree:
    """The block radix tree and its primitives. Policies decide; this class only executes."""

    def __init__(self, block_size: int, loops=None):
        self.block_size = block_size
        self._block_bytes = block_size * 8
        self.hasher = PrefixHasher(block_size)
        self.set_loops(loops if loops is not None else path_loops.best())
        self.root = Node(0, None, b"", np.empty(0, dtype=SLOT_DTYPE), _empty_state(),
                         np.empty(0, dtype=np.uint64), 0, 0)
        self.clock = 0
        self.epoch = 0
        self.evictable_tokens = 0
        self.protected_tokens = 0
        self.cpu_evictable_tokens = 0
        self.cpu_protected_tokens = 0
        self.n_nodes = 0
        # Blocks of every node in any state: `on_gpu` compares them with the GPU tokens.
        self.n_blocks = 0
        self.leaves: set[Node] = set()
        # (last_access, id, node) of every leaf with its current stamp, and stale entries (nodes
        # that died, gained a child or were stamped again since), which readers skip; None until
        # `recency_heap` is first asked for.
        self._recency: list | None = None
        self._next_id = 1

    def set_loops(self, loops) -> None:
        """Run the inner loops of `loops` (`path_loops.PYTHON` or `path_loops.compiled()`, told
        apart by their `name`); the prefix hashes use numpy's vectorized form with the Python
        loops. Set the loops only here."""
        self.loops = loops
        self._python_loops = loops.name == "python"
        self.hasher._compiled = None if self._python_loops else loops.prefix_hashes

    def on_gpu(self) -> bool:
        """Whether every block of the tree is on the GPU (no hole, nothing on the CPU tier): then
        every path is, and callers skip their per-node state checks."""
        return self.evictable_tokens + self.protected_tokens == self.n_blocks * self.block_size

    def path_on_gpu(self, path: list[Node]) -> bool:
        """Whether every block of `path` is on the GPU (checked node by node only when the tree
        holds a hole or a CPU block)."""
        return self.on_gpu() or all(node.n_gpu == node.n_blocks for node in path)

    def path_slots(self, path: list[Node]) -> np.ndarray:
        """The slots of `path`'s nodes one after the other (int64; NO_SLOT at MISSING blocks)."""
        if not path:
            return np.empty(0, dtype=np.int64)
        if self._python_loops:
            return np.concatenate([node.slots for node in path], dtype=np.int64)
        out = np.empty(path[-1].end - path[0].start, dtype=np.int64)
        self.loops.gather(path, out)
        return out

    def walk(self, tokens: np.ndarray, n_blocks: int) -> tuple[list[Node], int]:
        """Follow `tokens[: n_blocks * block_size]` down the tree through blocks of any state.

        Read-only. Returns the nodes of the path and the number of blocks matched in the last one
        (it may be less than that node's length; every earlier node matches fully)."""
        raw = tokens[:n_blocks * self.block_size]
        if self._python_loops:
            # One copy of the walked tokens as bytes, compared in place node by node (the compiled
            # walk reads the array's memory itself).
            return self.loops.walk(self.root, raw.tobytes(), self._block_bytes)
        try:
            return self.loops.walk(self.root, raw, self._block_bytes)
        except (BufferError, ValueError):
            # A strided array: the compiled walk reads contiguous memory only.
            return self.loops.walk(self.root, np.ascontiguousarray(raw), self._block_bytes)

    def commit(self, path: list[Node], last_blocks: int) -> list[Node]:
        """Split the path's last node where the walk stopped, so the path covers whole nodes."""
        if path and last_blocks < path[-1].n_blocks:
            path[-1] = self.split(path[-1], last_blocks)
        return path

    def touch(self, path: list[Node]) -> None:
        self.clock += 1
        self.loops.stamp(path, self.clock)
        # Only the path's last node can be a leaf: every other one has the next as a child.
        if self._recency is not None and path and not path[-1].children:
            self._note_leaf(path[-1], compact=True)

    def recency_heap(self) -> list:
        """A heap of (last_access, id, node) holding every leaf with its current stamp, kept up to
        date from now on; it also holds stale entries, which the caller must skip: an entry is
        current while its node is alive, childless and still carries that stamp. The caller may
        pop entries and must push back those of current leaves it did not evict."""
        if self._recency is None:
            self._recency = [(leaf.last_access, leaf.id, leaf) for leaf in self.leaves]
            heapq.heapify(self._recency)
        return self._recency

    def _note_leaf(self, node: Node, compact: bool = False) -> None:
        """`node` is a leaf with a new stamp, or became a leaf: it joins the recency heap. With
        `compact` (never during an eviction, which holds the heap), a heap grown to mostly stale
        entries is dropped, to be rebuilt from the leaves when next asked for."""
        heap = self._recency
        if compact and len(heap) > 2 * len(self.leaves) + 64:
            self._recency = None
            return
        heapq.heappush(heap, (node.last_access, node.id, node))

    def split(self, node: Node, k: int) -> Node:
        """Cut `node` after its first k blocks; the new upper node is returned, `node` keeps the
        rest (and its children), so handles that point at `node` stay valid."""
        assert 0 < k < node.n_blocks, (k, node)
        t = k * self.block_size
        upper = Node(self._take_id(), node.parent, node.key[:t * 8], node.slots[:t].copy(),
                     node.state[:k].copy(), node.hashes[:k].copy(), node.start, node.last_access)
        upper.lock_ref = node.lock_ref
        node.parent.children[upper.key[:self._block_bytes]] = upper
        node.key, node.slots = node.key[t * 8:], node.slots[t:].copy()
        node.state, node.hashes = node.state[k:].copy(), node.hashes[k:].copy()
        node.start += t
        node.recount()
        node.parent = upper
        upper.children[node.key[:self._block_bytes]] = node
        self.n_nodes += 1
        return upper

    def add_leaf(self, parent: Node, tokens: np.ndarray, slots: np.ndarray) -> Node:
        """New GPU-resident node under `parent` with whole blocks `tokens` and their `slots`."""
        k = len(tokens) // self.block_size
        base = parent.hashes[-1] if parent.n_blocks else np.uint64(0)
        hashes = self.hasher.extend(int(base), parent.end // self.block_size, tokens)
        node = Node(self._take_id(), parent, tokens.tobytes(), slots.astype(SLOT_DTYPE),
                    np.zeros(k, dtype=np.int8), hashes, parent.end, self.clock, all_gpu=True)  # GPU is 0
        self.leaves.discard(parent)
        parent.children[node.key[:self._block_bytes]] = node
        self.leaves.add(node)
        if self._recency is not None:
            self._note_leaf(node, compact=True)
        self.n_nodes += 1
        self.n_blocks += k
        self._count(node, node.n_gpu * self.block_size)
        return node

    def refill(self, node: Node, blocks: np.ndarray, slots: np.ndarray) -> None:
        """Make MISSING `blocks` of `node` GPU-resident with `slots` ([len(blocks) * block_size])."""
        bs = self.block_size
        node.slots.reshape(-1, bs)[blocks] = slots.reshape(-1, bs)
        node.state[blocks] = _GPU
        node.n_gpu += len(blocks)
        node.n_resident += len(blocks)
        self._count(node, len(blocks) * bs)

    def move(self, node: Node, blocks: np.ndarray, state: BlockState, slots: np.ndarray) -> np.ndarray:
        """Move resident `blocks` of `node` to tier `state` (GPU or CPU) with new token `slots`
        ([len(blocks) * block_size]); returns their old slots (int64). Nothing is deleted, but
        matches made before are stale: their slots moved."""
        if not len(blocks):
            return np.empty(0, dtype=np.int64)
        bs = self.block_size
        states = node.state[blocks]
        assert state in (BlockState.GPU, BlockState.CPU) and not (states == _MISSING).any(), (node, blocks)
        rows = node.slots.reshape(-1, bs)
        old = rows[blocks].ravel().astype(np.int64)
        rows[blocks] = slots.reshape(-1, bs)
        node.state[blocks] = int(state)
        gained = (len(blocks) if state == BlockState.GPU else 0) - int(np.count_nonzero(states == _GPU))
        node.n_gpu += gained
        self._count(node, gained * bs, -gained * bs)
        self.epoch += 1
        return old

    def free_front(self, node: Node, k: int, out: Released) -> None:
        """Mark the first k resident blocks of `node` MISSING and report their slots."""
        self._release(node, np.flatnonzero(node.state != _MISSING)[:k], out)

    def split_missing_front(self, node: Node) -> Node:
        """Give the MISSING blocks at the front of `node` a node of their own when resident
        blocks follow, so a hole is a node; returns the node that holds the resident rest."""
        first = int(np.argmax(node.state != _MISSING))
        if 0 < first and node.n_resident:
            self.split(node, first)
        return node

    def free_tail(self, node: Node, k: int, out: Released) -> None:
        """Delete blocks from the end of leaf `node` until k resident ones are gone (all when
        k >= its resident count); the node is removed when nothing is left."""
        assert not node.children, node
        if node.n_gpu == node.n_blocks:
            self._free_gpu_tail(node, max(node.n_blocks - k, 0), out)
            return
        resident = np.flatnonzero(node.state != _MISSING)
        cut = 0 if k >= len(resident) else int(resident[-k])
        self._release(node, resident[resident >= cut], out)
        if cut == 0:
            self.remove(node)
        else:
            self._truncate(node, cut)

    def _free_gpu_tail(self, node: Node, cut: int, out: Released) -> None:
        """`free_tail` of a leaf wholly on the GPU (the common case): its blocks from `cut` on
        are one run, released without per-block bookkeeping; the leaf keeps its first `cut`
        blocks, or is removed when `cut` is 0."""
        bs, t = self.block_size, cut * self.block_size
        freed = node.n_blocks - cut
        if freed == 0:
            return
        out.gpu_slots.append(node.slots[t:].copy())
        out.hashes.append(node.hashes[cut:])
        out.ranges.append((node.start + t, node.end))
        out.blocks += freed
        self._count(node, -freed * bs)
        self.epoch += 1
        node.n_gpu = node.n_resident = cut
        if cut == 0:
            # The whole leaf goes: its arrays go with it.
            node.state[:] = _MISSING
            node.slots[:] = NO_SLOT
            self.remove(node)
            return
        self._truncate(node, cut)

    def prune(self, node: Node) -> Node | None:
        """Remove an unlocked childless node that holds no resident block (nothing after its
        hole to reuse), then its parent on the same condition, and so on. Returns the node
        where pruning stopped (None at the root).

        Leaves never end in MISSING blocks otherwise: holes are made at the front of nodes and
        split off, and inserts refill whole nodes, so this is all the pruning needed
        (`check` verifies it)."""
        while (node is not self.root and not node.children and node.lock_ref == 0
               and node.n_resident == 0):
            parent = node.parent
            self.remove(node)
            node = parent
        return None if node is self.root else node

    def remove(self, node: Node) -> None:
        """Detach a childless node; its resident blocks must have been released already."""
        assert not node.children and node is not self.root and node.n_resident == 0, node
        parent = node.parent
        del parent.children[node.key[:self._block_bytes]]
        if not parent.children and parent is not self.root:
            self.leaves.add(parent)
            if self._recency is not None:
                self._note_leaf(parent)
        self.leaves.discard(node)
        node.alive = False
        node.parent = None
        self.n_nodes -= 1
        self.n_blocks -= node.n_blocks

    def lock(self, node: Node, delta: int) -> None:
        """Add `delta` (+1 or -1) to lock_ref on the root path of `node`."""
        # Only the nodes that changed between locked and unlocked move their tokens.
        gpu, resident = self.loops.lock_path(node, self.root, delta)
        if resident:
            moved = gpu * self.block_size * delta
            self.evictable_tokens -= moved
            self.protected_tokens += moved
            moved = (resident - gpu) * self.block_size * delta
            self.cpu_evictable_tokens -= moved
            self.cpu_protected_tokens += moved

    def nodes(self):
        """All nodes except the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def slots_in(self, state: BlockState) -> np.ndarray:
        """Token slots (int64) of every block in `state` (GPU or CPU), in tree order."""
        parts = [node.slots.reshape(-1, self.block_size)[node.state == int(state)].ravel()
                 for node in self.nodes()]
        return np.concatenate(parts, dtype=np.int64) if parts else np.empty(0, dtype=np.int64)

    def path_to_root(self, node: Node) -> list[Node]:
        path = []
        while node is not self.root:
            path.append(node)
            node = node.parent
        return path[::-1]

    def check(self, locks: dict[int, int]) -> np.ndarray:
        """Raise InvariantError on any inconsistency; `locks` maps node id to the number of
        live lock handles whose root path holds it. Returns the GPU slots the tree holds."""
        bs, bb = self.block_size, self._block_bytes
        evictable = protected = cpu_evictable = cpu_protected = count = blocks = 0
        gpu_slots = []
        leaf_stamps = []
        for node in self.nodes():
            count += 1
            parent, k = node.parent, len(node.state)
            blocks += k
            _require(node.alive and parent.children.get(node.key[:bb]) is node, "broken parent link", node)
            _require(k > 0 and len(node.key) == 8 * bs * k and len(node.slots) == bs * k
                     and len(node.hashes) == k, "array lengths disagree", node)
            _require(node.start == parent.end, "start is not the parent's end", node)
            _require(np.isin(node.state, (_GPU, _CPU, _MISSING)).all(), "bad block state", node)
            rows = node.slots.reshape(k, bs)
            _require((rows[node.state == _MISSING] == NO_SLOT).all(), "MISSING block with a slot", node)
            _require((rows[node.state != _MISSING] >= 0).all(), "resident block without a slot", node)
            counts = (node.n_gpu, node.n_resident, node.n_blocks, node.end)
            node.recount()
            _require(counts == (node.n_gpu, node.n_resident, node.n_blocks, node.end), "stale block counts", node)
            _require(node.lock_ref == locks.get(node.id, 0), f"lock_ref, expected {locks.get(node.id, 0)}",
                     node)
            _require(node.last_access <= parent.last_access or parent is self.root,
                     "more recent than its parent", node)
            _require((not node.children) == (node in self.leaves), "leaf set out of date", node)
            base = int(parent.hashes[-1]) if parent.n_blocks else 0
            _require(np.array_equal(self.hasher.extend(base, node.start // bs, node.tokens), node.hashes),
                     "stale prefix hashes", node)
            if not node.children:
                leaf_stamps.append(node.last_access)
                _require(node.lock_ref > 0 or node.state[-1] != _MISSING,
                         "unlocked leaf ends in MISSING blocks (should be pruned)", node)
            tokens, cpu_tokens = node.n_gpu * bs, (node.n_resident - node.n_gpu) * bs
            if node.lock_ref:
                protected += tokens
                cpu_protected += cpu_tokens
            else:
                evictable += tokens
                cpu_evictable += cpu_tokens
            gpu_slots.append(rows[node.state == _GPU].ravel())
        _require(count == self.n_nodes and all(leaf.alive for leaf in self.leaves), "node count", None)
        _require(blocks == self.n_blocks, f"block count: counted {blocks}, kept {self.n_blocks}", None)
        _require(len(set(leaf_stamps)) == len(leaf_stamps), "two leaves share a recency stamp", None)
        if self._recency is not None:
            entries = {(node.id, stamp) for stamp, _, node in self._recency}
            _require(all((leaf.id, leaf.last_access) in entries for leaf in self.leaves),
                     "a leaf is missing from the recency heap", None)
        _require((evictable, protected) == (self.evictable_tokens, self.protected_tokens),
                 f"accounting: counted evictable {evictable}, protected {protected}, "
                 f"kept {self.evictable_tokens}, {self.protected_tokens}", None)
        _require((cpu_evictable, cpu_protected) == (self.cpu_evictable_tokens, self.cpu_protected_tokens),
                 f"CPU accounting: counted evictable {cpu_evictable}, protected {cpu_protected}, "
                 f"kept {self.cpu_evictable_tokens}, {self.cpu_protected_tokens}", None)
        return np.concatenate(gpu_slots, dtype=np.int64) if gpu_slots else np.empty(0, dtype=np.int64)

    def _take_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _count(self, node: Node, gpu_tokens: int, cpu_tokens: int = 0) -> None:
        if node.lock_ref:
            self.protected_tokens += gpu_tokens
            self.cpu_protected_tokens += cpu_tokens
        else:
            self.evictable_tokens += gpu_tokens
            self.cpu_evictable_tokens += cpu_tokens

    def _release(self, node: Node, blocks: np.ndarray, out: Released) -> None:
        """Mark resident `blocks` of `node` MISSING and report their slots."""
        if not len(blocks):
            return
        bs = self.block_size
        states = node.state[blocks]
        rows = node.slots.reshape(-1, bs)
        gpu, cpu = blocks[states == _GPU], blocks[states == _CPU]
        if len(gpu):
            out.gpu_slots.append(rows[gpu].ravel())
            self._count(node, -len(gpu) * bs)
        if len(cpu):
            out.cpu_slots.append(rows[cpu].ravel())
            self._count(node, 0, -len(cpu) * bs)
        out.blocks += len(blocks)
        out.hashes.append(node.hashes[blocks])
        node.state[blocks] = _MISSING
        rows[blocks] = NO_SLOT
        node.recount()
        # One range per run of consecutive blocks, in absolute token positions.
        first, last = int(blocks[0]), int(blocks[-1])
        if last - first + 1 == len(blocks):
            # One run (blocks are ascending and distinct).
            out.ranges.append((node.start + first * bs, node.start + (last + 1) * bs))
        else:
            breaks = np.flatnonzero(np.diff(blocks) != 1) + 1
            for run in np.split(blocks, breaks):
                out.ranges.append((node.start + int(run[0]) * bs, node.start + (int(run[-1]) + 1) * bs))
        self.epoch += 1

    def _truncate(self, node: Node, k: int) -> None:
        """Keep the first k blocks of a leaf; the rest must have been released."""
        t = k * self.block_size
        self.n_blocks -= node.n_blocks - k
        node.key, node.slots = node.key[:t * 8], node.slots[:t].copy()
        node.state, node.hashes = node.state[:k].copy(), node.hashes[:k].copy()
        node.recount()


def _require(condition: bool, message: str, node: Node | None) -> None:
    if not condition:
        raise InvariantError(f"radix tree: {message}" + (f" at {node!r}" if node is not None else ""))
