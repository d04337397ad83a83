"""An SGLang server for load tests: `python -m sglang.launch_server` on 127.0.0.1, in a process
group of its own, its output kept in a log file, ready once `/health` answers 200, and its whole
process group killed when it is stopped, when the `with` block ends (also on an exception or
Ctrl-C), or when the Python process exits; on Linux the server also gets SIGTERM when the process
that started it dies in any other way (killed outright, or by a signal it does not handle).

    spec = ServerSpec(model="/path/to/model", args=("--radix-cache-backend", "penelope"),
                      log=Path("server.log"))
    with SGLangServer(spec) as server:
        ... server.url ...

SGLang on CPU (docs/design.md section 7) needs `CPU_ARGS` and `CPU_ENV`, plus `sgl_kernel`'s CPU
build or the tests' stand-in on `PYTHONPATH`.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from penelope.errors import PenelopeError

CPU_ARGS = ("--device", "cpu", "--dtype", "float32", "--attention-backend", "torch_native", "--disable-cuda-graph",
            # An idle scheduler otherwise busy-polls a core and slows the client and other servers.
            "--sleep-on-idle")
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
HOST = "127.0.0.1"
STOP_TIMEOUT = 30.0
# free_port draws from [_PORTS_LOW, _SGLANG_PORTS_LOW): SGLang draws its rendezvous port from
# 22000 up (sglang.srt.utils.network.get_free_port_below_ephemeral).
_PORTS_LOW = 10000
_SGLANG_PORTS_LOW = 22000
# What SGLang's HTTP server (uvicorn) logs when its port is taken.
_BIND_FAILED = b"error while attempting to bind on address"
# Fresh ports tried when the launcher picked the port and another process took it first.
PORT_ATTEMPTS = 3


def _stop_with_the_parent() -> None:
    """In the server's process, before it starts: get SIGTERM when the process that started it
    dies (Linux's parent-death signal), so a client killed outright (SIGKILL, or SIGTERM where
    nothing handles it) leaves no server running; SGLang's launcher stops its own processes on
    SIGTERM. Elsewhere nothing."""
    if sys.platform.startswith("linux"):
        # PR_SET_PDEATHSIG
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)


class ServerStartError(PenelopeError):
    """The server exited or did not become ready; the message names its log."""


class PortInUseError(ServerStartError):
    """The server could not bind its port (something else took it)."""


def group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` is still running. Zombies do not count: an orphaned
    child's zombie waits for a reaper this process does not control."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # Fields after the command's closing parenthesis: state, ppid, pgrp, ...
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def group_gone(process: subprocess.Popen, seconds: float) -> bool:
    """Wait up to `seconds` until no process of `process`'s group is running."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        process.poll()
        if not group_alive(process.pid):
            return True
        time.sleep(0.2)
    return False


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing is bound to now, drawn below the kernel's ephemeral
    range and below the range SGLang draws its own ports from: a port from the ephemeral range can
    be taken, before the server binds it, as the local end of any outgoing connection (the
    server's own start-up makes several), and an SGLang launcher that cannot bind its port does
    not exit (it waits for its scheduler forever)."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    high = min(_SGLANG_PORTS_LOW, ephemeral_low)
    for port in random.sample(range(_PORTS_LOW, high), min(64, max(0, high - _PORTS_LOW))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((HOST, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


@dataclass(frozen=True)
class ServerSpec:
    """model: checkpoint path or name; args: further `sglang.launch_server` options (not --host
    or --port); env: variables added to this process's environment; log: the server's stdout and
    stderr; port: None picks a free one; startup_timeout: seconds until `/health` answers."""

    model: str
    log: Path
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    port: int | None = None
    python: str = sys.executable
    startup_timeout: float = 600.0

    def __post_init__(self) -> None:
        given = {"--host", "--port"} & {a.split("=")[0] for a in self.args}
        if given:
            raise ValueError(f"ServerSpec.args: {sorted(given)} are set by the launcher (127.0.0.1, ServerSpec.port)")


class SGLangServer:
    """One SGLang server process group (see the module docstring)."""

    def __init__(self, spec: ServerSpec):
        self.spec = spec
        self.port = spec.port or free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def command(self) -> list[str]:
        return [self.spec.python, "-m", "sglang.launch_server", "--model-path", str(self.spec.model),
                "--host", HOST, "--port", str(self.port), *self.spec.args]

    def start(self) -> SGLangServer:
        """Start the server and wait until it is ready; ServerStartError (server stopped) if it
        exits first or is not ready within the start-up timeout. Where the launcher picked the
        port and another process took it before the server bound it, it starts again on another
        (`PORT_ATTEMPTS` in all)."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                return self._start_once()
            except PortInUseError:
                if self.spec.port is not None or attempt == PORT_ATTEMPTS:
                    raise
                self.port = free_port()
        raise AssertionError("unreachable")

    def _start_once(self) -> SGLangServer:
        self.spec.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.spec.log, "wb") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env={**os.environ, **self.spec.env},
                                            start_new_session=True, preexec_fn=_stop_with_the_parent)
        atexit.register(self.stop)
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.spec.startup_timeout
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise ServerStartError(f"sglang.launch_server exited with code {code} before it was ready "
                                       f"({self.log_tail()}; log: {self.spec.log})")
            if self._bind_failed():
                raise PortInUseError(f"sglang.launch_server could not bind {HOST}:{self.port}: another process "
                                     f"uses the port (log: {self.spec.log})")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise ServerStartError(f"sglang.launch_server did not answer {self.url}/health within "
                               f"{self.spec.startup_timeout:g} s (last line of its log: {self.log_tail()}; "
                               f"log: {self.spec.log})")

    def _bind_failed(self) -> bool:
        try:
            return _BIND_FAILED in self.spec.log.read_bytes()
        except OSError:
            return False

    def log_tail(self) -> str:
        """The log's last non-empty line, for a one-line error."""
        try:
            lines = [line for line in self.spec.log.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return "no log"
        return lines[-1].strip()[:300] if lines else "empty log"

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL to whatever is left after `STOP_TIMEOUT` seconds
        (SGLang's launcher stops its scheduler and detokenizer processes on SIGTERM); returns once
        no process of the group is left, so a server started next sizes its pool from the memory
        this one freed."""
        process, self.process = self.process, None
        if process is None:
            return
        atexit.unregister(self.stop)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            if group_gone(process, STOP_TIMEOUT):
                break
        process.wait()

    def __enter__(self) -> SGLangServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
