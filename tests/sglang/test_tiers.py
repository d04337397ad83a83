"""Penelope's CPU tier inside the SGLang adapter, on SGLang 0.5.23's real pools (CPU): every
transition of a block (GPU -> CPU demotion, CPU -> GPU load, through the swap buffer when both
tiers are full, deletion from either tier, MISSING -> GPU refill, locked blocks that never move,
a load in flight while other requests are admitted), with every resident block's KV checked
where the tree says it is (SGLang's pool for GPU blocks, the host pool for CPU blocks), every
request row checked position by position, and SGLang's conservation sum after every step.

The real Engine runs the same in ``tests/sglang/test_engine.py``."""
from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang_env import Serving, blocks, sglang_config

from penelope.cache.tiers import TwoTierCache
from penelope.cache.tree import BlockState
from penelope.kernels.kv_swap import RecordingStreams


@pytest.fixture(autouse=True)
def _config():
    with sglang_config():
        yield


def block_states(serving: Serving) -> dict[tuple[int, bytes], tuple[str, bool]]:
    """(start position, tokens) of every block in the tree -> (state, locked)."""
    bs = serving.cache.block_size
    out = {}
    for node in serving.cache.cache.tree.nodes():
        for i, state in enumerate(node.state.tolist()):
            key = (node.start + i * bs, node.key[i * bs * 8:(i + 1) * bs * 8])
            out[key] = (BlockState(state).name, node.lock_ref > 0)
    return out


def check(serving: Serving) -> None:
    used, total = serving.accounting()
    assert used == total, f"available + evictable + protected + private = {used} != {total}"
    serving.check_tree_kv()
    serving.cache.check_invariants()


def history(base: int, n: int) -> list[int]:
    return blocks(1000, 2) + blocks(base, n)


def test_demote_then_load_back_through_the_adapter():
    serving = Serving(size=64 * 16, page_size=64, cpu_cache=64 * 16)
    assert isinstance(serving.cache.cache, TwoTierCache)
    a, b = history(10_000, 10), history(20_000, 10)
    assert serving.prefill([a + [1]])
    assert serving.prefill([b + [2]])  # the GPU holds 16 blocks: A's private history is demoted
    states = block_states(serving)
    assert sum(state == "CPU" for state, _ in states.values()) >= 8
    check(serving)
    [req] = serving.prefill([a + [3]])  # A's CPU spans come back before the request runs
    counters = serving.cache.cache.counters
    assert counters.loads >= 1 and counters.loaded_tokens >= 8 * 64
    assert req.cached_tokens == len(a)  # everything of A was a hit (loaded, not recomputed)
    check(serving)


def test_loads_through_the_swap_buffer_when_both_tiers_are_full():
    serving = Serving(size=64 * 14, page_size=64, cpu_cache=64 * 12, swap_buffer=128)
    histories = [history(10_000 * (i + 1), 9) for i in range(3)]
    for tokens in histories:
        assert serving.prefill([tokens + [1]])
        check(serving)
    assert serving.prefill([histories[0] + [2]])
    counters = serving.cache.cache.counters
    assert counters.swap_loads >= 1 and counters.swapped_tokens > 0
    check(serving)


def test_a_running_requests_path_never_moves_and_a_load_in_flight_stays():
    serving = Serving(size=64 * 16, page_size=64, cpu_cache=64 * 16)
    a, b, c = history(10_000, 10), history(20_000, 10), history(30_000, 10)
    serving.prefill([a + [1]])
    serving.prefill([b + [2]])
    # A is on the CPU tier now. Admit it (its load is in flight: copies issued, forward not run).
    [req] = serving.admit([a + [3]])
    path = {key for key, (state, locked) in block_states(serving).items() if locked}
    assert path and all(state == "GPU" for key, (state, _) in block_states(serving).items() if key in path)
    # Other requests need room (here: everything evictable): nothing of A's locked path moves.
    serving.cache.evict(EvictParams(num_tokens=10**6))
    other = serving.admit([c[:200]])
    after = block_states(serving)
    assert all(after.get(key, ("gone", False))[0] == "GPU" for key in path)
    assert sum(state == "CPU" for state, _ in after.values()) > 0  # what was not locked went to the host
    batch = serving.build_batch([req, *other])
    serving.forward(batch)
    serving.check_row(req)
    serving.finish(batch)
    check(serving)


def test_every_transition_happens_and_kv_follows_its_block():
    """A seeded agent-like workload under both tiers' pressure, with the census of transitions a
    block went through; all kinds must occur, and nothing is ever lost or misplaced."""
    rng = random.Random(7)
    serving = Serving(size=64 * 14, page_size=64, cpu_cache=64 * 10, swap_buffer=128)
    sessions = [history(100_000 * (i + 1), 1) for i in range(4)]
    fresh = iter(range(1, 10**6))
    seen: Counter = Counter()
    for step in range(120):
        before = block_states(serving)
        i = rng.choice([0, 0, 1, 1, 2, 3])
        op = rng.choice("tttte")
        if op == "t":
            if len(sessions[i]) > 11 * 64:
                sessions[i] = history(100_000 * (i + 1) + step * 1000, 1)
            sessions[i] = sessions[i] + [next(fresh) for _ in range(rng.randint(40, 200))]
            serving.prefill([sessions[i]])
        else:
            serving.cache.evict(EvictParams(num_tokens=rng.randint(64, 256)))
        after = block_states(serving)
        for key in before.keys() | after.keys():
            old, new = before.get(key, ("absent", False))[0], after.get(key, ("absent", False))[0]
            if old != new:
                seen[(old, new)] += 1
        check(serving)
    for transition in [("absent", "GPU"), ("GPU", "CPU"), ("CPU", "GPU"), ("MISSING", "GPU")]:
        assert seen[transition] > 0, f"{transition} never happened: {dict(seen)}"
    assert seen[("CPU", "MISSING")] + seen[("CPU", "absent")] > 0, dict(seen)
    counters = serving.cache.cache.counters
    assert counters.swap_loads > 0 and counters.deleted_cpu_tokens > 0
    np.testing.assert_equal(serving.req_pool.available_size(), 16)


@pytest.mark.parametrize("copy", ["triton", "naive"])
def test_every_tier_copy_is_ordered_against_the_forwards_that_touch_its_slots(copy):
    """SGLang's overlap scheduler issues the tier's copies from its scheduling stream while the
    previous forward may still run on the forward stream. With recording streams (every record,
    wait, copy and forward, in issue order), each copy happens after every earlier forward that
    read or wrote one of its GPU slots (it demotes KV that forward wrote, or loads into slots that
    forward still read), and every later forward that touches one of them happens after it (it
    reads what was loaded, or writes slots a demotion emptied)."""
    forward_stream = torch.cpu.Stream()  # what SGLang's model runner holds as forward_stream on CPU
    serving = Serving(size=64 * 16, page_size=64, cpu_cache=64 * 16, copy=copy, forward_stream=forward_stream)
    streams = RecordingStreams()
    serving.cache.host_kv.executor.streams = streams
    touched: dict[int, set[int]] = {}
    compute = serving.forward

    def forward(batch):
        compute(batch)
        table = serving.req_pool.req_to_token
        slots = set(batch.out_cache_loc.tolist())
        for req, prefix, length in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, strict=True):
            slots |= set(table[req.kv.req_pool_idx, :prefix + length].tolist())
        touched[streams.compute("forward", forward_stream)] = slots

    serving.forward = forward
    a, b, c = history(10_000, 10), history(20_000, 10), history(30_000, 10)
    for tokens in (a, b, a, c, b):
        assert serving.prefill([tokens + [1]])
        check(serving)
    before = streams.happens_before()
    copies = [(i, op.copy) for i, op in enumerate(streams.ops) if op.kind == "copy"]
    assert {record.kind for _, record in copies} == {"d2h", "h2d"}
    pairs = 0
    for i, record in copies:
        gpu = set((record.src_slots if record.kind == "d2h" else record.dst_slots).tolist())
        for f, slots in touched.items():
            if slots & gpu:
                pairs += 1
                assert before[f, i] if f < i else before[i, f], (f, i, record.kind)
    assert pairs > len(copies)


def test_the_cpu_tier_is_one_host_allocation_of_the_size_the_start_up_checked(caplog):
    """Per-layer buffers are slices of one allocation of exactly rows x the device pool's bytes per
    token, the figure the start-up check compared with free memory and the log line shows (torch's
    pinned allocator would have rounded each buffer up to a power of two)."""
    import logging

    from penelope.integration.sglang.host_tier import host_buffers, kv_bytes_per_token

    with caplog.at_level(logging.INFO, logger="penelope.integration.sglang.host_tier"):
        serving = Serving(size=64 * 16, page_size=64, cpu_cache=64 * 16 + 64 * 3)
    host = serving.cache.host_kv.host
    rows = serving.cache.cache.host_rows
    storage = host[0].untyped_storage()
    assert all(buffer.untyped_storage().data_ptr() == storage.data_ptr() for buffer in host)
    assert storage.nbytes() == rows * kv_bytes_per_token(serving.kv_pool) == sum(b.nbytes for b in host)
    assert f"penelope: CPU tier of {rows:,} rows (swap buffer included): {rows * 16 / 1024:.1f} KiB of host " \
           "memory (not pinned: no GPU)" in caplog.text
    # What a GPU machine pins: each buffer once, together exactly the one allocation.
    registered = []
    buffers = host_buffers(6, 1000, (2, 8), torch.bfloat16, register=registered.append)
    assert [b.data_ptr() for b in registered] == [b.data_ptr() for b in buffers]
    assert [b.data_ptr() - buffers[0].data_ptr() for b in buffers] == [i * 1000 * 2 * 8 * 2 for i in range(6)]
    assert buffers[0].untyped_storage().nbytes() == sum(b.nbytes for b in registered) == 6 * 1000 * 2 * 8 * 2
