"""Helpers of the two-tier tests: real KV pools whose rows carry a per-token fingerprint.

The KV of a token depends on every token before it, so its fingerprint is a rolling hash of the
prefix up to and including it (`fingerprints`). A row holds `[fingerprint + layer, position]`
(int32) in every layer buffer, so a row copied to the wrong slot, the wrong layer or not at all is
caught. `FingerprintRig` serves requests through a cache and a `SwapExecutor` and checks, after
every step, that every resident block's rows (GPU pool for GPU blocks, host pool for CPU blocks)
equal its fingerprint. The "GPU" pool is on CUDA (host pool pinned) when a GPU is present, so the
same tests run the copy kernel on real device and pinned memory there.
"""
from __future__ import annotations

import random

import numpy as np
import torch
from hypothesis import strategies as st

from penelope.cache.manager import KVCache
from penelope.cache.policies import policy_names
from penelope.cache.swap_executor import SwapExecutor
from penelope.cache.tiers import TwoTierCache
from penelope.cache.tree import BlockState
from penelope.errors import CacheFullError

_MOD, _RADIX = 2**31 - 1, 1_000_003
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LAYERS = 2
POISON = -7


def fingerprints(tokens, base: int = 0) -> np.ndarray:
    """int64 [n]: the rolling hash of tokens[:i + 1] for every i, continuing from `base`."""
    out = np.empty(len(tokens), dtype=np.int64)
    h = base
    for i, t in enumerate(np.asarray(tokens, dtype=np.int64).tolist()):
        h = (h * _RADIX + t + 1) % _MOD
        out[i] = h
    return out


def rows_of(fp: np.ndarray, positions: np.ndarray) -> list[torch.Tensor]:
    """The rows every layer buffer must hold: [n, 1, 2] int32 per buffer."""
    rows = []
    for layer in range(2 * LAYERS):
        row = np.stack([(fp + layer) % _MOD, positions], axis=1).astype(np.int32)
        rows.append(torch.from_numpy(row).reshape(-1, 1, 2))
    return rows


class FingerprintRig:
    """A cache, pools of `cache.capacity` GPU rows and `host_rows` host rows, and an executor."""

    def __init__(self, cache: KVCache, host_rows: int, copy: str = "naive"):
        self.cache = cache
        self.executor = SwapExecutor.allocate(LAYERS, cache.capacity, host_rows, (1, 2), torch.int32,
                                              device=DEVICE, copy=copy)
        self.plans_run = 0
        self.ran: list = []

    def run_plans(self) -> None:
        """Run the queued plans; after each, poison the swap buffer's rows (no live data there)."""
        for plan in self.cache.take_plans():
            self.executor.run(plan)
            if DEVICE == "cuda":
                # Plans run asynchronously; the host rows are read and poisoned from the CPU.
                torch.cuda.synchronize()
            self.plans_run += 1
            self.ran.append(plan)
            buffer = torch.from_numpy(np.asarray(plan.buffer_after, dtype=np.int64))
            for buf in self.executor.host_pool:
                buf[buffer] = POISON

    def write(self, slots: np.ndarray, fp: np.ndarray, positions: np.ndarray) -> None:
        """The "compute": write the KV of `positions` into GPU `slots`."""
        index = torch.from_numpy(slots).to(DEVICE)
        for buf, rows in zip(self.executor.gpu_pool, rows_of(fp, positions), strict=True):
            buf[index] = rows.to(DEVICE)

    def read(self, state: BlockState, slots: np.ndarray) -> list[torch.Tensor]:
        pool = self.executor.gpu_pool if state == BlockState.GPU else self.executor.host_pool
        index = torch.from_numpy(np.asarray(slots, dtype=np.int64))
        return [buf[index.to(buf.device)].cpu() for buf in pool]

    def expect(self, state: BlockState, slots: np.ndarray, fp: np.ndarray, positions: np.ndarray, what: str):
        for layer, (got, want) in enumerate(zip(self.read(state, slots), rows_of(fp, positions), strict=True)):
            if not torch.equal(got, want):
                bad = int(torch.nonzero((got != want).any(dim=2).any(dim=1))[0, 0])
                raise AssertionError(f"{what}: layer buffer {layer}, position {int(positions[bad])} in "
                                     f"{state.name} slot {int(slots[bad])} holds {got[bad].tolist()}, "
                                     f"expected {want[bad].tolist()}")

    def verify_all(self) -> int:
        """Every resident block of the tree holds its fingerprint; returns the tokens checked."""
        tree, bs = self.cache.tree, self.cache.block_size
        checked = 0
        stack = [(child, 0) for child in tree.root.children.values()]
        while stack:
            node, base = stack.pop()
            fp = fingerprints(node.tokens, base)
            positions = np.arange(node.start, node.end, dtype=np.int64)
            for state in (BlockState.GPU, BlockState.CPU):
                mask = np.repeat(node.state == int(state), bs)
                if mask.any():
                    self.expect(state, node.slots[mask].astype(np.int64), fp[mask], positions[mask],
                                f"cached node {node!r}")
                    checked += int(mask.sum())
            copy = getattr(tree, "backup", {}).get(node.id)
            if copy is not None:
                # HiCache-like: the host copy of a GPU node must be as good as the GPU rows.
                self.expect(BlockState.CPU, copy, fp, positions, f"host copy of {node!r}")
            stack.extend((child, int(fp[-1])) for child in node.children.values())
        return checked

    def serve(self, tokens, output_tokens: int = 0):
        """One request: match, lock, load, alloc, run the plans, check the reused KV, compute the
        rest, insert, unlock. Returns (match, load result or None), or None when it cannot run now
        (CacheFullError: running requests hold the GPU)."""

        cache = self.cache
        tokens = np.asarray(tokens, dtype=np.int64)
        n = len(tokens)
        fp = fingerprints(tokens)
        match = cache.match(tokens)
        handle = cache.lock(match)
        work = [*match.holes, (match.compute_from, n)]
        computed = sum(end - start for start, end in work)
        try:
            loaded = cache.load(handle) if match.loads else None
            fresh = cache.alloc(computed + output_tokens)
        except CacheFullError:
            cache.unlock(handle)
            self.run_plans()
            return None
        self.run_plans()
        slots = np.full(n, -1, dtype=np.int64)
        for span in match.spans:
            if span.state == BlockState.GPU:
                slots[span.start:span.end] = span.slots
        for span in loaded.spans if loaded else []:
            slots[span.start:span.end] = span.slots
        reused = slots >= 0
        positions = np.arange(n, dtype=np.int64)
        if reused.any():
            self.expect(BlockState.GPU, slots[reused], fp[reused], positions[reused], "reused KV after loads")
        used = 0
        for start, end in work:
            slots[start:end] = fresh[used:used + end - start]
            used += end - start
        assert (slots >= 0).all()
        computed_mask = ~reused
        self.write(slots[computed_mask], fp[computed_mask], positions[computed_mask])
        cache.insert(tokens, slots)
        if output_tokens:
            cache.free(fresh[used:])
        cache.unlock(handle)
        cache.check_invariants()
        self.run_plans()
        self.verify_all()
        return match, loaded




@st.composite
def workloads(draw):
    bs = draw(st.sampled_from([2, 4]))
    gpu = bs * draw(st.integers(3, 14)) + draw(st.integers(0, bs - 1))
    cpu = bs * draw(st.integers(1, 14)) + draw(st.integers(0, bs - 1))
    buffer = draw(st.integers(bs, 3 * bs + 1))
    policy = draw(st.sampled_from(policy_names()))
    seed = draw(st.integers(0, 2**32 - 1))
    system_len = draw(st.integers(0, 3 * bs))
    n_sessions = draw(st.integers(1, 4))
    ops = draw(st.lists(OPS, min_size=25, max_size=60))
    return bs, gpu, cpu, buffer, policy, seed, system_len, n_sessions, ops


def run_workload(bs, gpu, cpu, buffer, policy, seed, system_len, n_sessions, ops, make_cache=None):
    rng = random.Random(seed)

    def fresh(n):
        return [rng.randrange(50) for _ in range(n)]

    if make_cache is None:
        cache = TwoTierCache(gpu, cpu, block_size=bs, policy=policy, swap_buffer=buffer)
    else:
        cache = make_cache(gpu, cpu, bs)
    h = TierHarness(cache)
    system = fresh(system_len)
    sessions = [system + fresh(rng.randrange(1, 3 * bs)) for _ in range(n_sessions)]
    for kind, a, b, output, cut in ops:
        a %= n_sessions
        if kind == "turn":
            if len(sessions[a]) + output <= gpu and h.checked_serve(sessions[a], output) is not None:
                sessions[a] = sessions[a] + fresh(b)
            if len(sessions[a]) + 6 > gpu:
                sessions[a] = system + fresh(b % (gpu // 2))
        elif kind == "branch":
            sessions[b % n_sessions] = sessions[a][: int(cut * len(sessions[a]))] + fresh(bs)
        elif kind == "compact":
            sessions[a] = system + fresh(b % (gpu // 2))
        elif kind == "evict":
            result = cache.evict(a * b)
            assert result.freed_tokens >= min(a * b, result.freed_tokens)
            h.run_plans()
        elif kind == "probe":
            cache.match(np.asarray(sessions[a], dtype=np.int64))
        elif kind == "open" and len(sessions[a]) <= gpu:
            h.open_request(sessions[a][: int(cut * len(sessions[a]))] if b % 2 else sessions[a])
        elif kind == "close" and h.open:
            cache.unlock(h.open.pop(a % len(h.open)))
        h.check_step()
    while h.open:
        cache.unlock(h.open.pop())
        h.check_step()
    return h


KINDS = ["turn"] * 12 + ["branch", "compact", "evict", "probe", "open", "close"]
OPS = st.tuples(st.sampled_from(KINDS), st.integers(0, 3), st.integers(0, 24), st.integers(0, 6), st.floats(0, 1))


class TierHarness(FingerprintRig):
    """FingerprintRig plus the checks that need the cache's counters around each operation."""

    def __init__(self, cache):
        super().__init__(cache, cache.host_rows)
        self.open: list = []
        # Only the unified cache promises to delete nothing while the two tiers have room.
        self.unified = isinstance(cache, TwoTierCache)

    def room(self) -> int:
        """Tokens the two tiers can still take without deleting anything (whole blocks on the host)."""
        bs = self.cache.block_size
        return self.cache.free_size() + self.cache.cpu_free_size() // bs * bs

    def checked_serve(self, tokens, output_tokens):
        cache = self.cache
        before = cache.counters.deleted_gpu_tokens + cache.counters.deleted_cpu_tokens
        room = self.room()
        served = self.serve(tokens, output_tokens)
        deleted = cache.counters.deleted_gpu_tokens + cache.counters.deleted_cpu_tokens - before
        if deleted and self.unified:
            # Deleting is the last resort: the request's new KV did not fit in both tiers.
            assert room < len(tokens) + output_tokens, (room, len(tokens), output_tokens)
        self.check_step()
        return served

    def check_step(self):
        cache = self.cache
        cache.check_invariants()
        self.verify_all()
        gpu_cached = cache.evictable_size() + cache.protected_size()
        cpu_cached = cache.cpu_evictable_size() + cache.cpu_protected_size()
        assert gpu_cached + cpu_cached <= cache.total_capacity
        if self.unified:
            assert len(np.intersect1d(cache.buffer_slots(), cache.tree.slots_in(BlockState.CPU))) == 0

    def open_request(self, tokens):
        """A running request: its path locked and loaded onto the GPU, held across other turns."""
        cache = self.cache
        match = cache.match(np.asarray(tokens, dtype=np.int64))
        handle = cache.lock(match)
        try:
            if match.loads:
                cache.load(handle)
        except CacheFullError:
            cache.unlock(handle)
            return
        self.run_plans()
        self.open.append(handle)




