"""The SGLang launcher of the load generator (`penelope.loadgen.server`) with stand-in server
commands (the real server: `tests/loadgen/test_sglang.py`): a launcher that exits, or never
answers, is one error naming its log, and its whole process group is gone afterwards."""
import shlex
import stat
import sys
import time

import pytest

from penelope.loadgen.server import PortInUseError, ServerSpec, ServerStartError, SGLangServer, free_port, group_alive


def fake_python(tmp_path, body: str):
    """An executable standing for `python -m sglang.launch_server ...` (it ignores the arguments)."""
    path = tmp_path / "fake-python"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def standin_server(tmp_path, first: str = ""):
    """A launcher whose "server" answers every GET with 200 on its --port, after running `first`."""
    script = tmp_path / "serve.py"
    script.write_text(
        "import http.server, sys\n" + first +
        "port = int(sys.argv[sys.argv.index('--port') + 1])\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers()\n"
        "    def log_message(self, *a): pass\n"
        "http.server.HTTPServer(('127.0.0.1', port), H).serve_forever()\n")
    return fake_python(tmp_path, f'exec "{sys.executable}" "{script}" "$@"')


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_launcher_that_exits_is_one_error_naming_its_log(tmp_path):
    python = fake_python(tmp_path, "echo 'ValueError: no such model' >&2; exit 3")
    server = SGLangServer(ServerSpec(model="m", log=tmp_path / "server.log", python=python, startup_timeout=30))
    with pytest.raises(ServerStartError, match=r"exited with code 3 before it was ready \(ValueError: no such "
                                               r"model; log: .*server.log\)"):
        server.start()
    assert server.process is None


def test_a_server_that_never_answers_is_killed_with_its_children(tmp_path):
    # The "server" starts a child (as SGLang starts its scheduler), then never listens.
    python = fake_python(tmp_path, f"sleep 300 & echo $! > {tmp_path}/child.pid; sleep 300")
    server = SGLangServer(ServerSpec(model="m", log=tmp_path / "server.log", python=python, startup_timeout=2))
    began = time.monotonic()
    with pytest.raises(ServerStartError, match=r"did not answer http://127.0.0.1:\d+/health within 2 s"):
        server.start()
    child = int((tmp_path / "child.pid").read_text())
    assert time.monotonic() - began < 40
    assert not alive(child)


def test_the_group_is_stopped_when_the_block_ends(tmp_path):
    """A stand-in that answers /health: the `with` block ends on an exception, the group is gone."""
    python = standin_server(tmp_path)
    spec = ServerSpec(model="m", log=tmp_path / "server.log", python=python, startup_timeout=30)
    with pytest.raises(KeyboardInterrupt), SGLangServer(spec) as server:
        pgid = server.process.pid
        assert group_alive(pgid) and server.url.startswith("http://127.0.0.1:")
        raise KeyboardInterrupt
    assert not group_alive(pgid)


def test_host_and_port_belong_to_the_launcher():
    with pytest.raises(ValueError, match="--host"):
        ServerSpec(model="m", log="x.log", args=("--host", "0.0.0.0"))


# A stand-in for a launcher whose port is taken: it logs uvicorn's bind error and then hangs, as
# SGLang's launcher does (it waits for its scheduler forever).
_BIND_ERROR = "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 1): address already in use"
_BIND_FAILS = f"echo {shlex.quote(_BIND_ERROR)}; sleep 300"


def test_a_port_taken_before_the_server_binds_it_is_an_error_at_once_when_the_port_was_given(tmp_path):
    python = fake_python(tmp_path, _BIND_FAILS)
    server = SGLangServer(ServerSpec(model="m", log=tmp_path / "server.log", python=python, port=free_port(),
                                     startup_timeout=60))
    began = time.monotonic()
    with pytest.raises(PortInUseError, match=r"could not bind 127.0.0.1:\d+: another process uses the port"):
        server.start()
    assert time.monotonic() - began < 30 and server.process is None


def test_a_port_taken_before_the_server_binds_it_is_replaced_when_the_launcher_picked_it(tmp_path):
    # The stand-in fails to bind on its first start only, then serves.
    python = standin_server(tmp_path, first=(
        "import pathlib, time\n"
        f"mark = pathlib.Path({str(tmp_path / 'tried')!r})\n"
        "if not mark.exists():\n"
        "    mark.write_text(sys.argv[sys.argv.index('--port') + 1])\n"
        f"    print({_BIND_ERROR!r}, flush=True)\n"
        "    time.sleep(300)\n"))
    with SGLangServer(ServerSpec(model="m", log=tmp_path / "server.log", python=python, startup_timeout=60)) as server:
        first = int((tmp_path / "tried").read_text())
        assert server.port != first and server.url.endswith(f":{server.port}")


def test_the_launcher_draws_ports_below_the_ephemeral_range():
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(10000 <= port < min(22000, low) for port in ports) and len(ports) > 1
