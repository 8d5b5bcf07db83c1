"""``make serve`` (``python demo/serve.py``): the tiny model under a real ``vllm serve`` with
r3capture's backend, in the environment the CPU emulation needs, until it is stopped."""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

import numpy as np
import pytest

from demo.scenario import complete
from demo.serve import REPO, VLLMServer

pytestmark = pytest.mark.e2e


def test_the_serve_command_serves_the_tiny_model_with_r3capture_until_stopped(
    tmp_path, hf_router, assert_stopped_in_order
):
    """Run as a user runs it, with no ``--model`` (it builds the tiny model in ``--workdir``)
    and an option for ``vllm serve`` (the served name): rows come back and equal HF's router;
    the command prints what it runs, the emulation's environment included; SIGTERM (as
    Ctrl-C) stops the server in order, leaving nothing to the resource tracker."""
    workdir = tmp_path / "work"
    launcher = [sys.executable, str(REPO / "demo" / "serve.py"), "--workdir", str(workdir)]
    # VLLMServer runs LAUNCHER MODEL --host H --port P: "tiny" is the --served-model-name.
    server = VLLMServer(
        "tiny", [], launcher=[*launcher, "--served-model-name"], log_path=tmp_path / "log"
    )
    with server:
        import openai

        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=300)
        prompt = list(range(3, 40))
        result = complete(client, "tiny", "single", prompt, 6)
    sequence = prompt + result.output
    np.testing.assert_array_equal(result.rows, hf_router.topk(sequence)[:-1])
    assert (workdir / "tiny-qwen3-moe" / "r3capture_tiny_model.json").exists()

    log = server.log_path.read_text(errors="replace")
    command = next(line for line in log.splitlines() if line.startswith("r3capture: "))
    for part in ("TRITON_INTERPRET=1", "PYTHONPATH=", "vllm serve", "--aux-output-backend triton",
                 "--enable-return-routed-experts", "--served-model-name tiny"):  # fmt: skip
        assert part in command, part
    assert f"serving tiny at {server.base_url}" in log
    assert_stopped_in_order(log)
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(server.base_url + "/health", timeout=5)
