"""The host tier both two-tier caches share: a host pool, the plans of the copies between tiers,
their counters, and the interface of a tiered cache (`TieredCache`).

A tiered cache is a `KVCache` whose tree also holds blocks on the CPU tier (host rows). It only
decides; every move of data is queued as a `TierPlan` that `take_plans()` hands over in order and
`penelope.cache.swap_executor.SwapExecutor` runs on real KV pools. Plans must run in order, each
before the KV it moves is used. The caller protocol is `KVCache`'s plus `load`:

    m = cache.match(tokens); h = cache.lock(m)
    loaded = cache.load(h)            # when m.loads: the CPU spans get GPU slots
    new = cache.alloc(n)              # may delete, then demote
    for plan in cache.take_plans(): executor.run(plan)
    ...compute, insert, unlock as with KVCache...

Two caches implement it: `penelope.cache.tiers.TwoTierCache` (Penelope's one logical cache with a
swap buffer) and `penelope.cache.baselines.hicache.HiCacheLikeCache` (SGLang's HiCache, as it
evicts). They differ in `load` and in how they make room on the GPU (`_make_room`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from penelope.cache.arguments import count
from penelope.cache.manager import NO_HASHES, EvictResult, KVCache, LockHandle, Span
from penelope.cache.policies import DEFAULT_POLICY
from penelope.cache.slots import EMPTY_SLOTS, HostSlots, concat_slots
from penelope.cache.tree import BlockState, Node, Released
from penelope.errors import InvariantError, UsageError

# Host slots a CPU tier and its swap buffer can have: the tree stores slots as int32.
MAX_HOST_SLOTS = 2**31


def check_host_slots(cpu_capacity: int, swap_buffer: int, cpu: str = "CPU tier", swap: str = "swap buffer") -> None:
    """The host slots (the CPU tier and its swap buffer) must be addressable: fewer than 2**31.
    `cpu` and `swap` name the two sizes in the error."""
    if cpu_capacity + swap_buffer >= MAX_HOST_SLOTS:
        raise UsageError(f"{cpu} {cpu_capacity} + {swap} {swap_buffer} is beyond the 2**31 host slots the cache "
                         "can address")


def _rows():
    return field(default_factory=lambda: EMPTY_SLOTS)


@dataclass(frozen=True)
class TierPlan:
    """The copies of one cache operation, as token slots (int64 arrays of equal length per pair).

    - `to_host_gpu[i]` -> host `to_host_host[i]`: plain device->host copies into host slots that
      held no live data (demotions, and backups in `penelope.cache.baselines.hicache`);
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
    counted in `loads`); `replaced_host_tokens`: CPU blocks a request computed again, whose GPU
    copy replaced the host copy at insert."""

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
    replaced_host_tokens: int = 0

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


class TieredCache(KVCache, ABC):
    """A `KVCache` of `gpu_capacity` device tokens with a CPU tier of `cpu_capacity` host tokens.

    `capacity` stays the GPU pool's size (a running request's KV must fit on the GPU, and callers
    of `KVCache` read it so); `total_capacity` is what both tiers hold. The host pool has
    `host_rows = cpu_capacity + swap_buffer` rows. `keep_plans`: queue the plans of moves for
    `take_plans` (a simulator that only counts can turn it off). Other arguments as `KVCache`."""

    _capacity_name, _pool_name, _slots_name = "gpu_capacity", "a GPU tier", "GPU slots"
    # Whether the cache exchanges blocks through a swap buffer (then at least one block of it).
    needs_swap_buffer: ClassVar[bool] = False

    def __init__(self, gpu_capacity: int, cpu_capacity: int, block_size: int = 64, *, policy=DEFAULT_POLICY,
                 cost_model=None, allocator=None, track_recompute: bool = True, keep_plans: bool = True,
                 swap_buffer: int = 0):
        super().__init__(gpu_capacity, block_size, policy, cost_model, allocator, track_recompute)
        swap_buffer = count(swap_buffer, "swap_buffer")
        if self.needs_swap_buffer and swap_buffer < self.block_size:
            raise UsageError(f"swap buffer of {swap_buffer} tokens is smaller than one block of "
                             f"{self.block_size} tokens")
        cpu_capacity = count(cpu_capacity, "cpu_capacity")
        if cpu_capacity < self.block_size:
            raise UsageError(f"a two-tier cache needs a CPU tier of at least one block ({self.block_size} tokens), "
                             f"got {cpu_capacity}; use KVCache for a GPU-only cache")
        check_host_slots(cpu_capacity, swap_buffer)
        self.gpu_capacity = self.capacity
        self.cpu_capacity = cpu_capacity
        self.host = HostSlots(cpu_capacity, swap_buffer)
        self.host_rows = self.host.rows
        self.counters = TierCounters()
        self.keep_plans = keep_plans
        self._plans: list[TierPlan] = []
        # One eviction order over both tiers: the policy sizes its rules by the logical capacity.
        self.policy.bind(self.total_capacity, self.block_size, cost_model)

    @abstractmethod
    def load(self, handle: LockHandle) -> LoadResult:
        """Move the CPU blocks on `handle`'s locked path to the GPU; CacheFullError, changing
        nothing, when the GPU cannot take them now."""

    @abstractmethod
    def _make_room(self, n: int) -> Released:
        """Demote or delete until at least `n` GPU slots are free, in the cache's own order; what
        was deleted."""

    @property
    def total_capacity(self) -> int:
        """Tokens both tiers hold: `gpu_capacity + cpu_capacity`."""
        return self.capacity + self.cpu_capacity

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

    def evict(self, n_tokens: int) -> EvictResult:
        """Free at least `n_tokens` GPU slots (rounded up to blocks) or as many as unlocked GPU KV
        allows. `freed_tokens` counts GPU tokens freed; `slots` and `ranges` are the deleted ones
        (KV demoted to the CPU tier is still cached)."""
        n = count(n_tokens, "n_tokens")
        n = min(-(-n // self.block_size) * self.block_size, self.tree.evictable_tokens)
        if n == 0:
            return EvictResult(0, EMPTY_SLOTS, [])
        before = self.free_size()
        released = self._make_room(before + n)
        hashes = np.concatenate(released.hashes) if released.hashes else NO_HASHES
        return EvictResult(self.free_size() - before, concat_slots(released.gpu_slots), released.ranges, hashes)

    def _host_alloc(self, n: int) -> np.ndarray:
        """`n` host rows the caller checked are free."""
        rows = self.host.alloc(n)
        if rows is None:
            raise InvariantError(f"host pool: {n} rows asked, {self.host.free_size()} free")
        return rows

    def _release(self, released: Released) -> None:
        """Return the slots of deleted blocks to their pools and count the deletion."""
        gpu, cpu = concat_slots(released.gpu_slots), concat_slots(released.cpu_slots)
        self.allocator.release(gpu)
        self.host.release(cpu)
        self.stats.evict_calls += 1
        self.stats.evicted_tokens += len(gpu) + len(cpu)
        self.counters.deleted_gpu_tokens += len(gpu)
        self.counters.deleted_cpu_tokens += len(cpu)

    def _replace_host_copy(self, node: Node, blocks: np.ndarray, slots: np.ndarray) -> None:
        """A caller computed CPU `blocks` of `node` again (a request that did not match them, e.g.
        one that asked for log-probabilities from its first token): the GPU copy in `slots`
        replaces the host copy, whose rows go back to the host pool."""
        self.host.release(self.tree.move(node, blocks, BlockState.GPU, slots))
        self.counters.replaced_host_tokens += len(slots)

    def _queue(self, plan: TierPlan) -> None:
        self.counters.plans += 1
        if self.keep_plans:
            self._plans.append(plan)

    def _check_load_handle(self, handle: LockHandle) -> None:
        if not isinstance(handle, LockHandle) or handle.owner is not self:
            raise UsageError("load() takes a handle returned by this cache's lock()")
        if not handle.active:
            raise UsageError("load() needs a locked path; this handle is unlocked")
