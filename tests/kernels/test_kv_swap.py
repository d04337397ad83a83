"""Bit-exactness and validation of the KV slot copy, and the swap-buffer exchange against references.

Pools are filled with random BITS (every pattern, NaN payloads included) and compared through integer
views with ``torch.equal``, so a copy that converts values instead of moving bits fails.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from penelope.kernels.kv_swap import (  # noqa: E402
    copy_kv_slots,
    exchange_kv,
    naive_copy_kv_slots,
    plan_exchange,
    run_exchange,
)
from penelope.kernels.kv_swap import kernel as kv_kernel  # noqa: E402

COPIES = {"triton": copy_kv_slots, "naive": naive_copy_kv_slots}
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT_OF_SIZE[t.element_size()])


def random_pool(n_buffers, slots, row, dtype, gen):
    """``n_buffers`` tensors ``[slots, *row]`` of random bits."""
    size = torch.empty((), dtype=dtype).element_size()
    pool = []
    for _ in range(n_buffers):
        raw = torch.randint(0, 256, (slots, *row[:-1], row[-1] * size), dtype=torch.uint8, generator=gen)
        pool.append(raw.view(dtype))
    return pool


def reference_copy(src, dst, src_slots, dst_slots):
    """Expected destination after the copy: one row at a time, in Python."""
    expected = [bits(d).clone() for d in dst]
    for layer, s in enumerate(src):
        for s_slot, d_slot in zip(src_slots.tolist(), dst_slots.tolist(), strict=True):
            expected[layer][d_slot] = bits(s)[s_slot]
    return expected


def assert_bits_equal(actual, expected):
    assert len(actual) == len(expected)
    for layer, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert torch.equal(bits(a), e), f"layer {layer} differs"


def run_copy_case(copy, n_buffers, src_slots, dst_slots, dtype, row=(2, 8), src_rows=64, dst_rows=80, seed=0):
    gen = torch.Generator().manual_seed(seed)
    src = random_pool(n_buffers, src_rows, row, dtype, gen)
    dst = random_pool(n_buffers, dst_rows, row, dtype, gen)
    src_before = [bits(s).clone() for s in src]
    expected = reference_copy(src, dst, src_slots, dst_slots)
    COPIES[copy](src, dst, src_slots, dst_slots)
    assert_bits_equal(dst, expected)
    assert_bits_equal(src, src_before)


def slot_pair(n, src_rows, dst_rows, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(src_rows, generator=gen)[:n], torch.randperm(dst_rows, generator=gen)[:n]


@pytest.mark.parametrize("copy", ["triton", "naive"])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]
)
def test_copy_is_bit_exact_for_every_dtype(copy, dtype):
    src_slots, dst_slots = slot_pair(37, 64, 80, seed=1)
    run_copy_case(copy, 4, src_slots, dst_slots, dtype)


@pytest.mark.parametrize("copy", ["triton", "naive"])
@pytest.mark.parametrize("n", [0, 1, 63, 65])
def test_copy_odd_counts_unsorted(copy, n):
    src_slots, dst_slots = slot_pair(n, 100, 120, seed=n)
    run_copy_case(copy, 3, src_slots, dst_slots, torch.bfloat16, src_rows=100, dst_rows=120)


@pytest.mark.parametrize("row", [(1, 1), (3, 5), (8, 128), (1, 3)])
def test_copy_odd_row_shapes(row):
    # (3, 5) bf16 rows are 30 bytes (2-byte words); (1, 3) fp8 rows are 3 bytes (1-byte words).
    src_slots, dst_slots = slot_pair(20, 24, 30, seed=3)
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        run_copy_case("triton", 2, src_slots, dst_slots, dtype, row=row, src_rows=24, dst_rows=30)


def test_copy_thousands_of_slots_all_layers_one_launch(monkeypatch):
    launches = []
    real = kv_kernel._copy_kv_slots_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(kv_kernel, "_copy_kv_slots_kernel", Counting())
    src_slots, dst_slots = slot_pair(3000, 4096, 3500, seed=4)
    run_copy_case("triton", 8, src_slots, dst_slots, torch.float16, row=(1, 4), src_rows=4096, dst_rows=3500)
    assert len(launches) == 1
    assert launches[0][1] == 8


def test_copy_all_layers_of_a_36_layer_model():
    # K and V of 36 layers: 72 buffers in one launch.
    src_slots, dst_slots = slot_pair(9, 16, 16, seed=5)
    run_copy_case("triton", 72, src_slots, dst_slots, torch.bfloat16, row=(2, 4), src_rows=16, dst_rows=16)


@pytest.mark.parametrize("copy", ["triton", "naive"])
def test_copy_within_one_pool_disjoint_slots(copy):
    gen = torch.Generator().manual_seed(6)
    pool = random_pool(4, 100, (2, 8), torch.bfloat16, gen)
    perm = torch.randperm(100, generator=gen)
    src_slots, dst_slots = perm[:40], perm[40:80]
    expected = reference_copy(pool, pool, src_slots, dst_slots)
    COPIES[copy](pool, pool, src_slots, dst_slots)
    assert_bits_equal(pool, expected)


def test_copy_strided_and_unaligned_buffers():
    gen = torch.Generator().manual_seed(7)
    # Slot stride larger than a row: K and V interleaved in one [slots, 2, H, D] tensor per layer.
    src_kv = random_pool(2, 50, (2, 3, 4), torch.bfloat16, gen)
    src = [t[:, 0] for t in src_kv] + [t[:, 1] for t in src_kv]
    # Base addresses off by one element (2 bytes): the kernel must fall back to 2-byte words.
    dst_big = random_pool(4, 61, (3, 4), torch.bfloat16, gen)
    dst = [t.view(-1)[1:1 + 60 * 12].view(60, 3, 4) for t in dst_big]
    assert kv_kernel.check_pools(src, dst).word_bytes == 2
    src_slots, dst_slots = slot_pair(33, 50, 60, seed=8)
    expected = reference_copy(src, dst, src_slots, dst_slots)
    copy_kv_slots(src, dst, src_slots, dst_slots)
    assert_bits_equal(dst, expected)


def test_copy_into_interleaved_k_and_v_destinations():
    """K and V of a layer interleaved in one tensor share a memory range but no row: accepted."""
    gen = torch.Generator().manual_seed(12)
    src = random_pool(4, 20, (3, 4), torch.float32, gen)
    dst_kv = random_pool(2, 24, (2, 3, 4), torch.float32, gen)
    dst = [t[:, 0] for t in dst_kv] + [t[:, 1] for t in dst_kv]
    src_slots, dst_slots = slot_pair(9, 20, 24, seed=13)
    expected = reference_copy(src, dst, src_slots, dst_slots)
    copy_kv_slots(src, dst, src_slots, dst_slots)
    assert_bits_equal(dst, expected)


def test_copy_accepts_non_contiguous_slot_tensors():
    src_slots, dst_slots = slot_pair(40, 64, 80, seed=9)
    run_copy_case("triton", 2, src_slots[::2], dst_slots[::2], torch.float32)


def test_word_size_is_widest_aligned():
    gen = torch.Generator().manual_seed(10)
    pools = random_pool(2, 8, (2, 8), torch.bfloat16, gen)
    assert kv_kernel.check_pools(pools[:1], pools[1:]).word_bytes == 8
    odd = random_pool(2, 8, (1, 3), torch.bfloat16, gen)
    assert kv_kernel.check_pools(odd[:1], odd[1:]).word_bytes == 2


def _pools(dtype=torch.bfloat16, layers=2, rows=(16, 16), row=(2, 4)):
    gen = torch.Generator().manual_seed(11)
    return random_pool(layers, rows[0], row, dtype, gen), random_pool(layers, rows[1], row, dtype, gen)


def _bad_cases():
    src, dst = _pools()
    ok = torch.arange(4)
    fp16_dst = [d.view(torch.float16) for d in dst]
    return {
        "lengths": (src, dst, ok, torch.arange(3), "entries"),
        "int32": (src, dst, ok.int(), ok, "int64"),
        "2-D slots": (src, dst, ok.view(2, 2), ok.view(2, 2), "1-D"),
        "negative": (src, dst, torch.tensor([0, -1]), torch.tensor([0, 1]), "slot -1"),
        "src range": (src, dst, torch.tensor([0, 16]), torch.tensor([0, 1]), "slot 16"),
        "dst range": (src, dst, torch.tensor([0, 1]), torch.tensor([0, 99]), "slot 99"),
        "duplicate dst": (src, dst, torch.tensor([0, 1]), torch.tensor([5, 5]), "duplicates"),
        "dtype": (src, fp16_dst, ok, ok, "dtype"),
        "row shape": (src, [d.view(16, 4, 2) for d in dst], ok, ok, "rows"),
        "layers": (src, dst[:1], ok, ok, "layer buffers"),
        "rows not contiguous": (src, [d.transpose(1, 2) for d in dst], ok, ok, "not contiguous"),
        "mixed shapes": (src, [dst[0], dst[1][:8]], ok, ok, "all layers must match"),
        "same pool overlap": (src, src, torch.tensor([0, 1]), torch.tensor([1, 2]), "both read and written"),
        "stride-0 dst": (src, [torch.zeros(1, 2, 4, dtype=src[0].dtype).expand(16, 2, 4) for _ in dst], ok, ok,
                         "rows overlap"),
        "dst layers share memory": (src, [dst[0], dst[0]], ok, ok, "share memory"),
        "layers crossed within a pool": (src, [src[1], src[0]], ok, ok, "share memory"),
        "overlapping views": (src, [src[0][1:], src[1][1:]], ok, ok, "different views"),
        "tensor not list": (src[0], dst[0], ok, ok, "list"),
        "empty pool list": ([], [], ok, ok, "empty"),
        "meta src slots": (src, dst, torch.zeros(4, dtype=torch.int64, device="meta"), ok, "src_slots is on meta"),
        "meta dst slots": (src, dst, ok, torch.zeros(4, dtype=torch.int64, device="meta"), "dst_slots is on meta"),
        # Autograd refuses in-place writes to such leaves; the copy writes memory behind its back.
        "dst requires grad": (src, [d.clone().requires_grad_() for d in dst], ok, ok, r"dst\[0\] requires grad"),
        "dst parameters": (src, [torch.nn.Parameter(d.clone()) for d in dst], ok, ok, r"dst\[0\] requires grad"),
    }


@pytest.mark.parametrize("copy", ["triton", "naive"])
@pytest.mark.parametrize("case", list(_bad_cases()))
def test_copy_rejects_bad_input_without_writing(copy, case):
    src, dst, src_slots, dst_slots, message = _bad_cases()[case]
    before = [bits(d).clone() for d in dst] if isinstance(dst, list) else None
    with pytest.raises(ValueError, match=message):
        COPIES[copy](src, dst, src_slots, dst_slots)
    if before is not None:
        assert_bits_equal(dst, before)


def test_triton_copy_needs_a_gpu_or_the_interpreter(monkeypatch):
    monkeypatch.setattr(kv_kernel, "_is_interpreted", lambda: False)
    src, dst = _pools()
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        copy_kv_slots(src, dst, torch.arange(2), torch.arange(2))


# ---- the exchange ----


def full_tiers(gpu_slots, host_slots, n, buffer, seed):
    """A both-tiers-full state: every GPU slot live; every host slot live except the buffer.

    Returns (out_gpu_slots, in_host_slots, buffer_slots) as numpy arrays in random order."""
    rng = np.random.default_rng(seed)
    host = rng.permutation(host_slots)
    return rng.permutation(gpu_slots)[:n], host[buffer:buffer + n], host[:buffer]


def reference_rotation(out_gpu, in_host, buffer, chunk):
    """Slow obvious model of the rotation on slot contents (labels, not tensors).

    Returns (gpu, host): dicts slot -> label, where label ("out", i) / ("in", i) is outgoing or
    incoming row i and None an empty slot."""
    gpu = {int(s): ("out", i) for i, s in enumerate(out_gpu)}
    host = {int(s): ("in", i) for i, s in enumerate(in_host)}
    host.update({int(s): None for s in buffer})
    free_host = [int(s) for s in buffer]
    for start in range(0, len(out_gpu), chunk):
        idx = range(start, min(start + chunk, len(out_gpu)))
        for i in idx:
            slot = free_host.pop(0)
            assert host[slot] is None, "the rotation wrote over live data"
            host[slot] = gpu[int(out_gpu[i])]
            gpu[int(out_gpu[i])] = None
        for i in idx:
            g, h = int(out_gpu[i]), int(in_host[i])
            assert gpu[g] is None
            gpu[g], host[h] = host[h], None
            free_host.append(h)
    return gpu, host


def check_plan_against_reference(plan, out_gpu, in_host, buffer, chunk):
    gpu, host = reference_rotation(out_gpu, in_host, buffer, chunk)
    n = len(out_gpu)
    for i in range(n):
        assert host[int(plan.out_host_slots[i])] == ("out", i)
        assert gpu[int(plan.in_gpu_slots[i])] == ("in", i)
    empty = sorted(s for s, label in host.items() if label is None)
    assert sorted(plan.buffer_slots.tolist()) == empty
    assert len(plan.buffer_slots) == len(buffer)
    assert not set(plan.buffer_slots.tolist()) & set(plan.out_host_slots.tolist())


def assert_exchange_moved_rows(plan, gpu_before, host_before, gpu_after, host_after, out_gpu, in_host):
    """Every outgoing row's bits at its returned host slot, every incoming row's at its GPU slot,
    and every row not in the exchange untouched."""
    out_host = torch.from_numpy(plan.out_host_slots)
    in_gpu = torch.from_numpy(plan.in_gpu_slots)
    touched_host = set(plan.out_host_slots.tolist()) | set(in_host.tolist()) | set(plan.buffer_slots.tolist())
    keep_host = torch.tensor(sorted(set(range(host_before[0].shape[0])) - touched_host), dtype=torch.int64)
    keep_gpu = torch.tensor(sorted(set(range(gpu_before[0].shape[0])) - set(out_gpu.tolist())), dtype=torch.int64)
    for layer in range(len(gpu_before)):
        g0, h0, g1, h1 = gpu_before[layer], host_before[layer], bits(gpu_after[layer]), bits(host_after[layer])
        assert torch.equal(h1[out_host], g0[torch.from_numpy(out_gpu)])
        assert torch.equal(g1[in_gpu], h0[torch.from_numpy(in_host)])
        assert torch.equal(h1[keep_host], h0[keep_host])
        assert torch.equal(g1[keep_gpu], g0[keep_gpu])


@pytest.mark.parametrize("copy", ["triton", "naive"])
@pytest.mark.parametrize(
    ("gpu_slots", "host_slots", "n", "buffer", "chunk"),
    [
        (64, 96, 64, 16, None),  # both tiers full, the whole GPU swapped out, paper's chunk = buffer
        (64, 96, 50, 16, 8),  # chunk = half the buffer: the two directions may overlap
        (40, 200, 37, 7, 3),  # odd sizes, partial last chunk, host larger than needed
        (32, 32, 1, 1, None),  # one row through a one-slot buffer
        (32, 48, 0, 4, None),  # nothing to exchange
    ],
)
def test_exchange_on_random_full_tiers(copy, gpu_slots, host_slots, n, buffer, chunk):
    seed = gpu_slots + 7 * n
    out_gpu, in_host, buf = full_tiers(gpu_slots, host_slots, n, buffer, seed)
    gen = torch.Generator().manual_seed(seed)
    gpu_pool = random_pool(4, gpu_slots, (2, 4), torch.bfloat16, gen)
    host_pool = random_pool(4, host_slots, (2, 4), torch.bfloat16, gen)
    gpu_before = [bits(t).clone() for t in gpu_pool]
    host_before = [bits(t).clone() for t in host_pool]
    plan = exchange_kv(gpu_pool, host_pool, out_gpu, in_host, buf, chunk_size=chunk, copy=copy)
    check_plan_against_reference(plan, out_gpu, in_host, buf, chunk or buffer)
    assert_exchange_moved_rows(plan, gpu_before, host_before, gpu_pool, host_pool, out_gpu, in_host)


def test_exchange_chained_twice_keeps_every_row():
    # The buffer returned by one exchange is the buffer of the next; rows go out and come back.
    out_gpu, in_host, buf = full_tiers(48, 64, 30, 8, seed=12)
    gen = torch.Generator().manual_seed(12)
    gpu_pool = random_pool(2, 48, (1, 8), torch.float16, gen)
    host_pool = random_pool(2, 64, (1, 8), torch.float16, gen)
    gpu_before = [bits(t).clone() for t in gpu_pool]
    first = exchange_kv(gpu_pool, host_pool, out_gpu, in_host, buf, chunk_size=4)
    second = exchange_kv(gpu_pool, host_pool, first.in_gpu_slots, first.out_host_slots, first.buffer_slots)
    for layer in range(2):
        # The original GPU rows are back in their original slots.
        assert torch.equal(bits(gpu_pool[layer])[torch.from_numpy(second.in_gpu_slots)],
                           gpu_before[layer][torch.from_numpy(out_gpu)])


def happens_before(steps):
    """Transitive closure of the GPU schedule: same-direction list order plus ``after`` edges."""
    n = len(steps)
    before = np.zeros((n, n), dtype=bool)
    last = {}
    for i, step in enumerate(steps):
        preds = [p for p in (last.get(step.kind), step.after if step.after >= 0 else None) if p is not None]
        for p in preds:
            before[p, i] = True
            before[:, i] |= before[:, p]
        last[step.kind] = i
    return before


def footprint(step):
    """(reads, writes) as sets of ("gpu"|"host", slot)."""
    src_side, dst_side = ("gpu", "host") if step.kind == "d2h" else ("host", "gpu")
    return ({(src_side, int(s)) for s in step.src_slots}, {(dst_side, int(s)) for s in step.dst_slots})


@settings(max_examples=60, deadline=None)
@given(
    gpu_slots=st.integers(1, 40),
    extra_host=st.integers(0, 20),
    data=st.data(),
)
def test_plan_rotation_and_stream_schedule_are_race_free(gpu_slots, extra_host, data):
    n = data.draw(st.integers(0, gpu_slots))
    buffer = data.draw(st.integers(1, 12))
    chunk = data.draw(st.integers(1, buffer))
    seed = data.draw(st.integers(0, 2**16))
    out_gpu, in_host, buf = full_tiers(gpu_slots, n + buffer + extra_host, n, buffer, seed)
    plan = plan_exchange(out_gpu, in_host, buf, chunk_size=chunk)
    check_plan_against_reference(plan, out_gpu, in_host, buf, chunk)
    steps = plan.steps
    assert len(steps) == 2 * -(-n // chunk)
    # Any two steps the two-stream schedule leaves unordered must touch disjoint rows.
    before = happens_before(steps)
    for i in range(len(steps)):
        reads_i, writes_i = footprint(steps[i])
        for j in range(i + 1, len(steps)):
            if before[i, j] or before[j, i]:
                continue
            reads_j, writes_j = footprint(steps[j])
            assert not writes_i & (reads_j | writes_j), (i, j)
            assert not writes_j & reads_i, (i, j)


def test_plan_overlaps_directions_only_with_room_in_the_buffer():
    out_gpu, in_host, buf = full_tiers(64, 96, 64, 16, seed=13)
    chained = happens_before(plan_exchange(out_gpu, in_host, buf).steps)
    # chunk == buffer: every step waits for the previous one.
    assert all(chained[i, i + 1] for i in range(len(chained) - 1))
    halves = plan_exchange(out_gpu, in_host, buf, chunk_size=8).steps
    overlap = happens_before(halves)
    # d2h of chunk 1 (step 2) and h2d of chunk 0 (step 1) may run at the same time.
    assert halves[1].kind == "h2d" and halves[2].kind == "d2h"
    assert not overlap[1, 2] and not overlap[2, 1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([0, 1], [5], [9]), "as many rows"),
        (([0, 0], [5, 6], [9]), "GPU slot 0 twice"),
        (([0, 1], [5, 6], [6, 9]), "host slot 6"),
        (([0, 1], [5, 6], []), "exceeds the swap buffer"),
        (([0, -1], [5, 6], [9]), "negative"),
        (([[0, 1]], [[5, 6]], [9]), "1-D"),
        (([0.5], [5], [9]), "integer"),
    ],
)
def test_plan_rejects_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        plan_exchange(*args)


@pytest.mark.parametrize("chunk", [0, 3, -2])
def test_plan_rejects_bad_chunk_size(chunk):
    with pytest.raises(ValueError, match="chunk_size"):
        plan_exchange([0, 1], [5, 6], [8, 9], chunk_size=chunk)


def test_run_exchange_rejects_unknown_copy_and_out_of_range_plans():
    gen = torch.Generator().manual_seed(14)
    gpu_pool = random_pool(2, 8, (1, 4), torch.float32, gen)
    host_pool = random_pool(2, 8, (1, 4), torch.float32, gen)
    plan = plan_exchange([0, 1], [5, 6], [7])
    with pytest.raises(ValueError, match="unknown copy function"):
        run_exchange(plan, gpu_pool, host_pool, copy="memcpy")
    too_far = plan_exchange([0, 9], [5, 6], [7])
    before = [bits(t).clone() for t in gpu_pool + host_pool]
    with pytest.raises(ValueError, match="outside the pool"):
        run_exchange(too_far, gpu_pool, host_pool)
    assert_bits_equal(gpu_pool + host_pool, before)


@pytest.mark.slow
@pytest.mark.parametrize("copy", ["triton", "naive"])
def test_exchange_large_chunks_of_qwen_like_rows(copy):
    # 36 layers x K/V, 8 x 128 bf16 rows, 1,024-token chunks; sizes as in the GPU benchmark, fewer slots.
    out_gpu, in_host, buf = full_tiers(2048, 3072, 2048, 1024, seed=15)
    gen = torch.Generator().manual_seed(15)
    gpu_pool = random_pool(72, 2048, (8, 128), torch.bfloat16, gen)
    host_pool = random_pool(72, 3072, (8, 128), torch.bfloat16, gen)
    gpu_before = [bits(t).clone() for t in gpu_pool]
    host_before = [bits(t).clone() for t in host_pool]
    plan = exchange_kv(gpu_pool, host_pool, out_gpu, in_host, buf, copy=copy)
    check_plan_against_reference(plan, out_gpu, in_host, buf, 1024)
    assert_exchange_moved_rows(plan, gpu_before, host_before, gpu_pool, host_pool, out_gpu, in_host)


HOPPER_COMPILE = """
import re, sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from penelope.kernels.kv_swap import kernel as k

gpu = [torch.empty((16, 8, 128), dtype=torch.bfloat16) for _ in range(2)]
pools = k.check_pools(gpu[:1], gpu[1:])
constants = k.kernel_constants(pools, "cuda")
constants["ALIGN"] = 16  # what a CUDA allocation guarantees
pointers = ["dst_ptr_table", "src_ptr_table", "dst_slots", "src_slots"]
signature = {name: "*i64" for name in pointers} | {"n_slots": "i32"} | {c: "constexpr" for c in constants}
attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(pointers))}
source = ASTSource(fn=k._copy_kv_slots_kernel, signature=signature, constexprs=constants, attrs=attrs)
ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
print(" ".join(sorted(set(re.findall(r"(?:ld|st)\\.global[.\\w]*", ptx)))))
"""


def test_kernel_compiles_for_hopper_with_16_byte_accesses():
    # The GPU path cannot run here, but it can be compiled: in a process without the interpreter,
    # build PTX for sm_90 and check that 2 KiB bf16 rows move as 16-byte vector loads and stores.
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", HOPPER_COMPILE], env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    accesses = done.stdout.split()
    assert "ld.global.v2.b64" in accesses and "st.global.v2.b64" in accesses, accesses
    # Only the table and slot loads are scalar; no scalar store.
    assert "st.global.b64" not in accesses and "st.global.b16" not in accesses, accesses
