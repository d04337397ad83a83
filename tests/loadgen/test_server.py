"""The SGLang launcher of the load generator (`penelope.loadgen.server`) with stand-in server
commands (the real server: `tests/loadgen/test_sglang.py`): a launcher that exits, or never
answers, is one error naming its log, and its whole process group is gone afterwards."""
import stat
import sys
import time

import pytest

from penelope.loadgen.server import ServerSpec, ServerStartError, SGLangServer, group_alive


def fake_python(tmp_path, body: str):
    """An executable standing for `python -m sglang.launch_server ...` (it ignores the arguments)."""
    path = tmp_path / "fake-python"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


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
    script = tmp_path / "serve.py"
    script.write_text(
        "import http.server, sys\n"
        "port = int(sys.argv[sys.argv.index('--port') + 1])\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers()\n"
        "    def log_message(self, *a): pass\n"
        "http.server.HTTPServer(('127.0.0.1', port), H).serve_forever()\n")
    python = fake_python(tmp_path, f'exec "{sys.executable}" "{script}" "$@"')
    spec = ServerSpec(model="m", log=tmp_path / "server.log", python=python, startup_timeout=30)
    with pytest.raises(KeyboardInterrupt), SGLangServer(spec) as server:
        pgid = server.process.pid
        assert group_alive(pgid) and server.url.startswith("http://127.0.0.1:")
        raise KeyboardInterrupt
    assert not group_alive(pgid)


def test_host_and_port_belong_to_the_launcher():
    with pytest.raises(ValueError, match="--host"):
        ServerSpec(model="m", log="x.log", args=("--host", "0.0.0.0"))
