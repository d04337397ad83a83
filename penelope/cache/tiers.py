"""One logical KV cache over a GPU tier and a CPU tier, with a chunked swap buffer (docs/design.md section 3).

The model. The cache holds up to `gpu_capacity + cpu_capacity` tokens; every cached block is in
exactly one tier (a GPU slot or a host slot) or MISSING. Deleting the last copy is the only
eviction; demoting a block to the CPU tier or loading it back never deletes anything. There is one
order, the eviction policy's:
- deletion: when new KV needs room and both tiers are full, the policy deletes blocks exactly as
  it does in the GPU-only cache (its own loop over blocks of either tier);
- demotion: when the GPU needs room, GPU blocks move to the CPU tier in the policy's order on the
  GPU view of the tree. Victims are unlocked nodes holding GPU blocks with none below them, least
  recently used first; from a victim the policy's walk picks the blocks (from the tail for the
  leaf-tail policies, else forward from `policy.first_node`, so `private-head-block` demotes the front
  of the private history first) and only GPU blocks move. Demotions move the blocks needed, never more:
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
exchange, plain host->device copies); the caller protocol and the plans are the tiered cache's
(`penelope.cache.host_tier`).
"""
from __future__ import annotations

import heapq
from typing import ClassVar

import numpy as np

from penelope.cache.host_tier import LoadResult, TieredCache, TierPlan, loaded_spans
from penelope.cache.manager import LockHandle
from penelope.cache.policies import DEFAULT_POLICY
from penelope.cache.slots import EMPTY_SLOTS, concat_slots
from penelope.cache.tree import BlockState, Node, RadixTree, Released
from penelope.errors import CacheFullError, InvariantError

DEFAULT_SWAP_BUFFER = 1024
_GPU, _CPU = int(BlockState.GPU), int(BlockState.CPU)


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
        return (self.policy.priority(self.tree, node), node.id, node)

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


class TwoTierCache(TieredCache):
    """One logical cache of `gpu_capacity + cpu_capacity` tokens over a GPU slot pool and a host pool.

    `swap_buffer`: tokens of reserved host rows (default 1,024, at least one block). Other
    arguments and sizes as `TieredCache`; sizes in tokens.
    """

    needs_swap_buffer: ClassVar[bool] = True

    def __init__(self, gpu_capacity: int, cpu_capacity: int, block_size: int = 64, *, policy=DEFAULT_POLICY,
                 swap_buffer: int = DEFAULT_SWAP_BUFFER, cost_model=None, allocator=None,
                 track_recompute: bool = True, keep_plans: bool = True):
        super().__init__(gpu_capacity, cpu_capacity, block_size, policy=policy, cost_model=cost_model,
                         allocator=allocator, track_recompute=track_recompute, keep_plans=keep_plans,
                         swap_buffer=swap_buffer)
        self.swap_buffer = self.host.buffer

    def advance(self, now: float) -> None:
        """The caller's clock reads `now` seconds. A policy that prefetches (`penelope-agent`) then
        names histories whose CPU blocks should come back to the GPU before their request; each is
        loaded (through the swap buffer when both tiers are full) if it is worth at least
        `PREFETCH_MARGIN` times more to the policy than the GPU victims that make room. The plans
        queue as loads do."""
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
        in_host = concat_slots([node.slots.reshape(-1, bs)[blocks].ravel() for node, blocks in incoming])
        split_a, split_b = into_free * bs, (into_free + plain) * bs
        swap_in = in_host[split_b:]
        buffer_before = self.host.buffer_slots
        fifo = np.concatenate([buffer_before, swap_in])
        swap_dest, new_buffer = fifo[:len(swap_in)], fifo[len(swap_in):]

        plain_dest = self._host_alloc(plain * bs)
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
            exchange_buffer=buffer_before if swapped else EMPTY_SLOTS,
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

    def _make_room(self, n: int) -> Released:
        """Demote (after deleting where the host is full) until `n` GPU slots are free."""
        bs = self.block_size
        released = Released()
        short = self._shortfall(n)
        if short <= 0:
            return released
        blocks = -(-short // bs)
        excess = blocks - self.host.free_size() // bs
        if excess > 0:
            released = self.policy.evict(self.tree, excess)
            self._release(released)
            blocks = -(-(n - self.allocator.free_size()) // bs)
        if blocks > 0:
            dest = self._host_alloc(blocks * bs)
            out_gpu = self._demote(blocks, dest)
            self.allocator.release(out_gpu)
            self._queue(TierPlan(to_host_gpu=out_gpu, to_host_host=dest, buffer_after=self.host.buffer_slots.copy()))
        return released

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
            for node in policy.victim_nodes(tree, victim):
                blocks = np.flatnonzero(node.state == _GPU)
                if policy.from_tail:
                    blocks = blocks[::-1]
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
        return concat_slots(out)
