"""Output files: checked before any work, never an input or each other, written whole;
Ctrl-C keeps the capacities that finished."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from penelope.cli import main


def one_error(capsys, *parts):
    err = capsys.readouterr().err
    assert err.startswith("penelope: error: ") and err.count("\n") == 1, err
    for part in parts:
        assert part in err, err


@pytest.fixture
def no_replay(monkeypatch):
    """Fail the test if a command gets as far as loading its workload."""
    from penelope.sim.workloads import load as options

    def loaded(*args, **kwargs):
        raise AssertionError("the workload was loaded before the outputs were checked")

    monkeypatch.setattr(options, "load_workload", loaded)


def files(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def test_plot_without_a_known_extension_is_refused(tmp_path, capsys):
    # matplotlib would write out.png and the command reported "wrote out".
    out = tmp_path / "out"
    assert main(["cost", "--plot", str(out)]) == 2
    one_error(capsys, f"--plot {out}: no extension; use one of", ".png", ".pdf", ".svg")
    assert main(["cost", "--plot", str(tmp_path / "out.docx")]) == 2
    one_error(capsys, "extension .docx")
    assert files(tmp_path) == {}


def test_json_equal_to_plot_is_refused(tmp_path, capsys, no_replay):
    same = str(tmp_path / "r.png")
    assert main(["simulate", "--json", same, "--plot", same, "--no-progress"]) == 2
    one_error(capsys, f"--plot {same} is the file --json also writes")
    # The same file by two spellings.
    assert main(["cost", "--json", same, "--plot", str(tmp_path / "." / "r.png")]) == 2
    one_error(capsys, "is the file --json also writes")
    assert files(tmp_path) == {}


def test_json_equal_to_an_input_is_refused_and_the_input_kept(tmp_path, capsys, no_replay):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 64, "output_length": 1, "hash_ids": [1]}\n')
    before = trace.read_bytes()
    assert main(["simulate", "--trace", str(trace), "--json", str(trace), "--no-progress"]) == 2
    one_error(capsys, f"--json {trace} is the input --trace {trace}")
    assert main(["analyze", str(trace), "--json", str(trace), "--no-progress"]) == 2
    one_error(capsys, "is the input PATH")
    link = tmp_path / "link.jsonl"
    link.symlink_to(trace)
    assert main(["simulate", "--trace", str(trace), "--json", str(link), "--no-progress"]) == 2
    one_error(capsys, "is the input --trace")
    calibration = tmp_path / "cal.json"
    calibration.write_text("{}")
    assert main(["simulate", "--calibration", str(calibration), "--plot", str(calibration), "--no-progress"]) == 2
    one_error(capsys, "is the input --calibration")
    config = tmp_path / "config.json"
    config.write_text("{}")
    assert main(["cost", "--model", str(config), "--json", str(config)]) == 2
    one_error(capsys, "is the input --model")
    assert trace.read_bytes() == before and calibration.read_text() == "{}" and config.read_text() == "{}"


def test_json_inside_a_weka_folder_would_be_read_as_a_trace(tmp_path, capsys, no_replay):
    folder = tmp_path / "traces"
    folder.mkdir()
    assert main(["simulate", "--trace", str(folder), "--json", str(folder / "out.json"), "--no-progress"]) == 2
    one_error(capsys, "is inside the trace folder", "read as a trace")


@pytest.mark.parametrize("command", [["cost"], ["simulate", "--no-progress"], ["analyze", "--format", "synthetic"],
                                     ["verify"]])
def test_bad_json_paths_are_refused_before_any_work(tmp_path, capsys, no_replay, command):
    folder = tmp_path / "folder"
    folder.mkdir()
    assert main([*command, "--json", str(folder)]) == 2
    one_error(capsys, f"--json {folder} is a folder")
    assert main([*command, "--json", str(tmp_path / "missing" / "r.json")]) == 2
    one_error(capsys, "folder", "missing does not exist")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert main([*command, "--json", str(a_file / "r.json")]) == 2
    one_error(capsys, "does not exist")
    assert main([*command, "--json", str(tmp_path / "slash") + "/"]) == 2
    one_error(capsys, "names a folder")


def test_unwritable_output_is_refused_before_any_work(tmp_path, capsys, no_replay):
    if os.geteuid() == 0:
        # Root writes through any permission bits; a virtual file system refuses it all the same.
        target = "/sys/penelope-test-output.json"
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        target = str(locked / "r.json")
    assert main(["simulate", "--json", target, "--no-progress"]) == 2
    one_error(capsys, f"--json {target}")
    assert not os.path.exists(target)


def test_reproduce_out_on_a_file_is_refused(tmp_path, capsys):
    out = tmp_path / "results"
    out.write_text("not a folder")
    assert main(["reproduce", "--out", str(out), "--no-progress"]) == 2
    one_error(capsys, f"--out {out} is a file, not a folder")
    assert out.read_text() == "not a folder"
    assert main(["reproduce", "--out", str(out / "sub"), "--no-progress"]) == 2
    one_error(capsys, "--out", "cannot create this folder")


def test_reproduce_checks_every_step_before_the_first(tmp_path, capsys):
    out = tmp_path / "results"
    assert main(["reproduce", "--out", str(out), "--sweep", "64K,lots", "--no-progress"]) == 2
    one_error(capsys, "--sweep: cannot read 'lots'")
    assert main(["reproduce", "--out", str(out), "--jobs", "two", "--no-progress"]) == 2
    one_error(capsys, "argument --jobs: invalid int value: 'two'")
    # Capacities are checked against the workload, each named by its own flag.
    assert main(["reproduce", "--out", str(out), "--ablation-cache", "16", "--no-progress"]) == 2
    one_error(capsys, "--ablation-cache 16 is below one block of 64 tokens")
    assert main(["reproduce", "--out", str(out), "--sweep", "64K,1K", "--no-progress"]) == 2
    one_error(capsys, "--sweep 1K: no request of the workload fits in it")
    assert not out.exists() or files(out) == {}


def test_an_output_folder_made_for_a_refused_command_goes_again(tmp_path, capsys):
    """The folder (and parents) --out created are removed when the input is refused; a folder that
    was there before stays."""
    out = tmp_path / "new" / "results"
    assert main(["reproduce", "--out", str(out), "--ablation-cache", "16", "--no-progress"]) == 2
    one_error(capsys, "--ablation-cache 16 is below one block")
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    assert main(["reproduce", "--out", str(kept), "--ablation-cache", "16", "--no-progress"]) == 2
    one_error(capsys, "--ablation-cache 16 is below one block")
    assert kept.is_dir() and files(kept) == {}


def test_reproduce_checks_every_result_file_before_the_first_step(tmp_path, capsys):
    out = tmp_path / "results"
    (out / "ablation.json").mkdir(parents=True)
    assert main(["reproduce", "--out", str(out), "--no-progress"]) == 2
    one_error(capsys, "ablation.json is a folder")
    assert sorted(p.name for p in out.iterdir()) == ["ablation.json"]


def test_outputs_are_replaced_whole_and_through_links(tmp_path):
    from penelope.outputs import write_text

    target = tmp_path / "real.json"
    target.write_text("old")
    target.chmod(0o640)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_text(str(link), "new")
    assert link.is_symlink() and target.read_text() == "new" and (target.stat().st_mode & 0o777) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "real.json"]
    # A device is written in place, never replaced.
    write_text(os.devnull, "discarded")
    assert Path(os.devnull).is_char_device()


def test_a_failed_write_leaves_the_old_file(tmp_path, monkeypatch):
    from penelope import outputs

    target = tmp_path / "r.json"
    target.write_text("old")

    def broken(self, text):
        Path.write_bytes(self, text[:3].encode())
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", broken)
    with pytest.raises(OSError):
        outputs.write_text(str(target), "new contents")
    monkeypatch.undo()
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["r.json"]


def interrupt_after(monkeypatch, module, name, calls):
    """Make `module.name` raise KeyboardInterrupt on its call number `calls + 1`."""
    real = getattr(module, name)
    count = [0]

    def wrapped(*args, **kwargs):
        count[0] += 1
        if count[0] > calls:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)


SWEEP = ["simulate", "--limit-sessions", "1", "--gpu-cache", "64K,96K,128K", "--no-progress"]


def test_ctrl_c_keeps_the_finished_capacities(tmp_path, capsys, monkeypatch):
    from penelope.sim import ensemble

    out = tmp_path / "sim.json"
    # A sweep's replays go through the ensemble runner (in this process with --jobs 1): 2 policies
    # per capacity, interrupted during the third capacity.
    interrupt_after(monkeypatch, ensemble._Replayer, "run", 4)
    assert main([*SWEEP, "--jobs", "1", "--json", str(out)]) == 130
    err = capsys.readouterr().err
    assert err == f"penelope: interrupted; wrote the 2 of 3 capacities that finished (64K, 96K) to {out}\n"
    payload = json.loads(out.read_text())
    assert [entry["gpu_cache"] for entry in payload["sweep"]] == [64 * 1024, 96 * 1024]
    assert payload["interrupted"] == {"finished": [65536, 98304], "not_run": [131072]}
    assert set(payload["sweep"][0]["results"]) == {"sglang", "penelope"}


def test_ctrl_c_without_json_shows_the_finished_capacities(capsys, monkeypatch):
    from penelope.sim import ensemble

    interrupt_after(monkeypatch, ensemble._Replayer, "run", 4)
    assert main([*SWEEP, "--jobs", "1"]) == 130
    printed = capsys.readouterr()
    assert printed.err == "penelope: interrupted\n"
    assert "GPU cache 64K: pressure" in printed.out and "GPU cache 96K: pressure" in printed.out
    assert "GPU cache 128K: pressure" not in printed.out


def test_ctrl_c_before_any_capacity_finished_writes_nothing(tmp_path, capsys, monkeypatch):
    from penelope.sim import ensemble

    out = tmp_path / "sim.json"
    out.write_text("previous results")
    interrupt_after(monkeypatch, ensemble._Replayer, "run", 0)
    assert main([*SWEEP, "--jobs", "1", "--json", str(out)]) == 130
    assert capsys.readouterr().err == f"penelope: interrupted before any capacity finished; {out} not written\n"
    assert out.read_text() == "previous results"


def test_ctrl_c_in_an_ensemble_keeps_the_finished_capacities(tmp_path, capsys, monkeypatch):
    from penelope.sim import ensemble

    out = tmp_path / "sim.json"
    # 2 runs x 2 policies per capacity: interrupt during the second capacity.
    interrupt_after(monkeypatch, ensemble._Replayer, "run", 5)
    assert main([*SWEEP, "--repeat", "2", "--jobs", "1", "--json", str(out)]) == 130
    assert "wrote the 1 of 3 capacities that finished (64K)" in capsys.readouterr().err
    payload = json.loads(out.read_text())
    assert [entry["gpu_cache"] for entry in payload["sweep"]] == [64 * 1024]
    assert len(payload["sweep"][0]["results"]["penelope"]["runs"]) == 2


def _ensemble_process(tmp_path, settle: float = 2.0):
    """`simulate` running a parallel ensemble (about a minute of work on two cores), in a process
    group of its own, returned `settle` seconds after its workers start: a signal comes long
    before the end."""
    out = tmp_path / "sim.json"
    command = [sys.executable, "-m", "penelope.cli", "simulate", "--limit-sessions", "6", "--gpu-cache", "64K,96K",
               "--repeat", "30", "--jobs", "2", "--no-progress", "--json", str(out)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    # Wait until the ensemble runs (its line is printed before the workers start).
    for text in iter(process.stdout.readline, ""):
        if text.startswith("ensemble:"):
            break
    time.sleep(settle)
    return process


def test_sigint_to_a_parallel_ensemble_is_one_line_and_130(tmp_path):
    """A real Ctrl-C: the terminal signals the command and its worker processes together."""
    process = _ensemble_process(tmp_path)
    os.killpg(process.pid, signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert err.count("\n") == 1 and err.startswith("penelope: interrupted") and "Traceback" not in err, err


def test_sigterm_to_the_command_stops_it_and_its_workers(tmp_path):
    """`kill PID` (a service manager stopping the job): one line, exit 143, no worker left behind."""
    process = _ensemble_process(tmp_path)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 143, err
    assert err.count("\n") == 1 and err.startswith("penelope: terminated") and "Traceback" not in err, err
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError("worker processes outlived the command")


@pytest.mark.parametrize(("signals", "settle", "code", "line"), [
    ((signal.SIGINT, signal.SIGINT), 2.0, 130, "penelope: interrupted"),
    ((signal.SIGINT, signal.SIGINT, signal.SIGINT), 2.0, 130, "penelope: interrupted"),
    ((signal.SIGTERM,), 2.0, 143, "penelope: terminated"),
    ((signal.SIGTERM, signal.SIGINT), 2.0, 143, "penelope: terminated"),
    # While the workers are being started: held back until they have started (ignoring it there
    # lost it: the whole ensemble ran and exited 0), no traceback from a worker caught half started.
    ((signal.SIGINT,), 0.05, 130, "penelope: interrupted"),
    ((signal.SIGINT,), 0.2, 130, "penelope: interrupted"),
    ((signal.SIGTERM,), 0.1, 143, "penelope: terminated"),
])
def test_signals_to_the_whole_group_of_a_parallel_ensemble(tmp_path, signals, settle, code, line):
    """An impatient user presses Ctrl-C twice (or a service manager signals the whole group), also
    while the workers start: the command exits at once with one line, no traceback from any
    worker or thread."""
    process = _ensemble_process(tmp_path, settle)
    for sig in signals:
        os.killpg(process.pid, sig)
        time.sleep(0.1)
    try:
        _, err = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError("the command hung after the signals, or lost them") from None
    assert process.returncode == code, err
    assert err.count("\n") == 1 and err.startswith(line) and "Traceback" not in err, err


_ENDED_THEN_SIGNALLED = """
import os, signal, sys
import penelope.cli as cli
import penelope.commands.cost as command
from penelope.errors import Interrupted

def run(args):
    try:
        raise {raised}
    except KeyboardInterrupt:
        if {saved}:
            raise Interrupted("interrupted; kept 3 results")
        raise

command.run = run
sys.argv = ["penelope", "cost"]
code = cli.program()
# The second and third signals of a group-wide Ctrl-C or stop, arriving while the process exits.
os.kill(os.getpid(), signal.SIGINT)
os.kill(os.getpid(), signal.SIGTERM)
sys.exit(code)
"""


@pytest.mark.parametrize("saved", [False, True])
@pytest.mark.parametrize(("raised", "code", "line"), [("KeyboardInterrupt", 130, "penelope: interrupted"),
                                                      ("cli.Terminated", 143, "penelope: terminated")])
def test_signals_after_the_command_ended_on_one_keep_its_exit_code(raised, code, line, saved):
    """Once the program has said it was interrupted or terminated, later Ctrl-C and SIGTERM (Python
    restores their default actions as it shuts down) cannot kill it without its exit code."""
    script = _ENDED_THEN_SIGNALLED.format(raised=raised, saved=saved)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == code, run.stderr
    assert run.stderr.count("\n") == 1 and run.stderr.startswith(line), run.stderr
