"""The CPU-checkable parts of the GPU benchmark run (microbench/run_gpu.py and run_gpu.sh): argument
handling, per-step budgets, merging, and the exit status (a run that measured nothing fails)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "microbench"))

import run_gpu  # noqa: E402


def test_steps_start_with_the_cost_curve_and_can_be_filtered():
    names = run_gpu.steps()
    assert names[0] == "bench_cost_curve" and "bench_ragged_attention" in names and "bench_kv_swap" in names
    assert run_gpu.steps(["bench_kv_swap", "bench_cost_curve"]) == ["bench_cost_curve", "bench_kv_swap"]
    with pytest.raises(ValueError, match="unknown step"):
        run_gpu.steps(["bench_nothing"])


def test_each_step_gets_its_own_limit_within_what_is_left():
    assert run_gpu.step_limit("bench_cost_curve", 1000) == 290
    assert run_gpu.step_limit("bench_kv_swap", 1000) == run_gpu.DEFAULT_LIMIT
    assert run_gpu.step_limit("bench_cost_curve", 100.7) == 100


@pytest.mark.parametrize(("code", "benchmarks", "status"), [
    (0, 3, run_gpu.OK), (0, 0, run_gpu.NO_GPU_BENCHMARK), (5, 0, run_gpu.NO_GPU_BENCHMARK),
    (124, 2, run_gpu.TIMED_OUT), (-9, 0, run_gpu.TIMED_OUT), (1, 2, run_gpu.FAILED), (2, 0, run_gpu.FAILED),
])
def test_step_status(code, benchmarks, status):
    assert run_gpu.step_status(code, benchmarks) == status


def result(status, benchmarks=0):
    return run_gpu.StepResult("bench_x", status, 1.0, benchmarks)


def test_exit_status_fails_a_run_that_measured_nothing():
    assert run_gpu.exit_status([], gpu=False) == 3
    assert run_gpu.exit_status([result(run_gpu.OK, 4), result(run_gpu.NO_GPU_BENCHMARK)], gpu=True) == 0
    assert run_gpu.exit_status([result(run_gpu.NO_GPU_BENCHMARK), result(run_gpu.NO_GPU_BENCHMARK)], gpu=True) == 2
    assert run_gpu.exit_status([result(run_gpu.OK, 4), result(run_gpu.TIMED_OUT, 1)], gpu=True) == 1
    assert run_gpu.exit_status([result(run_gpu.OK, 4), result(run_gpu.SKIPPED)], gpu=True) == 1
    assert run_gpu.exit_status([result(run_gpu.FAILED, 4)], gpu=True) == 1


def test_merge_keeps_every_result(tmp_path):
    for name, count in (("a", 2), ("b", 3)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"benchmarks": [{"fullname": f"{name}{i}"}
                                                                         for i in range(count)]}))
    (tmp_path / "broken.json").write_text("{")
    paths = [tmp_path / "a.json", tmp_path / "missing.json", tmp_path / "broken.json", tmp_path / "b.json"]
    assert run_gpu.merge(paths, tmp_path / "all.json") == 5
    assert run_gpu.count_benchmarks(tmp_path / "all.json") == 5
    assert run_gpu.count_benchmarks(tmp_path / "missing.json") == 0
    assert run_gpu.merge([tmp_path / "missing.json"], tmp_path / "none.json") == 0


@pytest.mark.parametrize("argv", [["--budget", "5"], ["--only", "bench_nothing"], ["--budget", "many"]])
def test_bad_arguments_exit_4(argv, tmp_path):
    assert run_gpu.main([*argv, "--out", str(tmp_path)]) == 4


def test_dry_run_lists_steps_and_limits(capsys):
    assert run_gpu.main(["--dry-run", "--budget", "200"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "gpu_check: limit 60 s" and "bench_cost_curve: limit 200 s" in lines


class FakeSteps:
    """Stands in for the subprocesses: the CUDA check, then each step writes ``results[name]``
    benchmarks and returns ``codes[name]`` after ``seconds[name]`` of a fake clock."""

    def __init__(self, gpu=True, results=None, codes=None, seconds=None):
        self.gpu, self.results, self.codes, self.seconds = gpu, results or {}, codes or {}, seconds or {}
        self.now = 0.0
        self.ran = []

    def monotonic(self):
        return self.now

    def run_limited(self, command, limit, log):
        if "-c" in command:
            return 0 if self.gpu else 1
        if "microbench/compare.py" in command:
            self.ran.append(("compare", limit))
            return 2
        name = Path(command[command.index("pytest") + 1]).stem
        self.ran.append((name, limit))
        self.now += min(self.seconds.get(name, 1.0), limit)
        json_path = Path(command[command.index("--benchmark-json") + 1])
        count = self.results.get(name, 0)
        json_path.write_text(json.dumps({"benchmarks": [{"fullname": f"{name}::{i}", "extra_info": {}}
                                                        for i in range(count)]}))
        return self.codes.get(name, 0 if count else 5)


def run_fake(monkeypatch, tmp_path, fake, *argv):
    monkeypatch.setattr(run_gpu, "run_limited", fake.run_limited)
    monkeypatch.setattr(run_gpu.time, "monotonic", fake.monotonic)
    return run_gpu.main(["--out", str(tmp_path), "--only", "bench_cost_curve", "bench_kv_swap",
                         "bench_ragged_attention", *argv])


def test_a_run_with_gpu_results_passes_and_merges_them(monkeypatch, tmp_path):
    fake = FakeSteps(results={"bench_cost_curve": 2, "bench_ragged_attention": 3})
    assert run_fake(monkeypatch, tmp_path, fake) == 0
    assert run_gpu.count_benchmarks(tmp_path / "benchmarks.json") == 5
    assert not list(tmp_path.glob(".bench_*.json"))
    log = (tmp_path / "run_gpu.log").read_text()
    assert "bench_kv_swap: no GPU benchmark" in log and "no baseline of this machine kind" in log
    assert fake.ran[-1] == ("compare", 60)


def test_a_run_where_every_step_skipped_its_gpu_benchmarks_fails(monkeypatch, tmp_path):
    assert run_fake(monkeypatch, tmp_path, FakeSteps()) == 2


def test_no_cuda_exits_3_before_any_step(monkeypatch, tmp_path):
    fake = FakeSteps(gpu=False, results={"bench_cost_curve": 2})
    assert run_fake(monkeypatch, tmp_path, fake) == 3 and fake.ran == []


def test_budgets_limit_each_step_and_skip_what_no_longer_fits(monkeypatch, tmp_path):
    fake = FakeSteps(results={"bench_cost_curve": 1, "bench_kv_swap": 1, "bench_ragged_attention": 1},
                     seconds={"bench_cost_curve": 500}, codes={"bench_cost_curve": 124})
    assert run_fake(monkeypatch, tmp_path, fake, "--budget", "300") == 1
    # The cost curve got its own 290 s, the next step the 10 s left: too few to start.
    assert fake.ran == [("bench_cost_curve", 290), ("compare", 60)]
    log = (tmp_path / "run_gpu.log").read_text()
    assert "bench_cost_curve: TIMED OUT" in log and "bench_kv_swap: SKIPPED" in log


def test_run_limited_kills_the_whole_process_group(tmp_path):
    script = "import subprocess, time; p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True); time.sleep(60)"
    lines = []
    began = time.monotonic()
    assert run_gpu.run_limited([sys.executable, "-c", script], 2, lines.append) == 124
    assert time.monotonic() - began < 30
    grandchild = int(lines[0].split()[0])
    time.sleep(0.5)
    # Killed: gone, or a zombie waiting for its new parent to reap it.
    status = Path(f"/proc/{grandchild}/status")
    assert not status.exists() or "State:\tZ" in status.read_text()


def test_the_script_on_a_machine_without_a_gpu_exits_3(tmp_path):
    env = dict(os.environ, PENELOPE_SKIP_INSTALL="1", PYTHON=sys.executable)
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(["bash", "microbench/run_gpu.sh", "--out", str(tmp_path), "--budget", "120"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "no usable CUDA GPU" in (tmp_path / "run_gpu.log").read_text()
    done = subprocess.run(["bash", "microbench/run_gpu.sh", "--budget", "5"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 4 and "--budget must be at least" in done.stderr
