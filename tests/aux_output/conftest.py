"""Fixtures shared by the aux_output tests."""

import subprocess
import sys
import types

import pytest

from r3capture.aux_output import plugin


@pytest.fixture
def vllm_verify():
    """vLLM 0.33.0's own routed-experts config check, and the same check as the plugin wraps
    it, patched onto a stand-in class (the real VllmConfig is left alone)."""
    from vllm.config.vllm import VllmConfig

    original = VllmConfig.__dict__["_verify_aux_output_compatibility"]
    original = getattr(original, "__wrapped__", original)
    module = types.ModuleType("config")
    module.VllmConfig = type("VllmConfig", (), {"_verify_aux_output_compatibility": original})
    plugin._patch_vllm_config(module)
    return original, module.VllmConfig._verify_aux_output_compatibility


@pytest.fixture
def after_register():
    """``run(module, probe)``: in a fresh interpreter, r3capture's ``register()`` (which must
    not import ``module``), then ``probe`` (Python source lines that import vLLM's module and
    assert on its hooks); fails unless every assertion held."""

    def run(module: str, probe: str) -> None:
        script = (
            "import sys\n"
            "from r3capture.aux_output import plugin\n"
            "plugin.register()\n"
            f"assert {module!r} not in sys.modules\n"
            f"{probe}"
            "print('HOOKED')\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
        )
        assert "HOOKED" in done.stdout, done.stderr[-3000:]

    return run
