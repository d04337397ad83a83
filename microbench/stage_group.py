"""One command of the GPU script in a process group of its own, stopped with its whole group at its
limit or when the runner gets a stop signal.

``StopSignals`` records SIGINT, SIGTERM and SIGHUP instead of letting them end the runner: the
stage that runs then is killed with everything it started, its status is written and the
calibration still runs, and the runner exits ``128 + signal`` (130, 143, 129). The handlers only
record: an exception raised wherever the runner happens to be (between ``fork`` and the return of
``Popen``, say) could leave a process nobody knows about. Without a terminal's Ctrl-C reaching them
(a group of their own), the stages learn of the stop only from the runner's SIGKILL.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

from penelope.loadgen.server import group_gone

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Seconds between looks at the command and the signals: a stop is acted on within this.
POLL = 0.1
# Seconds to wait for a killed group's processes to be gone.
KILL_WAIT = 10.0
EXITED, TIMED_OUT, STOPPED = "exited", "timed out", "stopped"


class StopSignals:
    """While active (``with``), the stop signals received, in order; the previous handlers come
    back at the end."""

    def __init__(self):
        self.received: list[signal.Signals] = []
        self._previous: dict = {}

    def __enter__(self) -> StopSignals:
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _record(self, signum, frame) -> None:
        self.received.append(signal.Signals(signum))

    @property
    def first(self) -> signal.Signals | None:
        return self.received[0] if self.received else None

    def exit_status(self) -> int | None:
        """The shell's status of a process ended by the first signal (128 + its number), or None."""
        return None if self.first is None else 128 + int(self.first)


def run_group(command: list[str], limit: float, stop: StopSignals, **popen) -> tuple[str, int | None]:
    """Run ``command`` in a session and process group of its own (``popen``: Popen's other
    arguments) until it exits, ``limit`` seconds pass, or a stop signal arrives that had not when it
    started; then its whole group is killed (also after an exit: what it started may still run).
    Returns ``(EXITED, exit code)``, ``(TIMED_OUT, None)`` or ``(STOPPED, None)``."""
    seen = len(stop.received)
    process = subprocess.Popen(command, start_new_session=True, preexec_fn=_die_with_the_runner, **popen)
    deadline = time.monotonic() + limit
    outcome = EXITED
    try:
        while not _exited(process):
            if len(stop.received) > seen:
                outcome = STOPPED
                break
            if time.monotonic() >= deadline:
                outcome = TIMED_OUT
                break
            time.sleep(POLL)
    finally:
        kill_group(process)
    return outcome, process.returncode if outcome == EXITED else None


def _die_with_the_runner() -> None:
    """In the command's process, before it starts: be killed when the runner dies (Linux's
    parent-death signal), so a runner killed outright, as past a machine's time limit, leaves no
    stage running. Elsewhere nothing."""
    if sys.platform.startswith("linux"):
        # PR_SET_PDEATHSIG
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)


def _exited(process: subprocess.Popen) -> bool:
    """Whether ``process`` has exited, left unreaped: its pid, and so its group's id, cannot be
    taken by another process before ``kill_group`` has signalled the group."""
    return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL to ``process``'s group, then reap ``process`` and wait until none of the group runs."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
    group_gone(process, KILL_WAIT)
