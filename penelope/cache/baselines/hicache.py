"""HiCache-like two-tier baseline: SGLang 0.5.23's hierarchical cache, as it evicts.

What SGLang 0.5.23 does (`sglang/srt/mem_cache/unified_radix_cache.py` and
`unified_cache/unified_tree_core.py`, with the default `--hicache-write-policy write_through`):
- Write-through: when a request's KV is inserted, every node on its path without a host copy is
  backed up to host memory, parents first (hit-count threshold 1 under write_through). When the
  host pool is short, host eviction runs first; if it is still short, the backup stops there and
  the node stays device-only.
- Device eviction (an allocation short of device memory): the least recently used device leaf (a
  node with device KV, no child with device KV, unlocked), as a whole node. It is demoted when it
  has a host copy (device KV freed, the node stays in the tree, host-only) and deleted when it has
  none (`evict_device_leaf`).
- Host eviction: the least recently used host leaf (a host-only node without children, unlocked),
  as a whole node, deleted from the tree (`drive_host_eviction`, `_evict_host_leaf`).
- Matching returns the device prefix and the host prefix behind it; host nodes are loaded back to
  the device before the request runs (the host copy stays), and the longest-prefix-first
  scheduler sorts by device + host hits (`num_matched_prefix_tokens`).
So the two tiers evict independently, each by its own LRU: the device demotes the tail of a
history, the host then deletes that tail, and a history can end with its front on the GPU and
its back deleted. The tiers are not additive either: the host holds copies of device KV.

Simplifications: copies are planned synchronously (SGLang overlaps write-through and load-back
with compute; the simulator charges loads only), no storage tier, one block is always above
SGLang's 10-token load-back threshold. The block radix tree and caller protocol are `KVCache`'s
(`load` as in `penelope.cache.tiers.TwoTierCache`); the device order is SGLang's (`leaf-tail-node`).
"""
from __future__ import annotations

import heapq

import numpy as np

from penelope.cache.host_tier import LoadResult, TieredCache, TierPlan, loaded_spans
from penelope.cache.manager import LockHandle
from penelope.cache.slots import concat_slots
from penelope.cache.tree import BlockState, Node, RadixTree, Released
from penelope.errors import InvariantError

_CPU = int(BlockState.CPU)


class _BackupTree(RadixTree):
    """The radix tree plus a host copy per backed-up GPU node (`backup[node.id]`: int64 host slots,
    one per token), kept consistent when nodes split or leave the tree."""

    def __init__(self, block_size: int):
        super().__init__(block_size)
        self.backup: dict[int, np.ndarray] = {}

    def split(self, node: Node, k: int) -> Node:
        upper = super().split(node, k)
        copy = self.backup.pop(node.id, None)
        if copy is not None:
            t = k * self.block_size
            self.backup[upper.id], self.backup[node.id] = copy[:t], copy[t:]
        return upper

    def remove(self, node: Node) -> None:
        assert node.id not in self.backup, node
        super().remove(node)


class HiCacheLikeCache(TieredCache):
    """SGLang-style GPU + CPU cache of `gpu_capacity` device tokens and `cpu_capacity` host tokens.

    Same caller protocol and results as `TwoTierCache` (match, lock, load, alloc, insert, unlock,
    `take_plans`, `counters`); `capacity` is the GPU pool, `host_rows` the host pool's rows."""

    tree_class = _BackupTree

    def __init__(self, gpu_capacity: int, cpu_capacity: int, block_size: int = 64, *, cost_model=None,
                 allocator=None, track_recompute: bool = True, keep_plans: bool = True):
        super().__init__(gpu_capacity, cpu_capacity, block_size, policy="sglang", cost_model=cost_model,
                         allocator=allocator, track_recompute=track_recompute, keep_plans=keep_plans)

    def backup_size(self) -> int:
        """Host tokens holding copies of GPU-resident nodes."""
        return sum(len(copy) for copy in self.tree.backup.values())

    def load(self, handle: LockHandle) -> LoadResult:
        """Load the host-only nodes of the locked path back to the GPU; their host copies stay."""
        self._check_load_handle(handle)
        nodes = [node for node in self.tree.path_to_root(handle.node) if node.n_resident > node.n_gpu]
        total = sum(len(node.slots) for node in nodes)
        if not total:
            return LoadResult([], 0, 0)
        self._make_room(total)
        gpu = self.allocator.alloc(total)
        self.allocator.adopt(gpu)
        host, cursor = [], 0
        for node in nodes:
            blocks = np.flatnonzero(node.state == _CPU)
            assert len(blocks) == node.n_blocks, node
            old = self.tree.move(node, blocks, BlockState.GPU, gpu[cursor:cursor + len(node.slots)])
            self.tree.backup[node.id] = old
            host.append(old)
            cursor += len(node.slots)
        plan = TierPlan(to_gpu_host=concat_slots(host), to_gpu_gpu=gpu)
        self._queue(plan)
        self.counters.loads += 1
        self.counters.loaded_tokens += total
        bs = self.block_size
        starts = [node.start + i * bs for node in nodes for i in range(node.n_blocks)]
        return LoadResult(loaded_spans(starts, gpu, bs), total, 0, plan)

    def insert(self, tokens, slots, match=None, tree_prefix: int = 0, earlier: int = 0, keep_leading: bool = False):
        """`KVCache.insert`, then write-through: back up the path's GPU nodes, parents first."""
        result = super().insert(tokens, slots, match, tree_prefix, earlier, keep_leading)
        tokens = np.asarray(tokens, dtype=np.int64)
        path, _ = self.tree.walk(tokens, len(tokens) // self.block_size)
        gpu, host = [], []
        for node in path:
            if node.n_gpu == 0 or node.id in self.tree.backup:
                continue
            need = len(node.slots)
            if self.host.free_size() < need:
                self._host_room(need)
            if self.host.free_size() < need:
                break
            copy = self._host_alloc(need)
            self.tree.backup[node.id] = copy
            gpu.append(node.slots.astype(np.int64))
            host.append(copy)
        if gpu:
            self._queue(TierPlan(to_host_gpu=concat_slots(gpu), to_host_host=concat_slots(host)))
            self.counters.backed_up_tokens += sum(len(copy) for copy in host)
        return result

    def check_invariants(self) -> None:
        """KVCache's checks plus the host: backups only of whole GPU nodes, host rows against the
        tree, and free + host-only + backups == cpu_capacity."""
        super().check_invariants()
        backed = []
        for node in self.tree.nodes():
            copy = self.tree.backup.get(node.id)
            if node.n_gpu and node.n_gpu != node.n_blocks:
                raise InvariantError(f"hicache: node with device and host-only blocks {node!r}")
            if copy is not None:
                if node.n_gpu != node.n_blocks or len(copy) != len(node.slots):
                    raise InvariantError(f"hicache: host copy of a node that is not on the GPU {node!r}")
                backed.append(copy)
        if len(backed) != len(self.tree.backup):
            raise InvariantError("hicache: a host copy belongs to a node no longer in the tree")
        self.host.check(np.concatenate([self.tree.slots_in(BlockState.CPU), *backed]))
        total = self.cpu_free_size() + self.cpu_evictable_size() + self.cpu_protected_size() + self.backup_size()
        if total != self.cpu_capacity:
            raise InvariantError(f"hicache host: free + host-only + backups = {total} != {self.cpu_capacity}")

    def _make_room(self, n: int) -> Released:
        """Evict LRU device leaves, whole nodes, until `n` GPU slots are free."""
        released = Released()
        short = self._shortfall(n)
        if short <= 0:
            return released
        tree = self.tree
        heap = [(node.last_access, node.id, node) for node in tree.nodes() if self._device_leaf(node)]
        heapq.heapify(heap)
        while self.allocator.free_size() < n:
            node = heapq.heappop(heap)[2]
            if not self._device_leaf(node):
                continue
            parent = node.parent
            copy = tree.backup.pop(node.id, None)
            if copy is not None:
                freed = tree.move(node, np.arange(node.n_blocks), BlockState.CPU, copy)
                self.allocator.release(freed)
                self.counters.demotions += 1
                self.counters.demoted_tokens += len(freed)
            else:
                self._delete_subtree(node, released)
            if parent is not tree.root and self._device_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return released

    def _host_room(self, n: int) -> None:
        """Delete LRU host leaves, whole nodes, until `n` host slots are free or none is left."""
        tree = self.tree
        heap = [(node.last_access, node.id, node) for node in tree.leaves if self._host_leaf(node)]
        heapq.heapify(heap)
        released = Released()
        while self.host.free_size() < n and heap:
            node = heapq.heappop(heap)[2]
            if not self._host_leaf(node):
                continue
            parent = node.parent
            tree.free_tail(node, node.n_resident, released)
            self._release(released)
            released = Released()
            if parent is not tree.root and self._host_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))

    def _delete_subtree(self, node: Node, released: Released) -> None:
        """Delete an unbacked device leaf and the host-only nodes below it, leaves first."""
        order = [node]
        for below in order:
            order.extend(below.children.values())
        for victim in reversed(order):
            step = Released()
            copy = self.tree.backup.pop(victim.id, None)
            if copy is not None:
                step.cpu_slots.append(copy)
            self.tree.free_tail(victim, victim.n_resident, step)
            self._release(step)
            released.gpu_slots += step.gpu_slots
            released.ranges += step.ranges

    def _device_leaf(self, node: Node) -> bool:
        return (node.alive and node.n_gpu > 0 and node.lock_ref == 0
                and not any(child.n_gpu for child in node.children.values()))

    def _host_leaf(self, node: Node) -> bool:
        return (node.alive and not node.children and node.lock_ref == 0 and node.n_gpu == 0
                and node.n_resident > 0)
