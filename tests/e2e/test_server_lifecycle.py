"""demo/serve.py always ends the whole server process group, stubborn children included."""

from __future__ import annotations

import os
import sys
import time

import pytest

from demo.serve import ServerError, VLLMServer

pytestmark = pytest.mark.e2e

# Stands in for `vllm serve MODEL --host H --port P`: answers /health, ignores SIGTERM, and
# leaves a grandchild that ignores SIGTERM too (like a wedged engine core).
FAKE_SERVER = r"""
import http.server, os, signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
port = int(sys.argv[sys.argv.index("--port") + 1])
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
open(sys.argv[1], "w").write(f"{os.getpid()} {child.pid}")
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_stop_kills_the_whole_group_even_after_a_failure(tmp_path):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    pids_file = tmp_path / "pids"
    server = VLLMServer(
        str(pids_file),
        [],
        launcher=[sys.executable, str(script)],
        log_path=tmp_path / "log",
        stop_timeout_s=2.0,
    )
    with pytest.raises(RuntimeError, match="test failure"):
        with server:
            pids = [int(p) for p in pids_file.read_text().split()]
            assert all(_running(pid) for pid in pids)
            raise RuntimeError("test failure")
    assert not any(_running(pid) for pid in pids)


def test_start_failure_reports_the_log_and_leaves_nothing(tmp_path):
    script = tmp_path / "exits.py"
    script.write_text("import sys; print('bad flag', flush=True); sys.exit(3)")
    server = VLLMServer("m", [], launcher=[sys.executable, str(script)], log_path=tmp_path / "log")
    t0 = time.monotonic()
    with pytest.raises(ServerError, match="exited with 3(.|\n)*bad flag"):
        server.start()
    assert time.monotonic() - t0 < 30
    server.stop()
    assert not server.alive()
    assert os.path.exists(tmp_path / "log")
