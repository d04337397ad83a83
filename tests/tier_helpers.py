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

import numpy as np
import torch

from penelope.cache.manager import KVCache
from penelope.cache.swap_executor import SwapExecutor
from penelope.cache.tree import BlockState

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
        from penelope.errors import CacheFullError

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
