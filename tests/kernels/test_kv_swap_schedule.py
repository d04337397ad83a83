"""The swap exchange's stream schedule, checked on a recorded stream/event model (no GPU needed).

``RecordingStreams`` runs every copy at once on the CPU (a valid execution of any correctly ordered
schedule, so results are compared bit for bit with the torch reference) and records every call. The
log gives happens-before (program order of each stream plus record -> wait edges), from which the
tests check: copies that touch the same rows are ordered (buffer slots are never rewritten before
the copy that reads them is done), each transfer waits for the event of the step it depends on,
compute waits per layer (a layer starts while later layers still load), nothing is a full-stream
barrier, and contiguous runs go to the copy engines while scattered rows go to the kernel.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from penelope.cache.host_tier import TierPlan  # noqa: E402
from penelope.cache.swap_executor import SwapExecutor  # noqa: E402
from penelope.kernels.kv_swap import (  # noqa: E402
    RecordingStreams,
    contiguous_runs,
    exchange_kv,
    layer_groups,
    plan_exchange,
    run_exchange,
)

LAYERS = 3
BLOCK = 8


def bits(t):
    return t.view(torch.int16)


def random_pool(n_buffers, slots, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(-(2**15), 2**15, (slots, 2, 4), generator=gen, dtype=torch.int32).to(torch.int16)
            .view(torch.bfloat16) for _ in range(n_buffers)]


def block_slots(n_blocks_total, n_blocks, seed, block=BLOCK):
    """Token slots of ``n_blocks`` random blocks (random order), some of them adjacent."""
    rng = np.random.default_rng(seed)
    blocks = np.sort(rng.choice(n_blocks_total, n_blocks, replace=False))
    if seed % 2:
        rng.shuffle(blocks)
    return (blocks[:, None] * block + np.arange(block)).reshape(-1)


def full_tier_exchange(n_rows, buffer_rows, seed, gpu_slots=96, host_slots=160):
    """Out GPU slots, in host slots and buffer slots made of whole blocks (copy-engine runs) plus a
    few scattered rows at the end (kernel)."""
    out_gpu = block_slots(gpu_slots // BLOCK, n_rows // BLOCK, seed)
    host = block_slots(host_slots // BLOCK, (n_rows + buffer_rows) // BLOCK, seed + 1)
    in_host, buffer = host[:n_rows], host[n_rows:]
    # Scatter the last 3 rows of each side so the kernel has work too.
    out_gpu[-3:] = out_gpu[-3:][::-1]
    in_host[-3:] = in_host[-3:][::-1]
    return out_gpu, in_host, buffer


def footprint(copy):
    """(reads, writes) of one recorded copy as sets of (pool, buffer, slot)."""
    src_side, dst_side = ("gpu", "host") if copy.kind == "d2h" else ("host", "gpu")
    reads = {(src_side, b, int(s)) for b in copy.buffers for s in copy.src_slots}
    writes = {(dst_side, b, int(s)) for b in copy.buffers for s in copy.dst_slots}
    return reads, writes


def copies(streams):
    return [(i, op) for i, op in enumerate(streams.ops) if op.kind == "copy"]


def assert_conflicts_ordered(streams):
    before = streams.happens_before()
    ops = copies(streams)
    prints = {i: footprint(op.copy) for i, op in ops}
    for a, (i, _) in enumerate(ops):
        reads_i, writes_i = prints[i]
        for j, _ in ops[a + 1 :]:
            reads_j, writes_j = prints[j]
            if writes_i & (reads_j | writes_j) or writes_j & reads_i:
                assert before[i, j], (streams.ops[i].copy, streams.ops[j].copy)


def test_contiguous_runs_split_runs_from_scattered_rows():
    src = np.array([0, 1, 2, 3, 10, 11, 20, 30, 31, 32])
    dst = np.array([5, 6, 7, 8, 30, 31, 40, 50, 51, 60])
    runs, rest = contiguous_runs(src, dst, 3)
    assert runs == [(0, 5, 4)] and rest.tolist() == [4, 5, 6, 7, 8, 9]
    runs, rest = contiguous_runs(src, dst, 2)
    # 30, 31, 32 -> 50, 51, 60: the destination breaks the run after two rows.
    assert runs == [(0, 5, 4), (10, 30, 2), (30, 50, 2)] and rest.tolist() == [6, 9]
    runs, rest = contiguous_runs(src, dst, None)
    assert runs == [] and rest.tolist() == list(range(10))
    assert contiguous_runs(np.array([], dtype=np.int64), np.array([], dtype=np.int64), 2)[0] == []


def test_layer_groups_follow_the_k_then_v_layout():
    assert layer_groups(6) == [(0, 3), (1, 4), (2, 5)]
    assert layer_groups(6, 6) == [(i,) for i in range(6)]
    with pytest.raises(ValueError, match="do not split"):
        layer_groups(6, 4)


@pytest.mark.parametrize("chunk", [None, 8], ids=["chunk=buffer", "chunk=half"])
def test_schedule_is_bit_exact_and_uses_both_engines(chunk):
    out_gpu, in_host, buffer = full_tier_exchange(40, 16, seed=3)
    gpu, host = random_pool(2 * LAYERS, 96, 1), random_pool(2 * LAYERS, 160, 2)
    gpu_ref, host_ref = [t.clone() for t in gpu], [t.clone() for t in host]
    streams = RecordingStreams()
    plan = plan_exchange(out_gpu, in_host, buffer, chunk)
    run_exchange(plan, gpu, host, streams=streams, min_run=BLOCK)
    run_exchange(plan, gpu_ref, host_ref, copy="naive")
    for a, b in zip(gpu + host, gpu_ref + host_ref, strict=True):
        assert torch.equal(bits(a), bits(b))
    engines = {op.copy.engine for _, op in copies(streams)}
    assert engines == {"copy_engine", "kernel"}
    # Every copy-engine copy is a whole run of at least min_run rows.
    assert all(len(op.copy.src_slots) >= BLOCK for _, op in copies(streams) if op.copy.engine == "copy_engine")
    assert_conflicts_ordered(streams)


def test_without_min_run_every_row_goes_through_the_kernel():
    out_gpu, in_host, buffer = full_tier_exchange(40, 16, seed=5)
    gpu, host = random_pool(2 * LAYERS, 96, 1), random_pool(2 * LAYERS, 160, 2)
    streams = RecordingStreams()
    run_exchange(plan_exchange(out_gpu, in_host, buffer), gpu, host, streams=streams, min_run=None)
    assert {op.copy.engine for _, op in copies(streams)} == {"kernel"}


def event_source(streams, event):
    """The last copy issued on the recording stream before ``event`` was recorded."""
    at = next(i for i, op in enumerate(streams.ops) if op.kind == "record" and op.event == event)
    stream = streams.ops[at].stream
    return next((op.copy for op in reversed(streams.ops[:at]) if op.kind == "copy" and op.stream == stream), None)


def test_each_transfer_waits_for_the_step_it_depends_on_in_its_own_layer():
    """chunk == buffer (the paper's rotation): h2d of chunk c waits for d2h of chunk c, and d2h of
    chunk c + 1 for h2d of chunk c, of the SAME layer; nothing else crosses between the streams
    except the start event."""
    out_gpu, in_host, buffer = full_tier_exchange(48, 16, seed=7)
    plan = plan_exchange(out_gpu, in_host, buffer)
    gpu, host = random_pool(2 * LAYERS, 96, 1), random_pool(2 * LAYERS, 160, 2)
    streams = RecordingStreams()
    run_exchange(plan, gpu, host, streams=streams, wait=False)
    start = next(op.event for op in streams.ops if op.kind == "record")
    seen = []
    for i, op in enumerate(streams.ops):
        if op.kind != "wait" or op.event == start:
            continue
        # The first copy on this stream after the wait is the waiting transfer.
        waiter = next(o.copy for o in streams.ops[i + 1 :] if o.kind == "copy" and o.stream == op.stream)
        source = event_source(streams, op.event)
        assert source.layer == waiter.layer and source.kind != waiter.kind
        chunk_of = {index: step.chunk for index, step in enumerate(plan.steps)}
        if waiter.kind == "h2d":
            assert chunk_of[source.step] == chunk_of[waiter.step]
        else:
            assert chunk_of[source.step] == chunk_of[waiter.step] - 1
        seen.append((waiter.kind, waiter.layer))
    chunks = len(plan.steps) // 2
    assert seen.count(("h2d", 0)) == chunks and seen.count(("d2h", LAYERS - 1)) == chunks - 1


def test_compute_waits_per_layer_and_overlaps_later_layers():
    out_gpu, in_host, buffer = full_tier_exchange(40, 16, seed=9)
    gpu, host = random_pool(2 * LAYERS, 96, 1), random_pool(2 * LAYERS, 160, 2)
    streams = RecordingStreams()
    writer = streams.compute("the forward that wrote the rows being demoted")
    handle = run_exchange(plan_exchange(out_gpu, in_host, buffer, 8), gpu, host, streams=streams, wait=False)
    # Issuing never makes compute wait: no wait on the current stream, no event the copies
    # wait for recorded anywhere but at issue.
    assert not [op for op in streams.ops if op.kind == "wait" and op.stream == "current"]
    layer_ops = []
    for layer in range(LAYERS):
        handle.wait_layer(layer)
        layer_ops.append(streams.compute(f"layer {layer}"))
    before = streams.happens_before()
    for i, op in copies(streams):
        if op.copy.kind == "d2h":
            assert before[writer, i]  # demotions read what compute wrote
        for layer, at in enumerate(layer_ops):
            if op.copy.layer <= layer:
                assert before[i, at], (op.copy.layer, layer)
            else:
                # Layer `layer` can run while layer op.copy.layer still copies.
                assert not before[i, at], (op.copy.layer, layer)
    handle.wait_all()
    final = streams.compute("after wait_all")
    before = streams.happens_before()
    assert all(before[i, final] for i, _ in copies(streams))


def test_slot_lists_stay_alive_on_both_side_streams():
    out_gpu, in_host, buffer = full_tier_exchange(40, 16, seed=11)
    gpu, host = random_pool(2 * LAYERS, 96, 1), random_pool(2 * LAYERS, 160, 2)
    streams = RecordingStreams()
    run_exchange(plan_exchange(out_gpu, in_host, buffer), gpu, host, streams=streams)
    assert {op.stream for op in streams.ops if op.kind == "keep_alive"} == {"d2h", "h2d"}


def test_executor_keeps_plans_ordered_without_compute_waiting():
    """Two plans started back to back: the second demotes rows the first one loaded; with per-layer
    waits only, the second plan's copies must still come after the first plan's."""
    gpu, host = random_pool(2 * LAYERS, 96, 1), random_pool(2 * LAYERS, 160, 2)
    gpu_ref, host_ref = [t.clone() for t in gpu], [t.clone() for t in host]
    first = TierPlan(to_gpu_host=np.arange(16, 32), to_gpu_gpu=np.arange(0, 16))
    second = TierPlan(to_host_gpu=np.arange(0, 16), to_host_host=np.arange(100, 116))
    streams = RecordingStreams()
    executor = SwapExecutor(gpu, host, copy="triton", num_layers=LAYERS, min_run=4)
    reference = SwapExecutor(gpu_ref, host_ref, copy="naive", num_layers=LAYERS)
    for plan in (first, second):
        executor.start(plan, streams=streams).wait_layer(0)
        reference.run(plan)
    assert_conflicts_ordered(streams)
    for a, b in zip(gpu + host, gpu_ref + host_ref, strict=True):
        assert torch.equal(bits(a), bits(b))


def test_exchange_kv_still_runs_a_whole_exchange_synchronously_on_cpu():
    out_gpu, in_host, buffer = full_tier_exchange(40, 16, seed=13)
    gpu, host = random_pool(2 * LAYERS, 96, 1), random_pool(2 * LAYERS, 160, 2)
    gpu_ref, host_ref = [t.clone() for t in gpu], [t.clone() for t in host]
    exchange_kv(gpu, host, out_gpu, in_host, buffer, chunk_size=8)
    exchange_kv(gpu_ref, host_ref, out_gpu, in_host, buffer, chunk_size=8, copy="naive")
    for a, b in zip(gpu + host, gpu_ref + host_ref, strict=True):
        assert torch.equal(bits(a), bits(b))
