"""One logical KV cache over a GPU tier and a CPU tier, with a chunked swap buffer (DESIGN.md section 3).

The model. The cache holds up to `gpu_capacity + cpu_capacity` tokens; every cached block is in
exactly one tier (a GPU slot or a host slot) or MISSING. Deleting the last copy is the only
eviction; demoting a block to the CPU tier or loading it back never deletes anything. There is one
order, the eviction policy's:
- deletion: when new KV needs room and both tiers are full, the policy deletes blocks exactly as
  it does in the GPU-only cache (its own loop over blocks of either tier);
- demotion: when the GPU needs room, GPU blocks move to the CPU tier in the policy's order on the
  GPU view of the tree. Victims are unlocked nodes holding GPU blocks with none below them, least
  recently used first; from a victim the policy's walk picks the blocks (from the tail for the
  leaf-tail policies, else forward from `policy.first_node`, so Penelope demotes the front of the
  private history first) and only GPU blocks move. Demotions move the blocks needed, never more:
  moving loses nothing, so "whole node" applies to deletion only.
So the CPU tier holds the blocks next in line for deletion, and deletions take them first.

Loads. A request's matched path may have CPU spans. After `lock`, `load` moves them to the GPU:
into free GPU slots first; otherwise GPU blocks are demoted (policy order) into free host slots,
and the loads land in the GPU slots they emptied; when both tiers are full, the rest is exchanged
through a reserved swap buffer of host slots (`swap_buffer` tokens, not counted in the capacity):
chunk i of the outgoing GPU blocks goes into the buffer, chunk i of the incoming blocks into the
GPU slots just emptied, and the host slots just read become the buffer of the next chunks. Host
slots are therefore indirected: the buffer moves, and a demoted block lands where an incoming
block or the buffer was. The rotation is `penelope.kernels.kv_swap.plan_exchange`'s (a FIFO of
host slots, so its result is known without running it: the outgoing rows take `buffer ++ incoming`
in order and the rest is the next buffer).

Plans. Every operation that moves data queues a `TierPlan` (plain device->host copies, the
exchange, plain host->device copies); `take_plans()` hands them over in order and
`penelope.swap_executor.SwapExecutor` runs them on real KV pools. Plans must run in order, each
before the KV it moves is used.

Caller protocol (as `KVCache`, plus `load`):

    m = cache.match(tokens); h = cache.lock(m)
    loaded = cache.load(h)            # when m.loads: the CPU spans get GPU slots
    new = cache.alloc(n)              # may delete, then demote
    for plan in cache.take_plans(): executor.run(plan)
    ...compute, insert, unlock as with KVCache...
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from penelope.cache import EvictResult, KVCache, LockHandle, Span, _count, check_alloc_memory
from penelope.errors import CacheFullError, InvariantError, UsageError
from penelope.memory import check_memory
from penelope.slots import LazyFreeList, LazyTags
from penelope.tree import BlockState, Node, RadixTree, Released

DEFAULT_SWAP_BUFFER = 1024
_EMPTY = np.empty(0, dtype=np.int64)
_GPU, _CPU = int(BlockState.GPU), int(BlockState.CPU)


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts, dtype=np.int64) if parts else _EMPTY


def _rows():
    return field(default_factory=lambda: _EMPTY)


@dataclass(frozen=True)
class TierPlan:
    """The copies of one cache operation, as token slots (int64 arrays of equal length per pair).

    - `to_host_gpu[i]` -> host `to_host_host[i]`: plain device->host copies into host slots that
      held no live data (demotions, and backups in `penelope.hicache`);
    - the exchange: rows `exchange_out_gpu` go to the host and rows `exchange_in_host` come in
      through the swap buffer `exchange_buffer`, `chunk` rows at a time; outgoing row i ends at
      host slot `exchange_out_host[i]`, incoming row i at GPU slot `exchange_out_gpu[i]`;
    - host `to_gpu_host[i]` -> `to_gpu_gpu[i]`: plain host->device copies (loads), which may land in
      GPU slots the plain device->host copies emptied, so they run after them.
    `buffer_after`: the swap buffer's host slots once the plan has run (no live data).
    """

    to_host_gpu: np.ndarray = _rows()
    to_host_host: np.ndarray = _rows()
    exchange_out_gpu: np.ndarray = _rows()
    exchange_in_host: np.ndarray = _rows()
    exchange_buffer: np.ndarray = _rows()
    exchange_out_host: np.ndarray = _rows()
    to_gpu_host: np.ndarray = _rows()
    to_gpu_gpu: np.ndarray = _rows()
    buffer_after: np.ndarray = _rows()
    chunk: int = 0

    @property
    def swapped_tokens(self) -> int:
        """Rows loaded through the swap buffer (as many go out through it)."""
        return len(self.exchange_in_host)

    @property
    def to_host_tokens(self) -> int:
        """Rows copied device -> host (plain and exchanged)."""
        return len(self.to_host_gpu) + len(self.exchange_out_gpu)

    @property
    def to_gpu_tokens(self) -> int:
        """Rows copied host -> device (plain and exchanged)."""
        return len(self.to_gpu_host) + len(self.exchange_in_host)

    def steps(self):
        """The plan as a list of `penelope.kernels.kv_swap.CopyStep`, valid in list order on one
        stream; `after` points at the earlier step of the other direction a step waits for.
        Raises InvariantError if the exchange planner disagrees with the slots the cache chose."""
        from penelope.kernels.kv_swap import CopyStep, plan_exchange

        steps: list[CopyStep] = []
        if len(self.to_host_gpu):
            steps.append(CopyStep("d2h", 0, self.to_host_gpu, self.to_host_host, -1))
        plain_d2h = len(steps) - 1
        if len(self.exchange_out_gpu):
            exchange = plan_exchange(self.exchange_out_gpu, self.exchange_in_host, self.exchange_buffer,
                                     self.chunk)
            if not (np.array_equal(exchange.out_host_slots, self.exchange_out_host)
                    and np.array_equal(exchange.buffer_slots, self.buffer_after)):
                raise InvariantError("the exchange planner moved rows elsewhere than the cache recorded")
            offset = len(steps)
            for step in exchange.steps:
                after = step.after + offset if step.after >= 0 else -1
                steps.append(CopyStep(step.kind, step.chunk, step.src_slots, step.dst_slots, after))
        if len(self.to_gpu_host):
            steps.append(CopyStep("h2d", 0, self.to_gpu_host, self.to_gpu_gpu, plain_d2h))
        return steps


@dataclass
class TierCounters:
    """What the tiers did, in operations and tokens. `loads`: load operations (requests with CPU
    spans), `swap_loads`: those that went through the swap buffer; `demoted_tokens`: GPU -> CPU
    (plain and exchanged); `deleted_gpu_tokens`, `deleted_cpu_tokens`: KV deleted from each tier;
    `backed_up_tokens`: host copies of GPU blocks (HiCache-like write-through only); `prefetches`,
    `prefetched_tokens`: loads a prefetching policy asked for before the request came (also
    counted in `loads`)."""

    loads: int = 0
    loaded_tokens: int = 0
    swap_loads: int = 0
    swapped_tokens: int = 0
    demotions: int = 0
    demoted_tokens: int = 0
    deleted_gpu_tokens: int = 0
    deleted_cpu_tokens: int = 0
    backed_up_tokens: int = 0
    plans: int = 0
    prefetches: int = 0
    prefetched_tokens: int = 0

    def as_dict(self) -> dict:
        return dict(vars(self))


@dataclass(frozen=True)
class LoadResult:
    """`spans`: the request's former CPU spans, now GPU spans with their new GPU slots (positions
    as in the match); `loaded_tokens` of which `swapped_tokens` went through the swap buffer."""

    spans: list[Span]
    loaded_tokens: int
    swapped_tokens: int
    plan: TierPlan | None = field(default=None, repr=False)


def loaded_spans(starts: list[int], gpu_slots: np.ndarray, block_size: int) -> list[Span]:
    """GPU spans of loaded blocks: block i starts at position `starts[i]` (ascending) and has GPU
    slots `gpu_slots[i * block_size:(i + 1) * block_size]`; adjacent blocks merge into one span."""
    bs = block_size
    runs: list[list] = []
    for i, start in enumerate(starts):
        if runs and runs[-1][1] == start:
            runs[-1][1] += bs
        else:
            runs.append([start, start + bs, i])
    return [Span(start, end, BlockState.GPU, gpu_slots[first * bs:first * bs + end - start].copy())
            for start, end, first in runs]


class HostSlots:
    """Rows of the host KV pool: `capacity` rows for cached blocks plus `buffer` rows of swap buffer.

    Every row is free, cached (it holds the KV of a block on the CPU tier, or a backup) or part of
    the swap buffer (no live data). The buffer is a FIFO of rows (`buffer_slots`) that moves with
    every exchange. Pool rows are `0 .. capacity + buffer - 1`; the buffer starts at the end. The
    bookkeeping of the `capacity` rows grows with the rows used (`penelope.slots.LazyFreeList`);
    the buffer's, 9 bytes a row, is checked against memory."""

    _FREE, _CACHED, _BUFFER = 0, 1, 2

    def __init__(self, capacity: int, buffer: int = 0):
        self.capacity, self.buffer = int(capacity), int(buffer)
        self.rows = self.capacity + self.buffer
        check_memory(9 * self.buffer, f"a swap buffer of {self.buffer} host rows")
        self._stack = LazyFreeList(self.capacity)
        # Tags of rows below `capacity` (lazy, free by default) and of the rows above (the
        # initial buffer's, dense).
        self._low = LazyTags(self.capacity, self._FREE)
        self._high = np.full(self.buffer, self._BUFFER, dtype=np.int8)
        self.buffer_slots = np.arange(self.capacity, self.rows, dtype=np.int64)

    def free_size(self) -> int:
        return len(self._stack)

    def alloc(self, n: int) -> np.ndarray:
        """`n` free rows, now cached (int64 [n]); the caller checked there are enough."""
        if n > len(self._stack):
            raise InvariantError(f"host pool: {n} rows asked, {len(self._stack)} free")
        rows = self._stack.pop(n)
        self._tag(rows, self._CACHED)
        return rows

    def release(self, rows: np.ndarray) -> None:
        """Cached rows whose KV is no longer needed go back to the free list."""
        self._stack.push(rows)
        self._tag(rows, self._FREE)

    def rotate(self, new_buffer: np.ndarray) -> None:
        """After an exchange: the old buffer rows now hold outgoing blocks, `new_buffer` (rows the
        incoming blocks were read from, and unused old buffer rows) is the buffer."""
        self._tag(self.buffer_slots, self._CACHED)
        self._tag(new_buffer, self._BUFFER)
        self.buffer_slots = new_buffer.copy()

    def _tag(self, rows: np.ndarray, tag: int) -> None:
        high = rows >= self.capacity
        self._low.set(rows[~high], tag)
        self._high[rows[high] - self.capacity] = tag

    def _tags(self, rows: np.ndarray) -> np.ndarray:
        high = rows >= self.capacity
        tags = np.empty(len(rows), dtype=np.int8)
        tags[~high] = self._low.get(rows[~high])
        tags[high] = self._high[rows[high] - self.capacity]
        return tags

    def _count(self, tag: int) -> int:
        return self._low.count(tag) + int(np.count_nonzero(self._high == tag))

    def check(self, cached: np.ndarray) -> None:
        """Verify the free list, the buffer and the owner tags against the rows the tree holds."""
        free = self._stack.returned()
        if len(np.unique(free)) != len(free) or np.any(self._tags(free) != self._FREE):
            raise InvariantError("host pool: free list holds a row twice or a row that is not free")
        # Rows above `capacity` were buffer rows before an exchange; they can be free like any other.
        never_used = (free >= self._stack.fresh) & (free < self.capacity)
        if np.any(never_used) or np.any(self._low.array[self._stack.fresh:] != self._FREE):
            raise InvariantError("host pool: a row never handed out is on the free list or tagged as used")
        if self._count(self._FREE) != len(self._stack):
            raise InvariantError("host pool: a row tagged free is missing from the free list")
        buf = self.buffer_slots
        if len(buf) != self.buffer or len(np.unique(buf)) != len(buf) or np.any(self._tags(buf) != self._BUFFER):
            raise InvariantError("host pool: the swap buffer lost rows or holds a row twice")
        if self._count(self._BUFFER) != self.buffer:
            raise InvariantError("host pool: a row tagged buffer is not in the swap buffer")
        if len(np.unique(cached)) != len(cached) or np.any(self._tags(cached) != self._CACHED):
            raise InvariantError("host pool: the tree holds a row twice, a free row or a buffer row")
        if self._count(self._CACHED) != len(cached):
            raise InvariantError("host pool: a row tagged cached is not in the tree")


class HostTier:
    """What both two-tier caches (`TwoTierCache`, `penelope.hicache.HiCacheLikeCache`) add to a
    `KVCache`: a host pool, the tier sizes, counters and the queue of plans for `take_plans`."""

    def _init_host_tier(self, cpu_capacity: int, swap_buffer: int, keep_plans: bool) -> None:
        if cpu_capacity < self.block_size:
            raise UsageError(f"a two-tier cache needs a CPU tier of at least one block ({self.block_size} tokens), "
                             f"got {cpu_capacity}; use KVCache for a GPU-only cache")
        if cpu_capacity + swap_buffer >= 2**31:
            raise UsageError(f"CPU tier {cpu_capacity} + swap buffer {swap_buffer} is beyond the 2**31 slots "
                             "the tree can address")
        self.gpu_capacity = self.capacity
        self.cpu_capacity = cpu_capacity
        self.total_capacity = self.capacity + cpu_capacity
        self.host = HostSlots(cpu_capacity, swap_buffer)
        self.host_rows = self.host.rows
        self.counters = TierCounters()
        self.keep_plans = keep_plans
        self._plans: list[TierPlan] = []

    def cpu_free_size(self) -> int:
        """Free host slots (the swap buffer excluded), in tokens."""
        return self.host.free_size()

    def cpu_evictable_size(self) -> int:
        """CPU-tier tokens that no running request locks."""
        return self.tree.cpu_evictable_tokens

    def cpu_protected_size(self) -> int:
        """CPU-tier tokens on locked paths (they are loaded before the request runs)."""
        return self.tree.cpu_protected_tokens

    def take_plans(self) -> list[TierPlan]:
        """The plans of the moves decided since the last call, in the order they must run."""
        plans, self._plans = self._plans, []
        return plans

    def alloc(self, n_tokens: int) -> np.ndarray:
        """`n_tokens` free GPU slots (int64 [n_tokens]), making room on the GPU first the way the
        cache does (`_make_gpu_room`). Raises CacheFullError, changing nothing, when not enough
        unlocked GPU KV exists."""
        n = _count(n_tokens, "n_tokens")
        if n > self.capacity:
            raise UsageError(f"cannot allocate {n} slots in a GPU tier of {self.capacity} tokens")
        check_alloc_memory(n)
        self._make_gpu_room(n)
        slots = self.allocator.alloc(n)
        if slots is None:
            raise InvariantError(f"making GPU room freed too little for {n} slots")
        return slots

    def evict(self, n_tokens: int) -> EvictResult:
        """Free at least `n_tokens` GPU slots (rounded up to blocks) or as many as unlocked GPU KV
        allows. `freed_tokens` counts GPU tokens freed; `slots` and `ranges` are the deleted ones
        (KV demoted to the CPU tier is still cached)."""
        n = _count(n_tokens, "n_tokens")
        n = min(-(-n // self.block_size) * self.block_size, self.tree.evictable_tokens)
        if n == 0:
            return EvictResult(0, _EMPTY, [])
        before = self.free_size()
        released = self._make_gpu_room(before + n)
        hashes = np.concatenate(released.hashes) if released.hashes else np.empty(0, dtype=np.uint64)
        return EvictResult(self.free_size() - before, _cat(released.gpu_slots), released.ranges, hashes)

    def _make_gpu_room(self, n: int) -> Released:
        """Demote or delete until at least `n` GPU slots are free; the cache's own order."""
        raise NotImplementedError

    def _gpu_shortfall(self, n: int) -> int:
        """GPU slots missing for `n` free ones; CacheFullError when unlocked KV cannot cover them."""
        short = n - self.allocator.free_size()
        if short > self.tree.evictable_tokens:
            raise CacheFullError(f"need {n} GPU slots: {self.allocator.free_size()} free, "
                                 f"{self.tree.evictable_tokens} evictable, "
                                 f"{self.tree.protected_tokens} locked by running requests")
        return short

    def _check_load_handle(self, handle: LockHandle) -> None:
        if not isinstance(handle, LockHandle) or handle.owner is not self:
            raise UsageError("load() takes a handle returned by this cache's lock()")
        if not handle.active:
            raise UsageError("load() needs a locked path; this handle is unlocked")


class _GpuView:
    """The GPU view of the tree for one demotion pass: GPU blocks in each node's subtree, and the
    victims (unlocked nodes holding GPU blocks with none below them) in the policy's order (least
    recently used first unless the policy orders victims otherwise)."""

    def __init__(self, tree: RadixTree, policy):
        self.tree = tree
        self.policy = policy
        self.below: dict[Node, int] = {}
        nodes = list(tree.nodes())
        # Parents come before children in `nodes`: reversed, every child is counted first.
        for node in reversed(nodes):
            self.below[node] = node.n_gpu + sum(self.below[child] for child in node.children.values())
        victims = [n for n in nodes if self.is_victim(n)]
        policy.prepare(tree, victims)
        self.heap = [self.entry(n) for n in victims]
        heapq.heapify(self.heap)

    def entry(self, node: Node) -> tuple:
        return (self.policy.victim_key(self.tree, node), node.id, node)

    def is_victim(self, node: Node) -> bool:
        return node.alive and node.n_gpu > 0 and self.below[node] == node.n_gpu and node.lock_ref == 0

    def moved(self, node: Node, blocks: int) -> None:
        """`blocks` GPU blocks of `node` left the GPU."""
        while node is not self.tree.root:
            self.below[node] -= blocks
            node = node.parent

    def after(self, victim: Node) -> None:
        """Queue the next victim on the victim's root path once it holds no GPU block."""
        node = victim
        while node is not self.tree.root and node.n_gpu == 0:
            node = node.parent
        if node is not self.tree.root and self.is_victim(node):
            heapq.heappush(self.heap, self.entry(node))


class TwoTierCache(HostTier, KVCache):
    """One logical cache of `gpu_capacity + cpu_capacity` tokens over a GPU slot pool and a host pool.

    `capacity` stays the GPU pool's size (a running request's KV must fit on the GPU, and callers
    of `KVCache` read it so); `total_capacity` is the logical capacity. The host pool has
    `host_rows = cpu_capacity + swap_buffer` rows. `swap_buffer`: tokens of reserved host rows
    (default 1,024, at least one block). `keep_plans`: queue the plans of moves for `take_plans`
    (a simulator that only counts can turn it off). Other arguments as `KVCache`; sizes in tokens.
    """

    def __init__(self, gpu_capacity: int, cpu_capacity: int, block_size: int = 64, policy="penelope",
                 swap_buffer: int = DEFAULT_SWAP_BUFFER, cost_model=None, allocator=None,
                 track_recompute: bool = True, keep_plans: bool = True):
        super().__init__(gpu_capacity, block_size, policy, cost_model, allocator, track_recompute)
        swap_buffer = _count(swap_buffer, "swap_buffer")
        if swap_buffer < block_size:
            raise UsageError(f"swap buffer of {swap_buffer} tokens is smaller than one block of {block_size} tokens")
        self._init_host_tier(_count(cpu_capacity, "cpu_capacity"), swap_buffer, keep_plans)
        self.swap_buffer = swap_buffer
        # One eviction order over both tiers: the policy sizes its rules by the logical capacity.
        self.policy.bind(self.total_capacity, block_size, cost_model)

    def advance(self, now: float) -> None:
        """The caller's clock reads `now` seconds. A policy that prefetches (`penelope-agent`) then
        names histories whose CPU blocks should come back to the GPU before their request; each is
        loaded (through the swap buffer when both tiers are full) if the GPU victims that make room
        are worth less than `PREFETCH_MARGIN` times less to the policy. The plans queue as loads do."""
        super().advance(now)
        if self.policy.prefetches:
            for value, node in self.policy.prefetch_candidates(self.tree):
                if not self._prefetch(node, value):
                    break

    def _prefetch(self, node: Node, value: float) -> bool:
        """Load the CPU blocks on `node`'s root path; False when the policy's margin or the GPU
        (too much KV locked) does not allow it now."""
        tree, bs = self.tree, self.block_size
        path = tree.path_to_root(node)
        incoming = sum(part.n_resident - part.n_gpu for part in path) * bs
        if not incoming or path[-1].end > self.capacity:
            return True
        if incoming > self.allocator.free_size():
            on_path = {part.id for part in path}
            keys = [key for key, _, victim in _GpuView(tree, self.policy).heap if victim.id not in on_path]
            if not keys or min(keys)[0] * self.policy.PREFETCH_MARGIN >= value:
                return False
        match = self.match(np.concatenate([part.tokens for part in path]))
        handle = self.lock(match)
        try:
            loaded = self.load(handle)
        except CacheFullError:
            return False
        finally:
            self.unlock(handle, admitted=False)
        self.counters.prefetches += 1
        self.counters.prefetched_tokens += loaded.loaded_tokens
        return True

    def buffer_slots(self) -> np.ndarray:
        """Host rows of the swap buffer now (int64 [swap_buffer]); they hold no live data."""
        return self.host.buffer_slots.copy()

    def load(self, handle: LockHandle) -> LoadResult:
        """Move the CPU blocks on `handle`'s locked path to the GPU (see the module docstring).
        Raises CacheFullError, changing nothing, when the GPU cannot take them now (too much KV
        is locked by running requests)."""
        self._check_load_handle(handle)
        bs = self.block_size
        incoming = [(node, np.flatnonzero(node.state == _CPU)) for node in self.tree.path_to_root(handle.node)
                    if node.n_resident > node.n_gpu]
        total = sum(len(blocks) for _, blocks in incoming)
        if not total:
            return LoadResult([], 0, 0)
        free_blocks = self.allocator.free_size() // bs
        into_free = min(total, free_blocks)
        to_demote = total - into_free
        if to_demote * bs > self.tree.evictable_tokens:
            raise CacheFullError(f"loading {total * bs} tokens needs {to_demote * bs} GPU tokens demoted; "
                                 f"{self.tree.evictable_tokens} are unlocked")
        plain = min(to_demote, self.host.free_size() // bs)
        swapped = to_demote - plain

        # Incoming blocks in path order: into free GPU slots, into slots plain demotions empty,
        # then through the swap buffer.
        in_host = _cat([node.slots.reshape(-1, bs)[blocks].ravel() for node, blocks in incoming])
        split_a, split_b = into_free * bs, (into_free + plain) * bs
        swap_in = in_host[split_b:]
        buffer_before = self.host.buffer_slots
        fifo = np.concatenate([buffer_before, swap_in])
        swap_dest, new_buffer = fifo[:len(swap_in)], fifo[len(swap_in):]

        plain_dest = self.host.alloc(plain * bs)
        out_gpu = self._demote(to_demote, np.concatenate([plain_dest, swap_dest]))
        free_gpu = self.allocator.alloc(split_a)
        self.allocator.adopt(free_gpu)
        gpu_dest = np.concatenate([free_gpu, out_gpu])
        cursor = 0
        for node, blocks in incoming:
            self.tree.move(node, blocks, BlockState.GPU, gpu_dest[cursor:cursor + len(blocks) * bs])
            cursor += len(blocks) * bs
        # Rows read by plain loads are free once the plan ran; later plans run after this one.
        self.host.release(in_host[:split_b])
        if swapped:
            self.host.rotate(new_buffer)

        plan = TierPlan(
            to_host_gpu=out_gpu[:plain * bs], to_host_host=plain_dest,
            exchange_out_gpu=out_gpu[plain * bs:], exchange_in_host=swap_in,
            exchange_buffer=buffer_before if swapped else _EMPTY,
            exchange_out_host=swap_dest, buffer_after=self.host.buffer_slots.copy(),
            to_gpu_host=in_host[:split_b], to_gpu_gpu=gpu_dest[:split_b], chunk=self.swap_buffer)
        self._queue(plan)
        counters = self.counters
        counters.loads += 1
        counters.loaded_tokens += total * bs
        counters.swap_loads += swapped > 0
        counters.swapped_tokens += swapped * bs
        starts = [node.start + int(block) * bs for node, blocks in incoming for block in blocks]
        return LoadResult(loaded_spans(starts, gpu_dest, bs), total * bs, swapped * bs, plan)

    def check_invariants(self) -> None:
        """KVCache's checks (GPU tier) plus the CPU tier: host rows against the tree's CPU blocks,
        the swap buffer, and free + evictable + protected == cpu_capacity."""
        super().check_invariants()
        self.host.check(self.tree.slots_in(BlockState.CPU))
        total = self.cpu_free_size() + self.cpu_evictable_size() + self.cpu_protected_size()
        if total != self.cpu_capacity:
            raise InvariantError(f"CPU tier: free {self.cpu_free_size()} + evictable {self.cpu_evictable_size()} "
                                 f"+ protected {self.cpu_protected_size()} != capacity {self.cpu_capacity}")

    def _make_gpu_room(self, n: int) -> Released:
        """Demote (after deleting where the host is full) until `n` GPU slots are free."""
        bs = self.block_size
        released = Released()
        short = self._gpu_shortfall(n)
        if short <= 0:
            return released
        blocks = -(-short // bs)
        excess = blocks - self.host.free_size() // bs
        if excess > 0:
            released = self.policy.evict(self.tree, excess)
            self._release(released)
            blocks = -(-(n - self.allocator.free_size()) // bs)
        if blocks > 0:
            dest = self.host.alloc(blocks * bs)
            out_gpu = self._demote(blocks, dest)
            self.allocator.release(out_gpu)
            self._queue(TierPlan(to_host_gpu=out_gpu, to_host_host=dest, buffer_after=self.host.buffer_slots.copy()))
        return released

    def _release(self, released: Released) -> None:
        """Return the slots of deleted blocks to their pools and count the deletion."""
        gpu, cpu = _cat(released.gpu_slots), _cat(released.cpu_slots)
        self.allocator.release(gpu)
        self.host.release(cpu)
        self.stats.evict_calls += 1
        self.stats.evicted_tokens += len(gpu) + len(cpu)
        self.counters.deleted_gpu_tokens += len(gpu)
        self.counters.deleted_cpu_tokens += len(cpu)

    def _demote(self, n_blocks: int, dest: np.ndarray) -> np.ndarray:
        """Move `n_blocks` unlocked GPU blocks to the host, in the policy's order on the GPU view;
        block i takes host slots `dest[i * bs:(i + 1) * bs]`. Returns the GPU slots they left
        (int64 [n_blocks * bs], in the same order). The caller checked there are enough."""
        bs, tree, policy = self.block_size, self.tree, self.policy
        out: list[np.ndarray] = []
        moved = 0
        view = _GpuView(tree, policy) if n_blocks else None
        while moved < n_blocks:
            if not view.heap:
                raise InvariantError(f"demotion found {moved} of {n_blocks} unlocked GPU blocks")
            victim = heapq.heappop(view.heap)[2]
            if not view.is_victim(victim):
                continue
            if policy.from_tail:
                chain = [(victim, np.flatnonzero(victim.state == _GPU)[::-1])]
            else:
                node = policy.first_node(tree, victim)
                chain = [(node, np.flatnonzero(node.state == _GPU))]
                while node is not victim:
                    # Between the walk's start and the victim every node has exactly one child.
                    node = next(iter(node.children.values()))
                    chain.append((node, np.flatnonzero(node.state == _GPU)))
            for node, blocks in chain:
                take = blocks[:n_blocks - moved]
                if not len(take):
                    continue
                take = np.sort(take)
                out.append(tree.move(node, take, BlockState.CPU, dest[moved * bs:(moved + len(take)) * bs]))
                view.moved(node, len(take))
                moved += len(take)
                if moved == n_blocks:
                    break
            if view.is_victim(victim):
                heapq.heappush(view.heap, view.entry(victim))
            else:
                view.after(victim)
        self.counters.demotions += n_blocks > 0
        self.counters.demoted_tokens += n_blocks * bs
        return _cat(out)

    def _queue(self, plan: TierPlan) -> None:
        self.counters.plans += 1
        if self.keep_plans:
            self._plans.append(plan)
