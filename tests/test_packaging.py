"""What pyproject.toml declares agrees with what r3capture supports."""

from __future__ import annotations

from pathlib import Path

import pytest

from r3capture.aux_output import compat

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")

ROOT = Path(__file__).resolve().parent.parent


def test_the_vllm_extra_is_the_range_r3capture_supports():
    """``pip install r3capture[vllm]`` must not move a user of a supported vLLM (0.32.x, say)
    to another release: the extra declares the range ``compat`` accepts, no narrower."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["vllm"] == ["vllm" + ",".join(compat.SUPPORTED_VLLM)]
