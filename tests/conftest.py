"""Test-wide setup: the Triton interpreter on CPU-only machines (every interpreted load and
store checked against its launch's tensors), and the `gpu` marker."""

import os

import pytest
import torch

# Must precede the import of any module that defines @triton.jit kernels: triton.jit
# decides at decoration time whether a kernel is compiled or interpreted.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _interpreted_accesses_in_bounds():
    """On a GPU an access outside a kernel's tensors is an illegal address; under the
    interpreter it silently reads or writes host memory, so every test checks them."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from interpreter_bounds import checked_memory_accesses

    with checked_memory_accesses():
        yield


@pytest.fixture
def vllm_033_probe(tmp_path):
    """Run a probe script in a fresh interpreter against vLLM 0.33.0 (plugins loaded by vLLM
    itself) with the tiny Qwen3-MoE config in ``tmp_path``; returns the JSON it prints after
    ``PROBE ``."""
    import json
    import subprocess
    import sys

    from transformers import Qwen3MoeConfig

    from demo.tiny_model import TINY_CONFIG

    # A config is all vLLM's engine config needs (no weights are loaded).
    Qwen3MoeConfig(**TINY_CONFIG, architectures=["Qwen3MoeForCausalLM"]).save_pretrained(tmp_path)
    env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_USE_V2_MODEL_RUNNER": "1",
        "HF_HUB_OFFLINE": "1",
    }

    def run(script) -> dict:
        proc = subprocess.run(
            [sys.executable, str(script), str(tmp_path)],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
        assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
        return json.loads(lines[0].removeprefix("PROBE "))

    return run
