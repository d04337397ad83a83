"""The pieces of the GPU script's stages that a CPU can check: the JSON-lines helper, the import of
the working tree by its package-dir mapping, the copy/compute overlap measurement, the decode grid's
order and the calibration built from points."""

import importlib
import json
import math
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "microbench"))

import overlap  # noqa: E402
from gpu_stages import calibration, decode, phantom, source_tree  # noqa: E402
from gpu_stages.context import PASSED, StageContext  # noqa: E402
from gpu_stages.points import PointLog, read_points  # noqa: E402

from penelope.sim.timemodel import TimeModel  # noqa: E402


def test_points_are_appended_one_line_each_and_read_back(tmp_path):
    path = tmp_path / "points.jsonl"
    first = PointLog(path, "swap")
    first.write("copy", gb_per_s=np.float32(12.5), shape=torch.Size([2, 3]), dtype=torch.bfloat16)
    PointLog(path, "decode").write("step", seconds=float("nan"), times=[1.0, float("inf")])
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(line) for line in lines)
    copy, step = read_points(path)
    assert copy["stage"] == "swap" and copy["kind"] == "copy" and copy["gb_per_s"] == 12.5
    assert copy["shape"] == [2, 3] and copy["dtype"] == "torch.bfloat16" and copy["at_s"] >= 0
    # Not JSON: written as null.
    assert step["seconds"] is None and step["times"] == [1.0, None]
    assert read_points(path, stage="decode") == [step] and read_points(path, kind="copy") == [copy]
    assert read_points(tmp_path / "missing.jsonl") == []


def test_a_line_cut_by_a_kill_is_skipped(tmp_path):
    path = tmp_path / "points.jsonl"
    PointLog(path, "attention").write("speed", tflops=400.0)
    with path.open("a") as handle:
        handle.write('{"stage": "attention", "kind": "spe')
    assert [p["tflops"] for p in read_points(path)] == [400.0]


def test_arrays_and_tensors_of_several_values_are_written_as_lists(tmp_path):
    path = tmp_path / "points.jsonl"
    PointLog(path, "attention").write("speed", times=np.array([1.5, 2.5]), grid=torch.tensor([[1, 2], [3, 4]]),
                                      one=torch.tensor(7), scalar=np.int64(3))
    point = read_points(path)[0]
    assert point["times"] == [1.5, 2.5] and point["grid"] == [[1, 2], [3, 4]]
    assert point["one"] == 7 and point["scalar"] == 3


def test_a_point_written_after_a_cut_line_starts_on_its_own_line(tmp_path):
    # A stage killed mid-write leaves a line without its newline; the next stage's point must not join it.
    path = tmp_path / "points.jsonl"
    PointLog(path, "attention").write("speed", tflops=400.0)
    with path.open("a") as handle:
        handle.write('{"stage": "attention", "kind": "spe')
    PointLog(path, "runner").write("status", status="TIMED OUT")
    assert [p["kind"] for p in read_points(path)] == ["speed", "status"]
    assert path.read_text().endswith("\n")


def test_the_working_tree_is_imported_through_its_package_dir_mapping(tmp_path, monkeypatch):
    # A project laid out as Penelope's: package `demo_pkg`, its subpackage `demo_pkg.kernels` in `kernels/`.
    (tmp_path / "demo_pkg").mkdir()
    (tmp_path / "demo_pkg" / "__init__.py").write_text("WHERE = 'top'\n")
    (tmp_path / "kernels" / "inner").mkdir(parents=True)
    (tmp_path / "kernels" / "__init__.py").write_text("WHERE = 'kernels folder'\n")
    (tmp_path / "kernels" / "inner" / "__init__.py").write_text("")
    (tmp_path / "kernels" / "inner" / "op.py").write_text("VALUE = 42\n")
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackage-dir = {"demo_pkg" = "demo_pkg", "demo_pkg.kernels" = "kernels"}\n')
    assert source_tree.package_dirs(tmp_path / "pyproject.toml") == {
        "demo_pkg": tmp_path / "demo_pkg", "demo_pkg.kernels": tmp_path / "kernels"}
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    for name in [n for n in sys.modules if n.startswith("demo_pkg")]:
        monkeypatch.delitem(sys.modules, name)
    source_tree.use_source_tree(tmp_path / "pyproject.toml")
    try:
        import demo_pkg.kernels.inner.op as op

        assert op.VALUE == 42 and sys.modules["demo_pkg.kernels"].WHERE == "kernels folder"
    finally:
        for name in [n for n in sys.modules if n.startswith("demo_pkg")]:
            del sys.modules[name]


def test_penelope_s_own_mapping_covers_its_folders():
    mapping = source_tree.package_dirs()
    assert mapping["penelope.kernels"] == REPO / "kernels"
    assert mapping["penelope.integration"] == REPO / "integration"
    assert all((folder / "__init__.py").exists() for folder in mapping.values())


def _sleeper(seconds, lock=None):
    def run():
        if lock is None:
            time.sleep(seconds)
            return
        with lock:
            time.sleep(seconds)

    return run


def test_overlap_of_work_beside_the_main_stream_is_measured():
    side = overlap.SideStream(torch.device("cpu"))
    figures = overlap.measure_overlap(_sleeper(0.1), lambda: side.start(_sleeper(0.1)), torch.device("cpu"), rounds=3)
    assert figures["compute_s"] == pytest.approx(0.1, abs=0.05) and figures["copy_s"] == pytest.approx(0.1, abs=0.05)
    assert figures["both_s"] < 0.16 and figures["overlap_fraction"] > 0.6


def test_work_that_cannot_overlap_shows_none():
    # Both hold one lock: the copy waits for the compute, as a copy ordered after it would.
    lock = threading.Lock()
    side = overlap.SideStream(torch.device("cpu"))
    figures = overlap.measure_overlap(_sleeper(0.1, lock), lambda: side.start(_sleeper(0.1, lock)),
                                      torch.device("cpu"), rounds=3)
    assert figures["both_s"] > 0.18 and abs(figures["overlap_fraction"]) < 0.3


def test_overlap_figures():
    assert overlap.overlap_figures(2.0, 1.0, 2.0)["overlap_fraction"] == 1.0
    assert overlap.overlap_figures(2.0, 1.0, 3.0)["overlap_fraction"] == 0.0
    assert overlap.overlap_figures(2.0, 1.0, 2.5)["hidden_s"] == 0.5


def test_the_decode_grid_starts_with_its_corners():
    points = decode.value_order((1, 4, 8), (1024, 2048, 131072))
    assert points[:5] == [(1, 1024), (1, 131072), (8, 1024), (8, 131072), (4, 131072)]
    assert sorted(points) == sorted((b, n) for b in (1, 4, 8) for n in (1024, 2048, 131072))


def _context(gpu_context, front, tail, pairs_front, pairs_tail, tokens, **new_tokens):
    return {"stage": "cost_curve", "kind": "context", "model": "qwen3-8b", "c_lin": 23552.0,
            "gpu_context": gpu_context, "context": gpu_context, "query_tokens": tokens, "front_seconds": front,
            "tail_seconds": tail, "front_attention_pairs": pairs_front, "tail_attention_pairs": pairs_tail,
            "prefill_seconds": None, "history_attention_pairs": None, "append": 512, **new_tokens}


def test_the_first_context_alone_gives_the_three_prefill_constants():
    """Its front and tail requests have the same tokens; the new tokens timed alone tell the
    batch's overhead from its per-token cost."""
    overhead, per_unit, per_pair = 3e-3, 2e-13, 3e-13
    tokens, context = int(0.3 * 8192) + 512, 8192

    def seconds(units_tokens, pairs):
        return overhead + per_unit * 23552 * units_tokens + per_pair * pairs

    pairs = {"front": tokens * (2048 + tokens // 2), "tail": tokens * context, "new": 512 * (context + 256)}
    row = _context(context, seconds(tokens, pairs["front"]), seconds(tokens, pairs["tail"]), pairs["front"],
                   pairs["tail"], tokens, new_tokens_seconds=seconds(512, pairs["new"]),
                   new_tokens_attention_pairs=pairs["new"])
    values, origin, dropped = calibration.build([row])
    assert values["batch_overhead"] == pytest.approx(overhead, rel=1e-6)
    assert values["sec_per_linear_unit"] == pytest.approx(per_unit, rel=1e-6)
    assert values["sec_per_attention_pair"] == pytest.approx(per_pair, rel=1e-6)


def synthetic_points():
    """Points of a run whose times follow known constants."""
    overhead, per_unit, per_pair = 3e-3, 2e-13, 3e-13
    points = [{"stage": "environment", "kind": "environment", "commit": None, "tree_fingerprint": "ab" * 20},
              {"stage": "environment", "kind": "device", "cuda_device": {"name": "NVIDIA H200"}}]
    for context in (8192, 131072, 32768):
        tokens = int(0.3 * context) + 512
        pairs_front, pairs_tail = tokens * (2048 + tokens // 2), tokens * context
        seconds = [overhead + per_unit * 23552 * tokens + per_pair * pairs for pairs in (pairs_front, pairs_tail)]
        points.append(_context(context, *seconds, pairs_front, pairs_tail, tokens))
    read = {"weight_bytes": 15e9, "embedding_row_bytes": 8192.0, "kv_bytes_per_token": 147456.0}
    for batch, context in ((1, 1024), (1, 131072), (8, 1024)):
        kv = batch * (context + 1)
        seconds = 4e-4 + (read["weight_bytes"] + 8192 * batch + 147456 * kv) / 3.5e12
        points.append({"stage": "decode", "kind": "step", "model": "qwen3-8b", "batch": batch, "context": context,
                       "kv_tokens": kv, "seconds": seconds, **read})
    for provider, rate in (("triton", 40.0), ("memcpy_blocks", 30.0), ("memcpy_contiguous", 55.0)):
        points.append({"stage": "swap", "kind": "copy", "direction": "h2d", "provider": provider, "gb_per_s": rate})
    points.append({"stage": "swap", "kind": "copy", "direction": "d2h", "provider": "triton", "gb_per_s": 90.0})
    for provider, seconds, matches in (("penelope", 3.0, None), ("sdpa_flash", 2.0, True),
                                       ("sdpa_cudnn", 1.5, False)):
        points.append({"stage": "attention", "kind": "speed", "layout": "front", "context": 32768,
                       "provider": provider, "seconds": seconds, "matches_ours": matches})
    return points


def test_the_calibration_is_built_from_the_points_of_every_stage():
    values, origin, dropped = calibration.build(synthetic_points())
    assert values["model"] == "qwen3-8b" and dropped == {}
    assert values["batch_overhead"] == pytest.approx(3e-3, rel=1e-6)
    assert values["sec_per_linear_unit"] == pytest.approx(2e-13, rel=1e-6)
    assert values["sec_per_attention_pair"] == pytest.approx(3e-13, rel=1e-6)
    assert values["decode_overhead"] == pytest.approx(4e-4, rel=1e-6)
    assert values["hbm_bandwidth"] == pytest.approx(3.5e12, rel=1e-6)
    # The faster of the executor's two ways for scattered blocks, host to device; not the contiguous peak.
    assert values["load_bandwidth"] == 40e9
    # cuDNN did not match ours: the ratio is against flash only.
    assert values["triton_pair_ratio"] == 1.5
    assert origin["load_bandwidth"] == "swap" and origin["decode_overhead"] == "decode"


def test_a_value_outside_the_time_model_s_range_is_left_out_and_named():
    points = [p for p in synthetic_points() if p["stage"] != "attention"]
    points.append({"stage": "attention", "kind": "speed", "layout": "front", "context": 256, "provider": "penelope",
                   "seconds": 5000.0})
    points.append({"stage": "attention", "kind": "speed", "layout": "front", "context": 256, "provider": "sdpa_math",
                   "seconds": 1.0, "matches_ours": True})
    values, origin, dropped = calibration.build(points)
    assert "triton_pair_ratio" not in values and "outside" in dropped["triton_pair_ratio"]


def test_the_calibration_stage_writes_a_file_the_simulator_reads(tmp_path):
    from gpu_stages.context import PASSED, StageContext

    path = tmp_path / "points.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in synthetic_points()))
    ctx = StageContext(PointLog(path, "calibration"), tmp_path, full=True, deadline=math.inf)
    assert calibration.run(ctx) == PASSED
    data = json.loads((tmp_path / "calibration_gpu.json").read_text())
    assert data["gpu"] == "h200" and data["model"] == "qwen3-8b"
    assert "at tree abababababab" in data["source"] and "simulator estimates kept: expert_bytes" in data["source"]
    model = TimeModel.from_json(tmp_path / "calibration_gpu.json", model="qwen3-8b", gpu="h200")
    assert model.load_bandwidth == 40e9 and model.triton_pair_ratio == 1.5
    point = read_points(path, kind="calibration")[0]
    assert point["read_back"] is True and "expert_bytes" in point["estimates"]


def test_a_calibration_with_nothing_measured_fails_its_stage(tmp_path):
    from gpu_stages.context import CHECK_FAILED, StageContext

    ctx = StageContext(PointLog(tmp_path / "points.jsonl", "calibration"), tmp_path, full=False, deadline=math.inf)
    assert calibration.run(ctx) == CHECK_FAILED
    assert "measured nothing" in json.loads((tmp_path / "calibration_reduced.json").read_text())["source"]


class JumpingClock:
    """A stage's clock that jumps far past any deadline once the stage has measured its first point."""

    def __init__(self):
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


class JumpAfterFirstPoint(PointLog):
    """Once a point of a kind in ``measured`` is written, ``clock`` jumps to ``left`` seconds before
    ``deadline`` (default: far past it)."""

    def __init__(self, path, stage, clock, measured, deadline=0.0, left=-1e9):
        super().__init__(path, stage)
        self.clock, self.measured, self.deadline, self.left_after = clock, measured, deadline, left

    def write(self, kind, **fields):
        point = super().write(kind, **fields)
        if kind in self.measured and self.clock.offset == 0.0:
            self.clock.offset = self.deadline - self.left_after - time.monotonic()
        return point


# What each stage measures, by kind of point.
MEASURED = {"attention": ("check", "speed"), "cost_curve": ("context",), "swap": ("copy", "overlap", "pin"),
            "decode": ("step",), "phantom": ("phantom",)}


@pytest.mark.parametrize("name", ["attention", "cost_curve", "swap", "decode"])
def test_every_stage_checks_its_deadline_between_points(name, tmp_path, one_torch_thread):
    """Reduced shapes, in this process: once the first point is in, the deadline has passed, so every
    later point is skipped (and says so) instead of being measured past it."""
    clock, deadline = JumpingClock(), time.monotonic() + 3600
    log = JumpAfterFirstPoint(tmp_path / "points.jsonl", name, clock, MEASURED[name], deadline)
    ctx = StageContext(log, tmp_path, full=False, deadline=deadline, clock=clock)
    assert importlib.import_module(f"gpu_stages.{name}").run(ctx) == PASSED
    points = read_points(tmp_path / "points.jsonl")
    assert len([p for p in points if p["kind"] in MEASURED[name]]) == 1
    skipped = [p for p in points if p["kind"] == "skipped"]
    assert skipped and all(p["reason"] for p in skipped)


@pytest.mark.parametrize("name", sorted(MEASURED))
def test_a_stage_past_its_deadline_measures_nothing(name, tmp_path, one_torch_thread):
    ctx = StageContext(PointLog(tmp_path / "points.jsonl", name), tmp_path, full=False,
                       deadline=time.monotonic() - 1)
    began = time.monotonic()
    assert importlib.import_module(f"gpu_stages.{name}").run(ctx) == PASSED
    points = read_points(tmp_path / "points.jsonl")
    assert points and not [p for p in points if p["kind"] in MEASURED[name]]
    assert all(p["kind"] in ("skipped", "unavailable") for p in points)
    assert time.monotonic() - began < 60


def test_phantom_rounds_stop_at_the_first_that_does_not_fit(one_torch_thread):
    batching = phantom.PhantomBatching(phantom.REDUCED, phantom.REDUCED.contexts[0], torch.device("cpu"))
    asked = []

    def fits(seconds):
        asked.append(seconds)
        return len(asked) < 2

    figures = batching.compare(5, statistics.median, fits=fits)
    # Asked before each round, with the warm-up's seconds, then the last round's.
    assert len(asked) == 2 and all(seconds > 0 for seconds in asked)
    assert len(figures["one_batch_rounds_s"]) == len(figures["two_batches_rounds_s"]) == 1


def test_the_cost_curve_draws_its_plot_only_with_time_left_for_it(tmp_path, one_torch_thread):
    """Measuring stops early enough for the summary and the plot; without the time for a plot, the
    summary is written and the plot skipped, so the stage ends before its deadline."""
    from gpu_stages import cost_curve

    clock, deadline = JumpingClock(), time.monotonic() + 3600
    log = JumpAfterFirstPoint(tmp_path / "points.jsonl", "cost_curve", clock, ("context",), deadline,
                              left=cost_curve.PLOT_SECONDS / 2)
    ctx = StageContext(log, tmp_path, full=False, deadline=deadline, clock=clock)
    assert cost_curve.run(ctx) == PASSED
    points = read_points(tmp_path / "points.jsonl")
    assert [p["kind"] for p in points if p["kind"] != "skipped"] == ["context", "summary"]
    assert [p["what"] for p in points if p["kind"] == "skipped"][-1] == "plot"
    assert not (tmp_path / "cost_curve.png").exists()


def test_the_next_batch_is_estimated_by_its_work_not_by_twice_the_last(tmp_path):
    from gpu_stages import attention
    from gpu_stages.context import Pace

    shape = attention.QWEN3_8B
    before, after = attention.batch_work(32 * 1024, "tail", shape), attention.batch_work(128 * 1024, "front", shape)
    # The 128K hole alone is 39K tokens: 3.2 times the causal work of the 32K tail before it.
    assert after / before == pytest.approx(3.17, abs=0.01)
    clock = JumpingClock()
    ctx = StageContext(PointLog(tmp_path / "points.jsonl", "attention"), tmp_path, full=True,
                       deadline=clock() + 35, clock=clock)
    pace = Pace(ctx)
    assert pace.has_time(before, what="timed batch")
    clock.offset += 10  # the 32K batch took 10 s: 25 s left, more than twice that
    pace.done()
    assert not pace.has_time(after, what="timed batch", context=128 * 1024)
    skipped = read_points(tmp_path / "points.jsonl", kind="skipped")[0]
    assert skipped["context"] == 128 * 1024 and skipped["reason"].startswith("about 31.7 s needed")


def test_a_copy_inside_another_repository_records_no_commit(tmp_path, monkeypatch):
    """A tree without .git unpacked inside some other git checkout: that checkout's commit is not
    this tree's (the fingerprint identifies it instead)."""
    import subprocess

    import machine

    outer = tmp_path / "outer"
    (outer / "copy").mkdir(parents=True)
    git = ["git", "-C", str(outer), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "outer"], check=True)
    monkeypatch.setattr(machine, "REPO", outer / "copy")
    assert machine.git("rev-parse", "HEAD") is None
    monkeypatch.setattr(machine, "REPO", outer)
    assert len(machine.git("rev-parse", "HEAD")) == 40
