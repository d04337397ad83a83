"""The per-batch plans of the ragged kernel and of the KV store: made from host-side lists, no host
synchronisation in a layer, no work over the whole req_to_token table, a stale plan refused.

"Host synchronisation" is checked by counting calls that read a tensor's values back to the host
(``item``, ``tolist``, ``cpu``, ``numpy``, ``__bool__``, ``__int__``, ``__float__``, ``__index__``,
``nonzero``, ``unique``) made by Penelope's own code (Triton's interpreter, which stands in for the
GPU here, reads its arguments too and is not counted). On a GPU each of them would stall the host.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from kernel_helpers import PHANTOM_BATCH, make_batch, plan_for, run_kernel  # noqa: E402

from penelope.engine.attention import AttentionBackend, get_attention_backend  # noqa: E402
from penelope.engine.decoder import EngineBatch, Qwen3Decoder  # noqa: E402
from penelope.engine.decoder_config import BUILTIN_ENGINE_CONFIGS  # noqa: E402
from penelope.engine.kvpool import KVPool  # noqa: E402
from penelope.engine.weights import random_weights  # noqa: E402
from penelope.kernels.ragged_attention import (  # noqa: E402
    plan_ragged_prefill,
    plan_store_kv,
    ragged_prefill_attention,
    store_kv,
    warm_up_ragged_attention,
)

REPO = Path(__file__).resolve().parents[2]
OURS = tuple(str(REPO / folder) for folder in ("kernels", "penelope", "integration"))
READBACKS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero", "unique")


class ReadbackCounter:
    """Counts read-backs of tensor values made by Penelope's code while ``active``."""

    def __init__(self, monkeypatch):
        self.active = False
        self.calls: list[str] = []
        for name in READBACKS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, original))
        monkeypatch.setattr(torch, "unique", self._wrap("torch.unique", torch.unique))

    def _wrap(self, name, original):
        def counted(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if self.active and caller.startswith(OURS):
                self.calls.append(f"{name} from {Path(caller).name}:{sys._getframe(1).f_lineno}")
            return original(*args, **kwargs)

        return counted

    def __enter__(self):
        self.active = True
        return self

    def __exit__(self, *exc):
        self.active = False


def counting_backend(counter, backend):
    """``backend`` whose per-layer calls (store and attend) are counted."""

    def store(*args, **kwargs):
        with counter:
            backend.store_kv(*args, **kwargs)

    def attend(*args, **kwargs):
        with counter:
            return backend.attend(*args, **kwargs)

    return AttentionBackend(f"counted-{backend.name}", store, attend, backend.plan, backend.plan_store)


def two_segment_batch(tokens):
    """48 tokens prefilled as two segments listed out of order, into scattered slots."""
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(2))[:48]
    batch_tokens = torch.cat((tokens[24:48], tokens[:24]))
    return EngineBatch.build(batch_tokens, slots[None].to(torch.int32), [[0, 0, 24, 24], [0, 24, 0, 24]])


def test_layers_read_nothing_back_from_the_device(monkeypatch):
    """Through a 3-layer engine forward on the "triton" backend: zero read-backs in every layer's
    store and attention. The same forward without the per-batch plans reads back in each layer."""
    counter = ReadbackCounter(monkeypatch)
    config = BUILTIN_ENGINE_CONFIGS["tiny-untied"]
    weights = random_weights(config, seed=3)
    tokens = torch.randint(0, config.vocab_size, (48,), generator=torch.Generator().manual_seed(3))
    triton = get_attention_backend("triton")
    planned = counting_backend(counter, triton)
    unplanned = counting_backend(counter, AttentionBackend("unplanned", triton.store_kv, triton.attend))
    logits = {}
    for backend in (planned, unplanned):
        counter.calls.clear()
        pool = KVPool(config, 64)
        pool.fill_(float("nan"))
        logits[backend.name] = Qwen3Decoder(config, weights, attention=backend)(
            two_segment_batch(tokens), pool)
        if backend is planned:
            assert counter.calls == []
        else:
            # The control: the counter sees the checks an unplanned layer makes.
            assert len(counter.calls) >= config.num_layers, counter.calls
    assert torch.isfinite(logits["counted-triton"]).all()
    assert torch.equal(logits["counted-triton"], logits["counted-unplanned"])


def test_planning_from_host_lists_reads_nothing_back(monkeypatch):
    counter = ReadbackCounter(monkeypatch)
    batch = make_batch(PHANTOM_BATCH, 8, 2, 64, torch.float32, seed=61, order_seed=2)
    host_segments = batch["segments"].numpy().copy()
    slots = np.concatenate([batch["req_to_token"][row, pos: pos + n].numpy()
                            for row, _, pos, n in host_segments.tolist()])
    with counter:
        plan = plan_ragged_prefill(batch["req_to_token"], host_segments, num_tokens=batch["q"].shape[0],
                                   num_slots=batch["k_buffer"].shape[0], num_q_heads=8, num_kv_heads=2,
                                   head_dim=64, check=False)
        store_plan = plan_store_kv(slots, batch["k_buffer"].shape[0], "cpu")
    assert counter.calls == []
    plan.check()
    assert store_plan.slots.dtype == torch.int64 and torch.equal(store_plan.slots, torch.from_numpy(slots))


@pytest.mark.parametrize("form", ["numpy", "list", "cpu tensor"])
def test_host_side_segments_give_bitwise_the_same_results(form):
    batch = make_batch(PHANTOM_BATCH, 8, 2, 64, torch.float16, seed=62, order_seed=3)
    expected = run_kernel(batch)
    segments = {"numpy": batch["segments"].numpy().astype(np.int64), "list": batch["segments"].tolist(),
                "cpu tensor": batch["segments"].clone()}[form]
    host = dict(batch, segments=segments)
    got = run_kernel(host, plan=plan_for(host))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_planning_reads_only_the_batch_rows_of_a_huge_table():
    """SGLang's table has a row per request slot (thousands) and a column per position (up to the
    context length): a plan must not touch it as a whole. This table has 10^6 rows of 10^6 slots
    (4 TB if it were materialised: any whole-table operation would fail); all rows alias one row."""
    batch = make_batch([(200, [(0, 40), (150, 50)])], 4, 2, 64, torch.float32, seed=63)
    row = torch.zeros(1, 1_000_000, dtype=torch.int32)
    row[0, :200] = batch["req_to_token"][0, :200]
    huge = row.expand(1_000_000, 1_000_000)
    segments = np.array([[999_999, 0, 0, 40], [999_999, 40, 150, 50]])
    plan = plan_ragged_prefill(huge, segments, num_tokens=90, num_slots=batch["k_buffer"].shape[0],
                               num_q_heads=4, num_kv_heads=2, head_dim=64)
    assert plan.rows.tolist() == [[999_999, 200, 0]]
    out = ragged_prefill_attention(batch["q"], batch["k_buffer"], batch["v_buffer"], huge, segments, plan=plan)
    expected = ragged_prefill_attention(**batch)
    assert torch.equal(out, expected)


def test_a_plan_is_refused_after_its_table_was_written():
    """The probe: plan a batch, then point one of its slots past the pool in place, and reuse the
    plan. The kernel would read past the pool; the call refuses instead, naming the write."""
    batch = make_batch([(96, [(0, 20), (40, 20)])], 4, 2, 64, torch.float32)
    plan = plan_for(batch)
    run_kernel(batch, plan=plan)
    batch["req_to_token"][0, 5] = 10**9
    with pytest.raises(ValueError, match=r"req_to_token was written in place after the plan checked it"):
        run_kernel(batch, plan=plan)
    with pytest.raises(ValueError, match=r"req_to_token\[0, 5\] = 1000000000 is outside the pool"):
        run_kernel(batch, plan=plan_for(batch))


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
def test_a_failed_slot_check_is_reported_later_and_the_kernel_reads_nothing():
    """With check=False (the GPU default) a bad slot does not raise while planning; the layers'
    launches visit no KV tile (NaN rows, no read past the pool) and poll()/check() raise."""
    batch = make_batch([(96, [(0, 20), (40, 20)])], 4, 2, 64, torch.float32)
    batch["req_to_token"][0, 33] = -4
    plan = plan_ragged_prefill(batch["req_to_token"], batch["segments"], num_tokens=40, num_slots=125,
                               num_q_heads=4, num_kv_heads=2, head_dim=64, check=False)
    out, lse = run_kernel(batch, plan=plan)
    assert out.isnan().all() and (lse == float("-inf")).all()
    with pytest.raises(ValueError, match=r"req_to_token\[0, 33\] = -4"):
        plan.poll()
    with pytest.raises(ValueError, match=r"req_to_token\[0, 33\] = -4"):
        plan.check()
    batch["req_to_token"][0, 33] = 0
    good = plan_ragged_prefill(batch["req_to_token"], batch["segments"], num_tokens=40, num_slots=125,
                               num_q_heads=4, num_kv_heads=2, head_dim=64, check=False)
    assert good.poll() is True


@pytest.mark.parametrize("row, pos", [(0, 59), (0, 0), (1, 127)])
def test_the_slot_check_covers_exactly_the_positions_queries_read(row, pos):
    """Row 0 reads positions 0..59 (segments end at 20 and 60), row 1 reads 0..127: a bad slot at
    the first or last read position is caught; one position further is never read."""
    batch = make_batch([(96, [(0, 20), (40, 20)]), (128, [(100, 28)])], 4, 2, 64, torch.float32)
    batch["req_to_token"][row, pos + 1] = 10**6
    if pos + 1 < batch["req_to_token"].shape[1] and (row, pos) != (0, 0):
        plan_for(batch).check()
    batch["req_to_token"][row, pos] = 10**6
    with pytest.raises(ValueError, match=rf"req_to_token\[{row}, {pos}\] = 1000000 is outside"):
        plan_for(batch)


def test_store_plan_checks_once_and_stores_bit_exactly():
    gen = torch.Generator().manual_seed(64)
    k_buffer, v_buffer = torch.randn(50, 2, 8, generator=gen), torch.randn(50, 2, 8, generator=gen)
    expected_k, expected_v = k_buffer.clone(), v_buffer.clone()
    slots = np.array([7, 3, 49, 0, 21])
    k, v = torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 8, generator=gen)
    expected_k[slots], expected_v[slots] = k, v
    plan = plan_store_kv(slots, 50, "cpu")
    for impl in ("triton", "torch"):
        store_kv(k_buffer, v_buffer, plan.slots, k, v, impl=impl, plan=plan)
        assert torch.equal(k_buffer, expected_k) and torch.equal(v_buffer, expected_v)
    with pytest.raises(ValueError, match="pass plan.slots"):
        store_kv(k_buffer, v_buffer, plan.slots.clone(), k, v, plan=plan)
    with pytest.raises(ValueError, match="fewer than the 50"):
        store_kv(k_buffer[:40], v_buffer[:40], plan.slots, k, v, plan=plan)


@pytest.mark.parametrize(("slots", "message"), [
    ([0, 1, 1], "duplicates"), ([0, 50], r"\[0, 50\)"), ([-1], r"\[0, 50\)"), ([[0, 1]], "1-D"),
    (np.array([0.5]), "integers"),
])
def test_store_plan_validation(slots, message):
    with pytest.raises(ValueError, match=message):
        plan_store_kv(slots, 50, "cpu")


def test_warm_up_validates_and_needs_no_compile_under_the_interpreter():
    k_buffer = torch.zeros(64, 8, 128, dtype=torch.bfloat16)
    table = torch.zeros(4, 100, dtype=torch.int32)
    assert warm_up_ragged_attention(k_buffer, table, num_q_heads=40) is None
    with pytest.raises(ValueError, match="multiple of kv heads"):
        warm_up_ragged_attention(k_buffer, table, num_q_heads=12)
    with pytest.raises(ValueError, match="req_to_token must be int32"):
        warm_up_ragged_attention(k_buffer, table.long(), num_q_heads=32)


_UNSEEN_WRITE = """
import sys
sys.path[:0] = [{tests!r}, {root!r}]
import torch
from kernel_helpers import make_batch, plan_for, run_kernel
batch = make_batch([(96, [(0, 20), (40, 20)])], 4, 2, 64, torch.float32)
plan = plan_for(batch)
table = batch["req_to_token"]
version = table._version
table.{how}[0, 5] = 10**9
assert table._version == version, "torch saw the write: this test needs one it does not see"
out = run_kernel(batch, plan=plan)
out = out[0] if isinstance(out, tuple) else out
print("finite" if bool(torch.isfinite(out).all()) else "not finite")
"""


@pytest.mark.parametrize("how", ["numpy()", "data"])
def test_a_table_written_behind_torchs_back_never_reads_outside_the_pool(how):
    """The version check cannot see a write through `.numpy()` or `.data` (nor, on a GPU, one by
    another kernel): the slot read past the pool is clamped inside the kernel, so the call stays
    memory-safe (its numbers are then those of slot 0: the caller broke the plan's contract).
    In a child process, since the failure this guards against is a segfault."""
    import subprocess

    script = _UNSEEN_WRITE.format(tests=str(Path(__file__).parent.parent), root=str(Path(__file__).parents[2]),
                                  how=how)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "finite"
