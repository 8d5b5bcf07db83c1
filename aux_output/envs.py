"""The one place r3capture reads environment variables (documented in README.md)."""

from __future__ import annotations

import os

_CHOICES = {
    "R3CAPTURE_KERNEL_IMPL": ("auto", "triton", "reference"),
    "R3CAPTURE_DESTINATION": ("auto", "direct", "staging"),
}


def _choice(name: str) -> str:
    value = os.environ.get(name, "auto").strip().lower() or "auto"
    if value not in _CHOICES[name]:
        raise ValueError(f"{name}={value!r} is not one of {_CHOICES[name]}")
    return value


def kernel_impl() -> str:
    """R3CAPTURE_KERNEL_IMPL: auto (Triton on CUDA or under TRITON_INTERPRET, else the torch
    reference) | triton | reference."""
    return _choice("R3CAPTURE_KERNEL_IMPL")


def destination() -> str:
    """R3CAPTURE_DESTINATION: where the kernel writes rows. auto (pinned host arena when the
    GPU can write it directly, else device staging) | direct | staging."""
    return _choice("R3CAPTURE_DESTINATION")


def output_pool_bytes() -> int:
    """R3CAPTURE_OUTPUT_POOL_BYTES: most host bytes the worker keeps for recycling large
    output arrays (default 256 MiB; 0 turns recycling off)."""
    raw = os.environ.get("R3CAPTURE_OUTPUT_POOL_BYTES", "").strip()
    if not raw:
        return 256 << 20
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"R3CAPTURE_OUTPUT_POOL_BYTES={raw!r} is not a byte count >= 0")
    return value


def replay_log_interval_s() -> float:
    """R3CAPTURE_REPLAY_LOG_INTERVAL_S: least seconds between two log lines of the rows the
    per-request switch returned and withheld (default 10, vLLM's stats interval; 0 logs every
    finished request)."""
    raw = os.environ.get("R3CAPTURE_REPLAY_LOG_INTERVAL_S", "").strip()
    if not raw:
        return 10.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"R3CAPTURE_REPLAY_LOG_INTERVAL_S={raw!r} is not a number of seconds >= 0")
    return value
