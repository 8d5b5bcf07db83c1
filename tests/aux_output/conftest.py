"""Fixtures shared by the aux_output tests."""

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
