"""KVCache: the block radix-tree KV cache manager (docs/design.md section 3).

Caller protocol for one request, in this order:

    m = cache.match(tokens)              # spans (GPU/CPU/MISSING), holes, compute_from
    h = cache.lock(m)                    # protect the matched path while the request runs
    new = cache.alloc(n)                 # slots for holes + new tokens (may evict, never m's path)
    ...run the request, writing KV into the slots...
    cache.insert(tokens, slots)          # takes every slot passed; duplicates are freed
    cache.unlock(h)
    cache.hint(tokens, Hint(now, "finished", waits_for="tool"))   # optional, see penelope.cache.hints

A match is invalidated by any eviction: lock it right away, or match again. Every method
validates its input before changing anything, so bad input raises UsageError and leaves the
cache as it was.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from penelope.cache.arguments import check_alloc_memory, count, int_array
from penelope.cache.hints import Hint
from penelope.cache.policies import DEFAULT_POLICY, get_policy
from penelope.cache.policy import EvictionPolicy
from penelope.cache.slots import EMPTY_SLOTS, DeviceSlots, SlotAllocator
from penelope.cache.tree import BlockState, Node, RadixTree
from penelope.costmodel.recompute import RecomputeCost
from penelope.errors import CacheFullError, InvariantError, UsageError

NO_HASHES = np.empty(0, dtype=np.uint64)
_GPU, _CPU, _MISSING = int(BlockState.GPU), int(BlockState.CPU), int(BlockState.MISSING)


# The results below are read, never changed, by their callers; they are plain slotted classes
# rather than frozen dataclasses because they are made several times per request, and a frozen
# dataclass costs about four times as much to make.
@dataclass(slots=True)
class Span:
    """Positions [start, end) of the request in one state; `slots` ([end - start] int64) hold
    their KV for GPU/CPU spans and are empty for MISSING spans."""

    start: int
    end: int
    state: BlockState
    slots: np.ndarray

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(slots=True)
class MatchResult:
    """What the cache holds of a token sequence (positions in tokens).

    `spans` cover [0, matched) in order. `holes` are MISSING spans before the last resident span:
    a phantom prefill recomputes them. `loads` are CPU spans. The real request computes from
    `compute_from`. `recomputed` lists the spans the cache had held before and must compute
    again (holes, then evicted blocks from `compute_from` on). `handle` is opaque (for `lock`).
    """

    spans: list[Span]
    holes: list[tuple[int, int]]
    loads: list[Span]
    compute_from: int
    handle: Node
    n_tokens: int
    matched: int
    hit_tokens: int
    recomputed: list[tuple[int, int]]
    epoch: int = field(repr=False)
    owner: object = field(repr=False, compare=False)


class LockHandle:
    """A lock on one matched root path; `unlock` it exactly once."""

    __slots__ = ("node", "active", "owner", "match", "inserted")

    def __init__(self, node: Node, owner: KVCache, match: MatchResult, inserted: int = 0):
        self.node, self.active, self.owner, self.match = node, True, owner, match
        # Tokens the request inserted so far through `KVCache.checkpoint`.
        self.inserted = inserted


@dataclass(slots=True)
class InsertResult:
    """Token counts of one insert: `cached` whole-block tokens now on the path, of which
    `already_cached` were resident before, `refilled` were holes and `new` were added;
    `freed` slots went back to the free list (duplicates and the partial last block)."""

    cached: int
    already_cached: int
    refilled: int
    new: int
    freed: int
    # Tokens at the front of the path that were GPU-resident before the insert (its leading GPU
    # run); with `keep_leading`, the passed slots there were neither read nor freed.
    leading: int = 0


@dataclass(slots=True)
class EvictResult:
    """`freed_tokens` GPU tokens freed; their `slots`; `ranges` (start, end) of evicted
    positions, each within one history; `hashes` (uint64) the prefix hashes of the evicted
    blocks (`RadixTree` block identities, for KV events)."""

    freed_tokens: int
    slots: np.ndarray
    ranges: list[tuple[int, int]]
    hashes: np.ndarray = field(default_factory=lambda: NO_HASHES)


@dataclass
class CacheStats:
    """Counters over locked matches (admitted requests) and evictions, in tokens.

    `missed` = tokens a request had to compute; `recomputed` = the part of them the cache had
    held before (holes, evicted tails, deleted nodes); costs in the cost model's units (0 when
    the cache has no cost model)."""

    policy: str
    requests: int = 0
    hit_tokens: int = 0
    missed_tokens: int = 0
    hole_tokens: int = 0
    recomputed_tokens: int = 0
    missed_cost: float = 0.0
    recomputed_cost: float = 0.0
    evict_calls: int = 0
    evicted_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hit_tokens + self.missed_tokens
        return self.hit_tokens / total if total else 0.0


class KVCache:
    """Block-granular radix-tree KV cache over a pool of `capacity` token slots.

    `policy`: a registered name (see `penelope.cache.policies.policy_names`) or an EvictionPolicy (one
    object per cache: policies may keep state).
    `cost_model`: a `penelope.costmodel.recompute.RecomputeCost`, for statistics and the policies that
    weigh recompute cost (without one, every token costs the same to them).
    `allocator`: the slot pool, a `penelope.cache.slots.DeviceSlots` of the same capacity
    (default: a new `SlotAllocator`).
    `track_recompute`: remember a hash of every block ever inserted, so statistics can tell
    recomputed tokens from new ones even after a policy deleted them from the tree.
    """

    # The tree's class: a baseline that keeps more per node (host copies) subclasses RadixTree.
    tree_class: type[RadixTree] = RadixTree

    def __init__(self, capacity: int, block_size: int = 64, policy: str | EvictionPolicy = DEFAULT_POLICY,
                 cost_model: RecomputeCost | None = None, allocator: DeviceSlots | None = None,
                 track_recompute: bool = True):
        block_size = count(block_size, "block_size")
        what = self._capacity_name
        capacity = count(capacity, what)
        if block_size < 1:
            raise UsageError("block_size must be at least 1")
        if capacity < block_size:
            raise UsageError(f"{what} {capacity} is below one block of {block_size} tokens")
        if capacity >= 2**31:
            raise UsageError(f"{what} {capacity} is beyond the 2**31 slots the tree can address")
        self.policy = policy if isinstance(policy, EvictionPolicy) else get_policy(policy)
        if self.policy.owner is not None:
            raise UsageError(f"this {self.policy.name} policy object already serves another cache (policies keep "
                             "state per cache): pass its name or a new object")
        if cost_model is not None and not isinstance(cost_model, RecomputeCost):
            raise UsageError("cost_model must have a span_cost(start, end) method")
        if allocator is not None and not isinstance(allocator, DeviceSlots):
            raise UsageError(f"allocator {type(allocator).__name__} lacks the penelope.cache.slots.DeviceSlots "
                             "interface (capacity, free_size, alloc, release, check, outstanding_size, "
                             "check_outstanding, free, adopt)")
        if allocator is not None and allocator.capacity != capacity:
            raise UsageError(f"allocator capacity {allocator.capacity!r} differs from {what} {capacity}")
        self.capacity = capacity
        self.block_size = block_size
        self.cost_model = cost_model
        self.allocator = allocator if allocator is not None else SlotAllocator(capacity, block_size)
        self.tree = self.tree_class(block_size)
        self.stats = CacheStats(policy=self.policy.name)
        self.policy.owner = self
        self.policy.bind(capacity, block_size, cost_model)
        self._track = track_recompute
        self._seen: set[int] = set()
        self._locks: set[LockHandle] = set()

    def free_size(self) -> int:
        """Slots on the free list, in tokens."""
        return self.allocator.free_size()

    @property
    def total_capacity(self) -> int:
        """Tokens the cache can hold in all its tiers: `capacity` for a GPU-only cache."""
        return self.capacity

    def outstanding_size(self) -> int:
        """Slots handed out by `alloc` and not yet given back through `insert` or `free`."""
        return self.allocator.outstanding_size()

    def evictable_size(self) -> int:
        """GPU tokens in the tree that no running request locks."""
        return self.tree.evictable_tokens

    def protected_size(self) -> int:
        """GPU tokens in the tree on locked paths."""
        return self.tree.protected_tokens

    def match(self, tokens, slots: bool = True) -> MatchResult:
        """Walk the tree along `tokens` (list or int64 array [n]) through blocks of any state.
        Only whole blocks match. Bumps the recency of the matched path. `slots=False`: the spans
        carry no slot arrays (all empty), for a caller that needs only where the blocks are."""
        tokens = int_array(tokens, "tokens")
        tree, bs = self.tree, self.block_size
        n_blocks = len(tokens) // bs
        path = tree.commit(*tree.walk(tokens, n_blocks))
        tree.touch(path)
        self.policy.matched(tree, path)
        matched = path[-1].end if path else 0
        if path and tree.path_on_gpu(path):
            # The common case, one resident span: no holes, nothing on the CPU tier.
            spans = [Span(0, matched, BlockState.GPU, tree.path_slots(path) if slots else EMPTY_SLOTS)]
            compute_from, holes, loads, hit = matched, [], [], matched
        else:
            spans = self._spans(path, slots)
            resident = [s for s in spans if s.state != BlockState.MISSING]
            compute_from = resident[-1].end if resident else 0
            holes = [(s.start, s.end) for s in spans if s.state == BlockState.MISSING and s.end <= compute_from]
            loads = [s for s in spans if s.state == BlockState.CPU]
            hit = sum(len(s) for s in resident)
        seen = self._seen_until(tokens, path, matched, n_blocks) if self._track else matched
        recomputed = holes + [(compute_from, seen)] if seen > compute_from else list(holes)
        return MatchResult(spans, holes, loads, compute_from, path[-1] if path else tree.root, len(tokens), matched,
                           hit, recomputed, tree.epoch, self)

    def is_fresh(self, match: MatchResult) -> bool:
        """Whether `match` still describes the tree: nothing was evicted since it was made."""
        return match.owner is self and match.epoch == self.tree.epoch and match.handle.alive

    def lock(self, match: MatchResult) -> LockHandle:
        """Protect the matched root path from eviction until `unlock`; counts the request in
        `stats`. The match must be fresh (no eviction since it was made)."""
        if not isinstance(match, MatchResult) or match.owner is not self:
            raise UsageError("lock() takes a MatchResult returned by this cache's match()")
        if match.n_tokens > self.capacity:
            raise UsageError(f"a sequence of {match.n_tokens} tokens can never fit in a cache of "
                             f"{self.capacity} tokens")
        if not self.is_fresh(match):
            raise UsageError("stale match: the cache evicted since this match; match again, then lock")
        node = match.handle
        self.tree.lock(node, +1)
        handle = LockHandle(node, self, match)
        self._locks.add(handle)
        self._record(match)
        return handle

    def unlock(self, handle: LockHandle, admitted: bool = True) -> None:
        """Release a lock taken by `lock`; a second unlock of the same handle raises.

        `admitted=False`: the request was not served after all (its allocation failed); the
        statistics `lock` counted for it are taken back, so a request retried later is counted
        once."""
        if not isinstance(handle, LockHandle) or handle.owner is not self:
            raise UsageError("unlock() takes a handle returned by this cache's lock()")
        if not handle.active:
            raise UsageError("this handle is already unlocked")
        if not isinstance(admitted, (bool, np.bool_)):
            raise UsageError(f"admitted must be True or False, got {admitted!r}")
        handle.active = False
        if not admitted:
            self._record(handle.match, sign=-1)
        self._locks.discard(handle)
        self.tree.lock(handle.node, -1)
        if handle.node is not self.tree.root:
            self.tree.prune(handle.node)

    def alloc(self, n_tokens: int) -> np.ndarray:
        """`n_tokens` free slots (int64 [n_tokens]), evicting as needed. Raises CacheFullError,
        without evicting anything, when even evicting everything unlocked is not enough."""
        n = count(n_tokens, "n_tokens")
        if n > self.capacity:
            raise UsageError(f"cannot allocate {n} slots in {self._pool_name} of {self.capacity} tokens")
        check_alloc_memory(n)
        self._make_room(n)
        slots = self.allocator.alloc(n)
        if slots is None:
            raise InvariantError(f"making room freed too little for {n} slots")
        return slots

    def free(self, slots) -> None:
        """Return slots from `alloc` that will not be inserted."""
        self.allocator.free(int_array(slots, "slots"))

    def insert(self, tokens, slots, match: MatchResult | None = None, tree_prefix: int = 0,
               earlier: int = 0, keep_leading: bool = False) -> InsertResult:
        """Cache `tokens` whose KV is in `slots` (`slots[i]` holds tokens[i]); takes every slot.

        Blocks already on the GPU keep their slots (different slots passed for them are freed);
        holes on the path become resident with the passed slots, and so do blocks on the CPU
        tier (the caller computed them again: the GPU copy replaces the host copy, whose row is
        freed); new whole blocks are added; the partial last block's slots are freed.

        `match`: optionally, this cache's match of these same tokens (a caller that read what is
        cached before inserting); while it is fresh, its path saves walking the tree again.
        `tree_prefix`: the first `tree_prefix` tokens lie in the leading GPU span of `match`, which
        must be fresh: they keep the tree's slots, and `slots` there is neither read nor freed (a
        caller that would only copy the tree's slots in, to have them compared back).
        `earlier`: the first tokens of `tokens` the same request inserted before (its checkpoints,
        `LockHandle.inserted`), for a policy that counts inserts per node (SGLang's hit count).
        `keep_leading`: as `tree_prefix`, for the whole leading GPU run the walk finds, without a
        match (a caller that passes back what the tree holds, as SGLang's `insert` does); the
        run's length is the result's `leading`."""
        earlier = count(earlier, "earlier")
        tokens = int_array(tokens, "tokens")
        slots = int_array(slots, "slots")
        if len(slots) != len(tokens):
            raise UsageError(f"{len(tokens)} tokens but {len(slots)} slots")
        if len(tokens) > self.capacity:
            raise UsageError(f"a sequence of {len(tokens)} tokens can never fit in a cache of "
                             f"{self.capacity} tokens")
        if not isinstance(keep_leading, (bool, np.bool_)):
            raise UsageError(f"keep_leading must be True or False, got {keep_leading!r}")
        if keep_leading and tree_prefix:
            raise UsageError("insert takes tree_prefix or keep_leading, not both")
        lo = self._tree_prefix(match, tree_prefix)
        tree, bs = self.tree, self.block_size
        n_blocks = len(tokens) // bs
        full = n_blocks * bs
        path, last = self._walk_again(match, tokens, n_blocks) if match is not None else tree.walk(tokens, n_blocks)
        walked = path[-1].start + last * bs if path else 0
        on_gpu = tree.path_on_gpu(path)
        leading = walked if on_gpu else _leading_gpu(path, walked, bs)
        if keep_leading:
            lo = leading
        refill = duplicates = EMPTY_SLOTS
        if lo < walked:
            # The tree's slots of [lo, walked), against the passed ones.
            parts = [node.slots[max(lo - node.start, 0):] for node in path[:-1] if node.end > lo]
            if path[-1].start + last * bs > lo:
                parts.append(path[-1].slots[max(lo - path[-1].start, 0):last * bs])
            stored = np.concatenate(parts) if parts else EMPTY_SLOTS
            passed = slots[lo:walked]
            differs = stored != passed
            if not on_gpu:
                # Holes and CPU blocks take the passed slots (a GPU slot number may equal the host
                # slot number of a CPU block: still not a duplicate).
                state = np.concatenate([np.repeat(node.state, bs) for node in path])[lo:walked]
                taken = state != _GPU
                refill, differs = passed[taken], differs & ~taken
            # Usually the caller passes back the slots match() gave it: no duplicates to gather.
            if differs.any():
                duplicates = passed[differs]
        kept = np.concatenate([refill, slots[walked:full]]) if len(refill) else slots[walked:full]
        returned = np.concatenate([duplicates, slots[full:]]) if len(duplicates) or full < len(slots) else EMPTY_SLOTS
        self.allocator.check_outstanding(np.concatenate([kept, returned]) if len(returned) else kept)

        path = tree.commit(path, last)
        if not on_gpu:
            for node in path:
                if node.n_resident < node.n_blocks:
                    blocks = np.flatnonzero(node.state == BlockState.MISSING)
                    tree.refill(node, blocks, slots[_positions(node, blocks, bs)])
                if node.n_gpu < node.n_resident:
                    blocks = np.flatnonzero(node.state == _CPU)
                    self._replace_host_copy(node, blocks, slots[_positions(node, blocks, bs)])
        if walked < full:
            leaf = tree.add_leaf(path[-1] if path else tree.root, tokens[walked:full], slots[walked:full])
            path.append(leaf)
            if self._track:
                self._seen.update(leaf.hashes.tolist())
        tree.touch(path)
        self.policy.inserted(tree, path, earlier)
        self.allocator.adopt(kept)
        if len(returned):
            self.allocator.free(returned)
        return InsertResult(full, walked - len(refill), len(refill), full - walked, len(returned), leading)

    def checkpoint(self, handle: LockHandle, tokens, slots) -> tuple[LockHandle, np.ndarray]:
        """A running request caches the KV it computed so far and keeps it locked (SGLang's
        `checkpoint`, after every chunk of a chunked prompt): `tokens` (int64 [n]) are its first
        n positions, their KV in `slots` ([n]); `handle` locks its matched path, whose tokens
        agree with `tokens` as far as both go.

        The whole blocks of `tokens` are inserted as `insert` does (duplicates freed, holes
        refilled); the slots of a partial last block are not, and stay the caller's. The lock
        moves to the node where those blocks end when that lies beyond `handle`'s path (a new
        handle; `handle` is released, with no pruning: its node is on the new path), else
        `handle` keeps it. The request is not counted again in `stats`, and nothing is matched,
        so no policy sees a match; the handle's `inserted` grows to the whole blocks inserted (an
        insert counts what the request inserted before apart, `insert`'s `earlier`). Returns
        the handle that locks the request now and the tree's
        slots of the whole blocks (int64 [n // block_size * block_size]): where they differ from
        `slots`, the tree kept its own copy and the passed slot was freed."""
        if not isinstance(handle, LockHandle) or handle.owner is not self or not handle.active:
            raise UsageError("checkpoint() takes an active handle returned by this cache's lock()")
        tokens = int_array(tokens, "tokens")
        slots = int_array(slots, "slots")
        if len(slots) != len(tokens):
            raise UsageError(f"{len(tokens)} tokens but {len(slots)} slots")
        tree, bs = self.tree, self.block_size
        n_blocks = len(tokens) // bs
        full = n_blocks * bs
        path, last = tree.walk(tokens, n_blocks)
        walked = path[-1].start + last * bs if path else 0
        node = handle.node
        locked = node.end if node is not tree.root else 0
        if locked <= full:
            agrees = node is tree.root or (walked >= locked and any(step is node for step in path))
        else:
            agrees = walked == full and (not path or path[-1] in tree.path_to_root(node))
        if not agrees:
            raise UsageError(f"checkpoint(): the {len(tokens)} tokens differ from the locked path's "
                             f"{locked} tokens")
        if full == 0:
            return handle, EMPTY_SLOTS
        self.insert(tokens[:full], slots[:full], earlier=handle.inserted)
        path, _ = tree.walk(tokens, n_blocks)
        if path[-1].end != full:
            raise InvariantError(f"checkpoint(): the insert of {full} tokens left a path of {path[-1].end}")
        kept = tree.path_slots(path)
        if locked >= full:
            handle.inserted = max(handle.inserted, full)
            return handle, kept
        moved = LockHandle(path[-1], self, handle.match, max(handle.inserted, full))
        tree.lock(path[-1], +1)
        self._locks.add(moved)
        handle.active = False
        self._locks.discard(handle)
        tree.lock(node, -1)
        return moved, kept

    def release(self, handle: LockHandle, tokens, slots, prompt: int) -> None:
        """A request finished (SGLang's `release_kv_cache`): a last `checkpoint` of `tokens` (its
        prompt of `prompt` tokens, then the reply tokens whose KV it computed), with their KV in
        `slots[:len(tokens)]`; where the policy models SGLang's own cache
        (`EvictionPolicy.splits_reply_off`) the prompt's whole blocks are inserted once more, which
        splits the reply into a leaf of its own; the slots the tree did not take (the partial last
        block's and any beyond `tokens`) are freed and the lock released."""
        tokens = int_array(tokens, "tokens")
        slots = int_array(slots, "slots")
        prompt = count(prompt, "prompt")
        if len(slots) < len(tokens) or prompt > len(tokens):
            raise UsageError(f"release() takes a prompt of {prompt} within {len(tokens)} tokens and a slot for "
                             f"each, got {len(slots)}")
        handle, held = self.checkpoint(handle, tokens, slots[:len(tokens)])
        whole = prompt // self.block_size * self.block_size
        if self.policy.splits_reply_off and 0 < whole < len(held):
            self.insert(tokens[:whole], held[:whole], earlier=whole)
        if len(held) < len(slots):
            self.free(slots[len(held):])
        self.unlock(handle)

    def _tree_prefix(self, match: MatchResult | None, tree_prefix) -> int:
        """`tree_prefix` checked against `match` (see `insert`)."""
        n = count(tree_prefix, "tree_prefix")
        if n == 0:
            return 0
        if match is None or not isinstance(match, MatchResult) or not self.is_fresh(match):
            raise UsageError("tree_prefix needs a fresh match of this cache")
        first = match.spans[0] if match.spans else None
        if first is None or first.state != BlockState.GPU or n > first.end:
            raise UsageError(f"tree_prefix {n} is beyond the match's leading GPU span "
                             f"({first.end if first is not None and first.state == BlockState.GPU else 0} tokens)")
        return n

    def _walk_again(self, match: MatchResult, tokens: np.ndarray, n_blocks: int) -> tuple[list[Node], int]:
        """`tree.walk(tokens, n_blocks)`, read off `match` (made on the same tokens) when it is
        fresh. Its walk ended on the whole node `match.handle` (match commits its path), and
        nothing was evicted since; splits keep the path's nodes and ends, so the walk again ends
        there unless an insert since then added a child that continues the tokens."""
        tree = self.tree
        if not self.is_fresh(match) or match.n_tokens != len(tokens):
            return tree.walk(tokens, n_blocks)
        node = match.handle
        end = node.end if node is not tree.root else 0
        if end < n_blocks * self.block_size:
            block = tokens[end:end + self.block_size].tobytes()
            if block in node.children:
                return tree.walk(tokens, n_blocks)
        path = tree.path_to_root(node)
        return path, path[-1].n_blocks if path else 0

    def _replace_host_copy(self, node: Node, blocks: np.ndarray, slots: np.ndarray) -> None:
        """CPU `blocks` of `node` become GPU-resident with `slots` (freshly computed KV); a cache
        with a CPU tier frees their host rows. A GPU-only cache has no CPU blocks."""
        raise InvariantError(f"{type(self).__name__} holds CPU blocks but has no CPU tier: {node!r}")

    def refill(self, handle: LockHandle, start: int, slots) -> np.ndarray:
        """Make the MISSING blocks of positions [start, start + len(slots)) on `handle`'s locked
        path GPU-resident with `slots` (`slots[i]` holds position start + i; whole blocks).

        Blocks resident already keep their slots. Returns the path's slots for the range after
        the call (int64): where they differ from `slots`, the passed slot was not taken and
        stays the caller's to free."""
        if not isinstance(handle, LockHandle) or handle.owner is not self or not handle.active:
            raise UsageError("refill() takes an active handle returned by this cache's lock()")
        slots = int_array(slots, "slots")
        bs = self.block_size
        start = count(start, "start")
        end = start + len(slots)
        if start % bs or end % bs:
            raise UsageError(f"refill covers whole blocks of {bs} tokens, got [{start}, {end})")
        path = self.tree.path_to_root(handle.node)
        if end > (path[-1].end if path else 0):
            raise UsageError(f"refill [{start}, {end}) runs past the locked path's end")
        taken = []
        for node in path:
            lo, hi = max(start, node.start), min(end, node.end)
            if lo >= hi:
                continue
            blocks = np.arange((lo - node.start) // bs, (hi - node.start) // bs)
            if (node.state[blocks] == _CPU).any():
                raise UsageError(f"refill [{start}, {end}) covers blocks on the CPU tier: load them first")
            blocks = blocks[node.state[blocks] == _MISSING]
            if len(blocks):
                taken.append((node, blocks, slots[_positions(node, blocks, bs) - start]))
        new = np.concatenate([s for _, _, s in taken]) if taken else EMPTY_SLOTS
        self.allocator.check_outstanding(new)
        for node, blocks, block_slots in taken:
            self.tree.refill(node, blocks, block_slots)
        self.allocator.adopt(new)
        out = np.empty(len(slots), dtype=np.int64)
        for node in path:
            lo, hi = max(start, node.start), min(end, node.end)
            if lo < hi:
                out[lo - start:hi - start] = node.slots[lo - node.start:hi - node.start]
        return out

    def hint(self, tokens, hint: Hint) -> None:
        """Tell the policy about a request of `tokens` (list or int64 array): it `arrived`, or it
        `finished` and its session now waits for a tool or a person (`penelope.cache.hints.Hint`).
        Changes no block; policies that do not read hints ignore it. Foresight is refused unless
        the policy is an offline reference that asks for it (`uses_foresight`)."""
        if not isinstance(hint, Hint):
            raise UsageError(f"hint() takes a penelope.cache.hints.Hint, got {type(hint).__name__}")
        if hint.foresight is not None and not self.policy.uses_foresight:
            raise UsageError(f"policy {self.policy.name!r} decides without knowing the future: "
                             "a hint with foresight is for the offline oracle only")
        self.policy.observe(self.tree, int_array(tokens, "tokens"), hint)

    def advance(self, now: float) -> None:
        """The caller's clock reads `now` seconds (monotonic): time-based policy rules use it."""
        self.policy.advance(float(now))

    def evict(self, n_tokens: int) -> EvictResult:
        """Free at least `n_tokens` GPU tokens (rounded up to blocks), or all that are evictable.
        Evicting 0 is always safe."""
        n = count(n_tokens, "n_tokens")
        if n == 0:
            return EvictResult(0, EMPTY_SLOTS, [])
        return self._evict_blocks(-(-n // self.block_size))

    def check_invariants(self) -> None:
        """Raise InvariantError unless the tree, the locks, the allocator and the accounting
        (free + evictable + protected + held by callers == capacity) are consistent."""
        expected: dict[int, int] = {}
        for handle in self._locks:
            for node in self.tree.path_to_root(handle.node):
                expected[node.id] = expected.get(node.id, 0) + 1
        cached = self.tree.check(expected)
        self.allocator.check(cached)
        outstanding = self.outstanding_size()
        total = self.free_size() + self.evictable_size() + self.protected_size() + outstanding
        if total != self.capacity:
            raise InvariantError(f"free {self.free_size()} + evictable {self.evictable_size()} + protected "
                                 f"{self.protected_size()} + held {outstanding} != capacity {self.capacity}")

    # How errors name the capacity argument, the pool `alloc` allocates from, and its slots.
    _capacity_name, _pool_name, _slots_name = "capacity", "a cache", "slots"

    def _shortfall(self, n: int) -> int:
        """Slots missing for `n` free ones; CacheFullError when unlocked KV cannot cover them."""
        short = n - self.allocator.free_size()
        if short > self.tree.evictable_tokens:
            raise CacheFullError(f"need {n} {self._slots_name}: {self.allocator.free_size()} free, "
                                 f"{self.tree.evictable_tokens} evictable, "
                                 f"{self.tree.protected_tokens} locked by running requests")
        return short

    def _make_room(self, n: int):
        """Evict, in the policy's order, until at least `n` slots are free."""
        short = self._shortfall(n)
        if short > 0:
            self._evict_blocks(-(-short // self.block_size))

    def _evict_blocks(self, n_blocks: int) -> EvictResult:
        released = self.policy.evict(self.tree, n_blocks)
        slots = np.concatenate(released.gpu_slots, dtype=np.int64) if released.gpu_slots else EMPTY_SLOTS
        self.allocator.release(slots)
        self.stats.evict_calls += 1
        self.stats.evicted_tokens += len(slots)
        hashes = np.concatenate(released.hashes) if released.hashes else NO_HASHES
        return EvictResult(len(slots), slots, released.ranges, hashes)

    def _spans(self, path: list[Node], with_slots: bool = True) -> list[Span]:
        """Merge the per-block states of the path into maximal runs of one state (without their
        slots unless `with_slots`); `match` handles a path wholly on the GPU itself."""
        bs = self.block_size
        runs: list[list] = []  # [state, start, end, slot arrays]
        for node in path:
            k = len(node.state)
            if node.n_gpu == k or node.n_resident == 0:
                # The common case, a node in one state: no per-block work.
                pieces = ((_GPU if node.n_gpu else _MISSING, 0, k),)
            else:
                cuts = [0, *(np.flatnonzero(np.diff(node.state)) + 1).tolist(), k]
                pieces = [(int(node.state[a]), a, b) for a, b in zip(cuts, cuts[1:], strict=False)]
            for state, first, stop in pieces:
                if not runs or runs[-1][0] != state:
                    runs.append([state, node.start + first * bs, 0, []])
                run = runs[-1]
                run[2] = node.start + stop * bs
                if state != _MISSING:
                    run[3].append(node.slots if stop - first == k else node.slots[first * bs:stop * bs])
        return [Span(start, end, BlockState(state),
                     np.concatenate(parts, dtype=np.int64) if parts and with_slots else EMPTY_SLOTS)
                for state, start, end, parts in runs]

    def _seen_until(self, tokens: np.ndarray, path: list[Node], matched: int, n_blocks: int) -> int:
        """End of the prefix of `tokens` that was ever inserted (at least `matched`)."""
        bs = self.block_size
        if not self._track or matched >= n_blocks * bs:
            return matched
        base = int(path[-1].hashes[-1]) if path else 0
        hasher = self.tree.hasher
        # Check one block first: most requests' unmatched tokens are new.
        if int(hasher.extend(base, matched // bs, tokens[matched:matched + bs])[0]) not in self._seen:
            return matched
        known = 0
        for value in hasher.extend(base, matched // bs, tokens[matched:n_blocks * bs]).tolist():
            if value not in self._seen:
                break
            known += 1
        return matched + known * bs

    def _record(self, match: MatchResult, sign: int = 1) -> None:
        """Count an admitted request's tokens and costs in `stats` (`sign=-1` takes them back)."""
        stats = self.stats
        stats.requests += sign
        stats.hit_tokens += sign * match.hit_tokens
        stats.missed_tokens += sign * (match.n_tokens - match.hit_tokens)
        if match.holes:
            stats.hole_tokens += sign * sum(end - start for start, end in match.holes)
        if match.recomputed:
            stats.recomputed_tokens += sign * sum(end - start for start, end in match.recomputed)
        if self.cost_model is not None:
            computed = match.holes + [(match.compute_from, match.n_tokens)]
            stats.missed_cost += sign * sum(self.cost_model.span_cost(a, b) for a, b in computed if b > a)
            stats.recomputed_cost += sign * sum(self.cost_model.span_cost(a, b) for a, b in match.recomputed)


def _leading_gpu(path: list[Node], walked: int, block_size: int) -> int:
    """End of the leading run of GPU blocks on `path`, within the first `walked` tokens."""
    for node in path:
        if node.n_gpu < node.n_blocks:
            first = int(np.argmax(node.state != _GPU))
            return min(node.start + first * block_size, walked)
    return walked


def _positions(node: Node, blocks: np.ndarray, block_size: int) -> np.ndarray:
    """Token positions of `blocks` (block indices within `node`), in order."""
    return (node.start + blocks[:, None] * block_size + np.arange(block_size)).ravel()
