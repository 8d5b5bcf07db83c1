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
