"""Hostile-input fuzz suite, part two: swap-copy kernel calls (under the Triton interpreter) and
the SGLang adapter's cache calls (Penelope's radix cache over SGLang's real allocator).

Same rules as `test_fuzz_hostile.py`: every call ends in a clear error (one line) or is correctly
accepted; a rejected call changes nothing (the destination pool; the tree, locks and SGLang's
free list); an accepted copy equals a plain torch indexed copy; the adapter's invariants (SGLang's
conservation of slots included) hold after every call. Outcomes are counted in `fuzz_tally`.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from fuzz_tally import CLEAR_ERROR, attempt
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kernels.kv_swap import copy_kv_slots
from penelope.errors import CacheFullError, UsageError

FUZZ = dict(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
LAYERS, SRC_ROWS, DST_ROWS, ROW = 2, 8, 6, (2, 4)

SLOT_LISTS = st.one_of(
    st.lists(st.integers(0, DST_ROWS - 1), max_size=6, unique=True),
    st.lists(st.integers(-3, 10), max_size=6),
    st.lists(st.sampled_from([0, 2**40, -(2**40), 2**63 - 1]), min_size=1, max_size=3),
)
SLOT_DTYPES = st.sampled_from([torch.int64, torch.int64, torch.int64, torch.int32, torch.float32, "list", "2d",
                               "meta"])
DST_KINDS = st.sampled_from(["fresh", "fresh", "fresh", "same pool", "stride 0", "meta", "meta source", "half",
                             "short rows", "fewer layers", "non-contiguous rows", "not tensors", "requires grad"])


def slot_tensor(values: list[int], kind):
    if kind == "list":
        return values
    if kind == "2d":
        return torch.tensor(values, dtype=torch.int64).reshape(1, -1)
    if kind == "meta":
        return torch.empty(len(values), dtype=torch.int64, device="meta")
    try:
        return torch.tensor(values, dtype=kind)
    except (RuntimeError, OverflowError):
        return torch.tensor(values, dtype=torch.float64)


def destination(kind: str, src: list[torch.Tensor]):
    rows = DST_ROWS
    if kind == "same pool":
        return src
    if kind == "stride 0":
        return [torch.zeros(1, *ROW).expand(rows, *ROW) for _ in range(LAYERS)]
    if kind == "meta":
        return [torch.empty(rows, *ROW, device="meta") for _ in range(LAYERS)]
    if kind == "half":
        return [torch.zeros(rows, *ROW, dtype=torch.float16) for _ in range(LAYERS)]
    if kind == "short rows":
        return [torch.zeros(rows, ROW[0], ROW[1] - 1) for _ in range(LAYERS)]
    if kind == "fewer layers":
        return [torch.zeros(rows, *ROW)]
    if kind == "non-contiguous rows":
        return [torch.zeros(rows, ROW[1], ROW[0]).transpose(1, 2) for _ in range(LAYERS)]
    if kind == "not tensors":
        return [[0.0] * 8 for _ in range(LAYERS)]
    if kind == "requires grad":
        return [torch.nn.Parameter(torch.full((rows, *ROW), -1.0)) for _ in range(LAYERS)]
    return [torch.full((rows, *ROW), -1.0) for _ in range(LAYERS)]


def snapshot(pools) -> list:
    return [p.clone() if isinstance(p, torch.Tensor) and p.device.type != "meta" else p for p in pools]


@settings(max_examples=120, **FUZZ)
@given(src_values=SLOT_LISTS, dst_values=SLOT_LISTS, src_kind=SLOT_DTYPES, dst_kind=SLOT_DTYPES, pool=DST_KINDS,
       seed=st.integers(0, 2**16), trim=st.booleans())
# Always tried: inputs valid but for one thing (drawn examples rarely combine that).
@example(src_values=[0, 1], dst_values=[2, 3], src_kind=torch.int64, dst_kind=torch.int64, pool="requires grad",
         seed=0, trim=False)
@example(src_values=[0, 1], dst_values=[2, 3], src_kind="meta", dst_kind=torch.int64, pool="fresh", seed=0,
         trim=False)
@example(src_values=[0, 1], dst_values=[2, 3], src_kind=torch.int64, dst_kind="meta", pool="fresh", seed=0,
         trim=False)
def test_fuzz_swap_copy_kernel_calls(src_values, dst_values, src_kind, dst_kind, pool, seed, trim):
    if trim:
        # Equal lengths half the time: most other inputs are valid then, so the copy runs.
        n = min(len(src_values), len(dst_values))
        src_values, dst_values = src_values[:n], dst_values[:n]
    generator = torch.Generator().manual_seed(seed)
    src = [torch.randn(SRC_ROWS, *ROW, generator=generator) for _ in range(LAYERS)]
    dst = destination(pool, src)
    if pool == "meta source":
        src = [torch.empty(SRC_ROWS, *ROW, device="meta") for _ in range(LAYERS)]
    src_slots, dst_slots = slot_tensor(src_values, src_kind), slot_tensor(dst_values, dst_kind)
    src_before, dst_before = snapshot(src), snapshot(dst)
    outcome, _ = attempt("swap-copy kernel calls", lambda: copy_kv_slots(src, dst, src_slots, dst_slots),
                         errors=(ValueError,))
    if outcome == CLEAR_ERROR:
        for before, after in zip(src_before + dst_before, src + dst, strict=True):
            if isinstance(after, torch.Tensor) and after.device.type != "meta":
                assert torch.equal(before, after), "a rejected copy wrote to a pool"
        return
    # Accepted: exactly a torch indexed copy of the original rows, nothing else touched.
    assert pool in ("fresh", "same pool"), f"copy into a {pool} destination was accepted"
    if pool == "same pool":
        # Within one pool a row read and written in the same launch races on a GPU.
        assert not set(src_slots.tolist()) & set(dst_slots.tolist()), "overlapping copy within a pool accepted"
    for layer in range(LAYERS):
        want = dst_before[layer].clone()
        want[dst_slots.long()] = src_before[layer][src_slots.long()]
        assert torch.equal(dst[layer], want)
        if pool != "same pool":
            assert torch.equal(src[layer], src_before[layer])


# SGLang's adapter -------------------------------------------------------------------------------

BLOCK = 8


def adapter_state(serving) -> tuple:
    """What a rejected adapter call must leave as it was: tree, locks, SGLang's free list."""
    cache, allocator = serving.cache, serving.allocator
    free = torch.cat([allocator.free_pages, allocator.release_pages]).sort().values.tolist()
    nodes = sorted((n.start, n.key, n.slots.tolist(), n.state.tolist(), n.lock_ref)
                   for n in cache.cache.tree.nodes())
    return (free, nodes, sorted(cache._locks), cache.evictable_size(), cache.protected_size(),
            np.flatnonzero(cache.slots._in_tree).tolist())


TOKEN_LISTS = st.one_of(
    st.lists(st.integers(0, 40), min_size=0, max_size=40),
    st.lists(st.integers(-(2**40), 2**40), max_size=20),
    st.sampled_from([[], [0] * 7, list(range(100, 132)), list(range(100, 124)) + [7] * 8]),
    # Not token ids: refused, never truncated (1.5 -> 1, True -> 1).
    st.sampled_from([[1.5] * 8, [True] * 8, [None] * 8, [2**64] * 8, list(range(100, 107)) + [2**63]]),
)
VALUE_KINDS = st.sampled_from(["held", "held", "tree", "repeated", "never allocated", "short", "float", "none",
                               "out of range", "int32", "meta", "list", "bool"])
# Not a number of tokens (op 7).
ODD_COUNTS = [None, "8", 2.5, float("nan"), True]


@pytest.fixture(scope="module")
def sglang_parts():
    # SGLang's CPU-importable modules are installed by the test command: never skipped.
    from sglang.srt.mem_cache.base_prefix_cache import DecLockRefParams, EvictParams, InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang_env import Serving

    return Serving, InsertParams, EvictParams, DecLockRefParams, RadixKey


@settings(max_examples=80, **FUZZ)
@given(steps=st.lists(st.tuples(st.integers(0, 9), TOKEN_LISTS, VALUE_KINDS, st.integers(-5, 300)),
                      min_size=4, max_size=20))
def test_fuzz_sglang_adapter_calls(sglang_parts, steps):
    Serving, InsertParams, EvictParams, DecLockRefParams, RadixKey = sglang_parts
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    serving = Serving(size=256, page_size=1, block_size=BLOCK)
    cache, allocator = serving.cache, serving.allocator
    held: list[int] = []  # slots "a request" holds: allocated from SGLang, not in the tree
    refs, receipts = [], []

    def value_for(kind: str, n: int):
        tree = np.flatnonzero(cache.slots._in_tree)
        if kind == "held" and len(held) >= n:
            return torch.tensor(held[:n], dtype=torch.int64)
        if kind == "tree" and len(tree):
            return torch.tensor(np.resize(tree, n), dtype=torch.int64)
        if kind == "repeated" and held:
            return torch.tensor([held[0]] * n, dtype=torch.int64)
        if kind == "never allocated" and allocator.available_size():
            free = torch.cat([allocator.free_pages, allocator.release_pages])
            return free[:n].repeat(n)[:n].to(torch.int64)
        if kind == "short":
            return torch.tensor(held[: max(n - 1, 0)], dtype=torch.int64)
        if kind == "float":
            return torch.tensor(held[:n], dtype=torch.float32)
        if kind == "out of range":
            return torch.full((n,), 10**6, dtype=torch.int64)
        if kind == "int32" and len(held) >= n:
            return torch.tensor(held[:n], dtype=torch.int32)
        if kind == "meta":
            return torch.empty(n, dtype=torch.int64, device="meta")
        if kind == "list" and len(held) >= n:
            return held[:n]
        if kind == "bool":
            return torch.ones(n, dtype=torch.bool)
        return None

    foreign = []

    def foreign_ref():
        """A node of another cache holding the same tokens in the same slots."""
        if not foreign:
            other = Serving(size=256, page_size=1, block_size=BLOCK)
            tokens = list(range(100, 116))
            other.cache.insert(InsertParams(key=RadixKey(tokens), value=other.allocator.alloc(16)))
            foreign.append(other.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).last_device_node)
        return foreign[0]

    def call(op: int, tokens: list[int], kind: str, number: int):
        if op == 0:
            value = value_for(kind, len(tokens))
            result = cache.insert(InsertParams(key=RadixKey(tokens), value=value))
            if value is not None and result.total_len:
                # The tree took the slots past the cached prefix; the caller frees the leading
                # duplicates, as SGLang's scheduler does.
                taken = value[:result.total_len].long().tolist()
                ours = set(held)
                leading = [s for s in taken[:result.prefix_len] if s in ours]
                allocator.free(torch.tensor(leading, dtype=torch.int64))
                held[:] = [s for s in held if s not in set(taken)]
            return result
        if op == 1:
            refs.append(cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).last_device_node)
            return None
        if op == 2:
            return cache.evict(EvictParams(num_tokens=number))
        if op == 3:
            receipt = cache.inc_lock_ref(refs[number % len(refs)] if refs else number)
            receipts.append((refs[number % len(refs)] if refs else None, receipt.node_id))
            return receipt
        if op == 4:
            node, lock_id = receipts[number % len(receipts)] if receipts else (number, None)
            return cache.dec_lock_ref(node, DecLockRefParams(node_id=lock_id))
        if op == 5:
            slots = allocator.alloc(max(number, 0) % 64)
            if slots is not None:
                held.extend(slots.tolist())
            return slots
        if op == 7:
            return cache.evict(EvictParams(num_tokens=ODD_COUNTS[number % len(ODD_COUNTS)]))
        if op == 8:
            return cache.inc_lock_ref(foreign_ref())
        if op == 9 and receipts:
            # One holder's node with another holder's receipt.
            node, _ = receipts[number % len(receipts)]
            return cache.dec_lock_ref(node, DecLockRefParams(node_id=receipts[(number + 1) % len(receipts)][1]))
        if held:
            allocator.free(torch.tensor(held, dtype=torch.int64))
            held.clear()
        return None

    for op, tokens, kind, number in steps:
        before = adapter_state(serving)
        outcome, _ = attempt("SGLang adapter calls",
                             lambda: call(op, tokens, kind, number),  # noqa: B023 (called now)
                             errors=(UsageError, CacheFullError))
        if outcome == CLEAR_ERROR:
            assert adapter_state(serving) == before, f"rejected call {op} ({kind}) changed the adapter"
        elif op == 0 and kind in ("float", "meta", "bool"):
            raise AssertionError(f"insert of {kind} slots accepted")
        elif op in (0, 1) and len(tokens) >= BLOCK:
            assert all(type(t) is int and -(2**63) <= t < 2**63 for t in tokens), f"token ids {tokens[:2]} accepted"
        elif op in (7, 8):
            raise AssertionError(f"call {op} accepted: a bad evict count or another cache's node")
        elif op == 9 and receipts:
            node, _ = receipts[number % len(receipts)]
            owner, lock_id = receipts[(number + 1) % len(receipts)]
            assert node is owner or node.match is None or lock_id is None, "a receipt released another node's lock"
        cache.check_invariants()
        # SGLang's conservation check: every slot is free, in the tree or held by "a request".
        assert allocator.available_size() + cache.evictable_size() + cache.protected_size() + len(held) \
            == serving.total, "a slot was lost or counted twice"
        assert len(set(held)) == len(held)
