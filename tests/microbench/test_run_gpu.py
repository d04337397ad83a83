"""The GPU script on a machine without a GPU (microbench/run_gpu.py, run_stage.py, run_gpu.sh): the
order and limits of its stages, points that survive a stage killed at its limit, the messages and
exit statuses, and one whole run with reduced shapes on the CPU (the code paths every stage uses)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "microbench"))

import run_gpu  # noqa: E402
from gpu_stages.points import POINTS_FILE, read_points  # noqa: E402
from stage_group import StopSignals  # noqa: E402

from penelope.cli import main as penelope_main  # noqa: E402
from penelope.engine.decoder_config import BUILTIN_ENGINE_CONFIGS  # noqa: E402

# Stages written for these tests, run by the real run_stage.py (found through PYTHONPATH).
FAKE_STAGES = {
    "fake_env": """
        def run(ctx):
            ctx.log.write("environment", cuda_available=False)
            return 0
    """,
    "fake_sleepy": """
        import subprocess, time

        def run(ctx):
            child = subprocess.Popen(["sleep", "120"])
            ctx.log.write("point", index=0, child=child.pid)
            ctx.log.write("point", index=1, left_s=ctx.left())
            time.sleep(120)
            ctx.log.write("point", index=2)
            return 0
    """,
    "fake_fails": """
        def run(ctx):
            ctx.log.write("point", index=0)
            raise RuntimeError("broken on purpose")
    """,
    "fake_slow_exit": """
        import atexit, time

        def run(ctx):
            ctx.log.write("point", index=0)
            # Work after the stage returned (an interpreter's teardown, a library's atexit hook).
            atexit.register(time.sleep, 120)
            return 0
    """,
    "fake_skips": """
        def run(ctx):
            ctx.log.write("point", index=0)
            for index in (1, 2):
                ctx.log.write("skipped", index=index, reason="no time")
            return 0
    """,
    "fake_calibration": """
        def run(ctx):
            ctx.log.write("calibration", stages_seen=sorted({p["stage"] for p in __import__(
                "gpu_stages.points", fromlist=["read_points"]).read_points(ctx.out / "points.jsonl")}))
            return 0
    """,
}


@pytest.fixture
def fake_stages(tmp_path, monkeypatch):
    """The runner's stage table replaced by the fake stages (modules in tmp_path/modules)."""
    modules = tmp_path / "modules"
    modules.mkdir()
    for name, source in FAKE_STAGES.items():
        (modules / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.setenv("PYTHONPATH", str(modules))

    def install(*stages, calibration_limit=10):
        monkeypatch.setattr(run_gpu, "STAGES", (run_gpu.Stage("environment", 10, "fake_env"), *stages))
        monkeypatch.setattr(run_gpu, "CALIBRATION", run_gpu.Stage("calibration", calibration_limit, "fake_calibration"))

    return install


def test_stages_run_in_order_of_value_between_environment_and_calibration():
    names = [stage.name for stage in run_gpu.plan()]
    assert names == ["environment", "attention", "cost_curve", "swap", "decode", "phantom", "calibration"]
    assert [s.name for s in run_gpu.plan(["decode", "attention"])] == ["environment", "attention", "decode",
                                                                        "calibration"]
    with pytest.raises(ValueError, match="unknown stage"):
        run_gpu.plan(["nothing"])


def test_each_stage_gets_its_own_limit_within_what_is_left():
    attention = run_gpu.STAGES[1]
    assert run_gpu.stage_limit(attention, 1000) == attention.limit
    # The calibration's reserve is kept back from every other stage.
    assert run_gpu.stage_limit(attention, 50.9) == int(50.9 - run_gpu.CALIBRATION.limit)
    assert run_gpu.stage_limit(run_gpu.CALIBRATION, 3) == run_gpu.MIN_STAGE
    # All of them fit the default budget: the whole run ends within 8 minutes.
    assert sum(stage.limit for stage in run_gpu.plan()) <= run_gpu.DEFAULT_BUDGET <= 480


def test_dry_run_lists_the_stages_and_their_limits(capsys):
    assert run_gpu.main(["--dry-run", "--budget", "200"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "environment: limit 30 s" and lines[-1].startswith("calibration: limit")
    # What a real run would do: 200 - 30 - 110 s leave 40 s for the cost curve, then under 10 s
    # after the calibration's reserve for each stage left: skipped, not run for 0 s.
    assert "cost_curve: limit 40 s" in lines
    assert [line for line in lines if "SKIPPED" in line] == [
        f"{name}: SKIPPED, 20 s left of the 200 s budget" for name in ("swap", "decode", "phantom")]


def test_total_budget_from_the_environment_is_checked_and_named(monkeypatch, capsys):
    monkeypatch.setenv("TOTAL_BUDGET", "abc")
    assert run_gpu.main(["--dry-run", "--budget", "100"]) == run_gpu.EXIT_OK
    capsys.readouterr()
    assert run_gpu.main(["--dry-run"]) == run_gpu.EXIT_BAD_ARGS
    assert capsys.readouterr().err.strip() == "run_gpu: error: TOTAL_BUDGET must be whole seconds, got 'abc'"
    monkeypatch.setenv("TOTAL_BUDGET", "120")
    assert run_gpu.main(["--dry-run"]) == run_gpu.EXIT_OK
    assert "budget" not in capsys.readouterr().err


def test_reduced_shapes_run_under_the_cpu_limits(capsys):
    """The CPU run (CI's) has its own limits, sized for interpreted kernels on a shared machine."""
    assert run_gpu.main(["--dry-run", "--shapes", "reduced"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"{stage.name}: limit {stage.reduced_limit} s" for stage in run_gpu.plan()]
    assert any(stage.reduced_limit != stage.limit for stage in run_gpu.plan())
    assert sum(stage.limit_for("reduced") for stage in run_gpu.plan()) <= run_gpu.DEFAULT_BUDGET


@pytest.mark.parametrize("argv", [["--budget", "5"], ["--only", "nothing"], ["--budget", "many"],
                                  ["--shapes", "huge"]])
def test_bad_arguments_exit_4(argv, tmp_path):
    assert run_gpu.main([*argv, "--out", str(tmp_path)]) == run_gpu.EXIT_BAD_ARGS


def test_a_missing_package_is_named_on_one_line_and_exits_5(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(run_gpu, "REQUIRED", ("numpy", "no_such_package_here", "torch"))
    assert run_gpu.missing() == ["no_such_package_here"]
    out = tmp_path / "out"
    assert run_gpu.main(["--out", str(out)]) == run_gpu.EXIT_MISSING
    message = capsys.readouterr().err.strip()
    assert "\n" not in message and "missing package(s): no_such_package_here" in message
    # The folder that comes back from the GPU machine says it too.
    assert message in (out / "run_gpu.log").read_text()
    [point] = read_points(out / POINTS_FILE)
    assert point["kind"] == "missing" and point["packages"] == ["no_such_package_here"]


@pytest.mark.parametrize("where", ["a_file", "a_file/sub", "points_is_a_folder"])
def test_an_output_folder_that_cannot_be_written_is_named_on_one_line_and_exits_4(tmp_path, capsys, where):
    (tmp_path / "a_file").write_text("not a folder")
    out = tmp_path / where
    if where == "points_is_a_folder":
        (out / POINTS_FILE).mkdir(parents=True)
    assert run_gpu.main(["--out", str(out), "--shapes", "reduced"]) == run_gpu.EXIT_BAD_ARGS
    message = capsys.readouterr().err.strip()
    assert "\n" not in message and message.startswith(f"run_gpu: error: cannot write the output folder {out}: ")


def test_a_run_clears_the_files_an_earlier_run_left_and_only_those(fake_stages, tmp_path):
    fake_stages(run_gpu.Stage("quick", 20, "fake_env"))
    out = tmp_path / "out"
    out.mkdir()
    old = ["cost_curve.png", "calibration_gpu.json", "calibration_reduced.json", POINTS_FILE, "run_gpu.log"]
    for name in [*old, "notes.txt"]:
        (out / name).write_text("an earlier run's\n")
    assert run_gpu.main(["--out", str(out), "--budget", "60", "--shapes", "reduced"]) == run_gpu.EXIT_OK
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", POINTS_FILE, "run_gpu.log"]
    assert "an earlier run's" not in (out / POINTS_FILE).read_text() + (out / "run_gpu.log").read_text()


@pytest.mark.parametrize(("statuses", "code"), [
    ([run_gpu.PASSED] * 3, 0), ([run_gpu.PASSED, run_gpu.FAILED], 1), ([run_gpu.PASSED, run_gpu.TIMED_OUT], 1),
    ([run_gpu.PASSED, run_gpu.SKIPPED], 1), ([run_gpu.NO_GPU_STATUS], 3), ([], 1),
])
def test_exit_status(statuses, code):
    assert run_gpu.exit_status(statuses) == code


def _gone(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    # Killed: gone, or a zombie waiting for its new parent to reap it.
    return not status.exists() or "State:\tZ" in status.read_text()


def test_a_stage_killed_at_its_limit_keeps_its_points_and_its_children_die(fake_stages, tmp_path):
    with (tmp_path / "log").open("w") as log:
        began = time.monotonic()
        status, code = run_gpu.run_stage(run_gpu.Stage("sleepy", 6, "fake_sleepy"), 6, tmp_path, "reduced", log,
                                          StopSignals())
    assert (status, code) == (run_gpu.TIMED_OUT, 124) and time.monotonic() - began < 30
    points = read_points(tmp_path / POINTS_FILE)
    assert [(p["stage"], p["index"]) for p in points] == [("sleepy", 0), ("sleepy", 1)]
    # The stage knew its deadline: its limit less a margin.
    assert 0 < points[1]["left_s"] < 6
    time.sleep(0.5)
    assert _gone(points[0]["child"])


def test_a_stage_killed_in_its_exit_after_it_returned_keeps_its_status(fake_stages, tmp_path):
    with (tmp_path / "log").open("w") as log:
        status, code = run_gpu.run_stage(run_gpu.Stage("slow_exit", 6, "fake_slow_exit"), 6, tmp_path, "reduced",
                                         log, StopSignals())
    assert (status, code) == (run_gpu.PASSED, 0)
    end = read_points(tmp_path / POINTS_FILE, kind="end")
    assert [(p["stage"], p["returncode"]) for p in end] == [("slow_exit", 0)]


def test_the_points_a_stage_skipped_are_counted_in_its_status(fake_stages, tmp_path, capsys):
    fake_stages(run_gpu.Stage("skips", 20, "fake_skips"))
    assert run_gpu.main(["--out", str(tmp_path), "--budget", "60", "--shapes", "reduced"]) == run_gpu.EXIT_OK
    status = read_points(tmp_path / POINTS_FILE, stage="skips", kind="status")[0]
    assert status["status"] == run_gpu.PASSED and status["skipped_points"] == 2
    assert "== skips: passed in" in capsys.readouterr().out
    assert "2 points skipped" in (tmp_path / "run_gpu.log").read_text()


def test_a_run_records_every_stage_and_goes_on_after_failures(fake_stages, tmp_path, capsys):
    fake_stages(run_gpu.Stage("fails", 20, "fake_fails"), run_gpu.Stage("sleepy", 200, "fake_sleepy"),
                run_gpu.Stage("late", 20, "fake_env"))
    # 30 s: the sleepy stage gets what is left after the calibration's reserve and is killed there;
    # too little is left for the last one.
    assert run_gpu.main(["--out", str(tmp_path), "--budget", "30", "--shapes", "reduced"]) == run_gpu.EXIT_FAILED
    statuses = {p["stage"]: p for p in read_points(tmp_path / POINTS_FILE, kind="status")}
    assert [p["status"] for p in statuses.values()] == [run_gpu.PASSED, run_gpu.FAILED, run_gpu.TIMED_OUT,
                                                        run_gpu.SKIPPED, run_gpu.PASSED]
    assert list(statuses) == ["environment", "fails", "sleepy", "late", "calibration"]
    assert statuses["sleepy"]["limit_s"] <= 30 - 10
    error = read_points(tmp_path / POINTS_FILE, stage="fails", kind="error")[0]
    assert "broken on purpose" in error["error"] and "Traceback" in error["traceback"]
    # The calibration ran last and saw what the others had written.
    calibration = read_points(tmp_path / POINTS_FILE, kind="calibration")[0]
    assert calibration["stages_seen"] == ["environment", "fails", "late", "sleepy"]
    log = (tmp_path / "run_gpu.log").read_text()
    assert "== late: SKIPPED" in log and "RuntimeError: broken on purpose" in log
    assert "== done in" in capsys.readouterr().out


def test_a_real_stage_killed_mid_way_keeps_the_points_it_had_written(tmp_path):
    """The cost-curve stage (reduced shapes, interpreted kernel) killed after its first context."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    command = [sys.executable, "microbench/run_stage.py", "cost_curve", "--out", str(tmp_path), "--shapes",
               "reduced", "--limit", "300"]
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not read_points(tmp_path / POINTS_FILE, kind="context") and time.monotonic() < deadline:
            assert process.poll() is None, "the stage ended before it was killed"
            time.sleep(0.2)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    contexts = read_points(tmp_path / POINTS_FILE, kind="context")
    assert contexts and contexts[0]["gpu_context"] == 8 * 1024 and contexts[0]["front_seconds"] > 0
    assert not read_points(tmp_path / POINTS_FILE, kind="summary")


def _running(marker: str) -> list[int]:
    """Pids of the processes (zombies aside) whose command line mentions ``marker``: what ``ps`` shows."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker in command and state != "Z":
            pids.append(int(entry.name))
    return pids


def _wait_for(condition, seconds: float, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert process.poll() is None, f"the run ended first, exit status {process.returncode}"
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.2)


def _kill_all(process: subprocess.Popen, pids: list[int]) -> None:
    """Leave nothing behind, whatever the test found: the run's group and the processes named."""
    for pid in ([process.pid] if process.poll() is None else []) + pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def _as_foreground_job():
    # What a terminal gives its foreground job: a process group of its own, SIGINT at its default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.setsid()


DRIVER = """
import sys
sys.path.insert(0, "microbench")
import run_gpu

run_gpu.STAGES = (run_gpu.Stage("environment", 30, "fake_env"), run_gpu.Stage("sleepy", 200, "fake_sleepy"),
                  run_gpu.Stage("late", 30, "fake_env"))
run_gpu.CALIBRATION = run_gpu.Stage("calibration", 20, "fake_calibration")
sys.exit(run_gpu.main(sys.argv[1:]))
"""


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129), (signal.SIGINT, 130)],
                         ids=["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_signal_stops_the_stage_s_whole_group_and_the_calibration_still_runs(fake_stages, tmp_path, signum,
                                                                                code):
    out = tmp_path / "out"
    process = subprocess.Popen([sys.executable, "-c", DRIVER, "--out", str(out), "--shapes", "reduced"], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               preexec_fn=_as_foreground_job)
    try:
        _wait_for(lambda: read_points(out / POINTS_FILE, stage="sleepy"), 60, process)
        child = read_points(out / POINTS_FILE, stage="sleepy")[0]["child"]
        process.send_signal(signum)
        output, _ = process.communicate(timeout=60)
    finally:
        _kill_all(process, _running(str(out)))
    assert process.returncode == code, output
    statuses = {p["stage"]: p for p in read_points(out / POINTS_FILE, kind="status")}
    assert list(statuses) == ["environment", "sleepy", "calibration"]
    assert statuses["sleepy"]["status"] == run_gpu.INTERRUPTED
    assert statuses["sleepy"]["signal"] == signal.Signals(signum).name
    assert statuses["calibration"]["status"] == run_gpu.PASSED
    # The calibration saw the points written before the signal.
    assert read_points(out / POINTS_FILE, kind="calibration")[0]["stages_seen"] == ["environment", "sleepy"]
    assert f"{signal.Signals(signum).name}" in output and "== done" in output
    # Nothing of the stage is left: neither its own process nor the child it started.
    time.sleep(0.5)
    assert _gone(child) and _running(str(out)) == []


def test_ctrl_c_during_a_real_run_kills_the_stage_and_writes_the_calibration(tmp_path):
    """The script as a terminal runs it, Ctrl-C (SIGINT to its process group) in the attention stage."""
    process = subprocess.Popen(["bash", "microbench/run_gpu.sh", "--out", str(tmp_path), "--shapes", "reduced"],
                               cwd=REPO, env=_script_environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, preexec_fn=_as_foreground_job)
    try:
        _wait_for(lambda: read_points(tmp_path / POINTS_FILE, stage="attention"), 240, process)
        os.killpg(process.pid, signal.SIGINT)
        output, _ = process.communicate(timeout=90)
    finally:
        _kill_all(process, _running(str(tmp_path)))
    assert process.returncode == 130, output
    assert "Traceback" not in output
    statuses = {p["stage"]: p["status"] for p in read_points(tmp_path / POINTS_FILE, kind="status")}
    assert statuses == {"environment": run_gpu.PASSED, "attention": run_gpu.INTERRUPTED,
                        "calibration": statuses["calibration"]}
    assert (tmp_path / "calibration_reduced.json").exists()
    assert read_points(tmp_path / POINTS_FILE, kind="calibration")
    # No process of the run is left to write into the folder.
    lines = len((tmp_path / POINTS_FILE).read_text().splitlines())
    assert _running(str(tmp_path)) == []
    time.sleep(2)
    assert len((tmp_path / POINTS_FILE).read_text().splitlines()) == lines


def _script_environment(**env) -> dict:
    environment = {key: value for key, value in os.environ.items() if key not in ("TRITON_INTERPRET", "OUT")}
    return {**environment, "PYTHON": sys.executable, **env}


def _script(tmp_path, *argv, cwd=REPO, **env):
    return subprocess.run(["bash", str(REPO / "microbench" / "run_gpu.sh"), *argv], cwd=cwd,
                          env=_script_environment(**env), capture_output=True, text=True, timeout=600)


def test_the_script_without_a_gpu_exits_3_after_the_environment_point(tmp_path):
    # Run from elsewhere, with a relative $OUT: the folder is the caller's, not the repository's.
    (tmp_path / "caller").mkdir()
    done = _script(tmp_path, cwd=tmp_path / "caller", OUT="../out")
    assert done.returncode == run_gpu.EXIT_NO_GPU, done.stdout + done.stderr
    tmp_path = tmp_path / "out"
    points = read_points(tmp_path / POINTS_FILE)
    assert [p["kind"] for p in points] == ["environment", "device", "end", "status"]
    environment, device = points[0], points[1]
    assert device["cuda_available"] is False and device["torch"] and environment["python"]
    assert len(environment["tree_fingerprint"]) == 40 and "nvml" in environment
    assert "no usable CUDA GPU" in (tmp_path / "run_gpu.log").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == [POINTS_FILE, "run_gpu.log"]
    done = _script(tmp_path, "--budget", "5")
    assert done.returncode == run_gpu.EXIT_BAD_ARGS and "--budget must be at least" in done.stderr


def test_a_torch_that_does_not_import_stops_the_run_after_the_facts_without_it(tmp_path):
    """Installed (found) but broken: the environment point still has the machine and the code, the
    error is named, and the run stops there (no stage could import torch) with the missing-package
    status."""
    broken = tmp_path / "broken" / "torch"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise ImportError("libcudart.so.13: cannot open shared object file")\n')
    out = tmp_path / "out"
    done = _script(tmp_path, OUT=str(out), PYTHONPATH=str(tmp_path / "broken"))
    assert done.returncode == run_gpu.EXIT_MISSING, done.stdout + done.stderr
    points = read_points(out / POINTS_FILE)
    assert [(p["stage"], p["kind"]) for p in points] == [("environment", "environment"), ("environment", "error"),
                                                        ("environment", "end"), ("environment", "status")]
    environment, error = points[0], points[1]
    assert environment["python"] and len(environment["tree_fingerprint"]) == 40 and "nvidia_smi" in environment
    assert error["error"] == "torch does not import: ImportError: libcudart.so.13: cannot open shared object file"
    assert points[-1]["status"] == run_gpu.BROKEN_PACKAGE
    assert "torch does not import" in done.stdout


@pytest.mark.slow
def test_a_reduced_run_on_the_cpu_passes_every_stage(tmp_path):
    """Every stage's code path with reduced shapes, the kernels interpreted (about 60 s on 2 cores,
    120 s while the machine is shared), and the calibration it writes read by the simulator."""
    out = tmp_path / "out"
    began = time.monotonic()
    done = _script(tmp_path, "--out", str(out), "--shapes", "reduced")
    assert done.returncode == 0, done.stdout + done.stderr + (out / "run_gpu.log").read_text()[-3000:]
    assert time.monotonic() - began < run_gpu.DEFAULT_BUDGET
    points = read_points(out / POINTS_FILE)
    kinds = {(p["stage"], p["kind"]) for p in points}
    assert {("attention", "check"), ("attention", "speed"), ("cost_curve", "context"), ("swap", "copy"),
            ("swap", "overlap"), ("decode", "step"), ("phantom", "phantom"), ("calibration", "calibration")} <= kinds
    assert all(p["passed"] for p in points if p["kind"] == "check")
    # Our kernel with 3 pipeline stages gives the pinned configuration's result.
    assert all(p["equal_to_pinned"] for p in points if p.get("provider") == "penelope_stages_3")
    # A provider that cannot run here is recorded with its reason; the others matched ours.
    unavailable = {p["provider"]: p["reason"] for p in points if p["kind"] == "unavailable"}
    assert "sdpa_cudnn" in unavailable
    assert all(p["matches_ours"] for p in points if p["kind"] == "speed" and "matches_ours" in p)
    assert sorted(p.name for p in out.iterdir()) == ["calibration_reduced.json", "cost_curve.png", POINTS_FILE,
                                                    "run_gpu.log"]
    calibration = json.loads((out / "calibration_reduced.json").read_text())
    assert calibration["model"] == "tiny" and "decode_overhead" in calibration
    assert "simulator estimates kept" in calibration["source"]
    # The stage read its file back through the simulator's own reader.
    assert read_points(out / POINTS_FILE, kind="calibration")[0]["read_back"] is True
    # And `penelope simulate` runs on it, the tiny model given by its config.json (a folder named
    # after the model): the values it simulates with are the file's.
    config = tmp_path / "tiny" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(BUILTIN_ENGINE_CONFIGS["tiny"].to_hf()))
    assert penelope_main(["simulate", "--no-progress", "--limit-sessions", "1", "--model", str(config),
                          "--calibration", str(out / "calibration_reduced.json"),
                          "--json", str(tmp_path / "sim.json")]) == 0
    time_model = json.loads((tmp_path / "sim.json").read_text())["config"]["time_model"]
    measured = read_points(out / POINTS_FILE, kind="calibration")[0]["measured"]
    assert measured and all(time_model[key] == calibration[key] for key in measured)


_KILLED_RUNNER = """
import sys
sys.path.insert(0, {bench!r})
from stage_group import StopSignals, run_group
with StopSignals() as stop:
    run_group([sys.executable, "-c", "import time; print('stage', flush=True); time.sleep(120)"], 300, stop)
"""


def test_a_runner_killed_outright_leaves_no_stage():
    """SIGKILL of the runner itself (a machine's time limit) cannot be handled: the stage, in a
    group of its own, dies with it (parent-death signal) instead of running on."""
    bench = str(Path(__file__).resolve().parents[2] / "microbench")
    runner = subprocess.Popen([sys.executable, "-c", _KILLED_RUNNER.format(bench=bench)], stdout=subprocess.PIPE,
                              text=True)
    assert runner.stdout.readline().strip() == "stage"
    stages = [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and _parent(int(pid)) == runner.pid]
    assert len(stages) == 1
    runner.kill()
    runner.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(stages[0]):
        time.sleep(0.05)
    assert not _alive(stages[0]), "the stage outlived its killed runner"


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
