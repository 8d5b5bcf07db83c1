"""Triton kernel of r3capture, its host launcher and torch reference.

``gather_alloc`` (one launch per engine step) gathers each request's accepted routed-experts
rows, casts them to uint8/uint16 and writes them block-aligned into a slot arena, taking
each new block's slot on the device from a queue the host refills (``docs/device_slots.md``);
``GatherAllocLaunch`` is the worker's launcher, validated once, and
``gather_alloc_reference`` the kernel's torch oracle.
"""

from r3capture.kernels._common import (
    STATUS_BAD_BLOCK,
    STATUS_BAD_INDEX,
    STATUS_BAD_LAUNCH,
    STATUS_BAD_REJECTED,
    STATUS_BAD_ROWS,
    STATUS_NO_STOCK,
    STATUS_OK,
    STATUS_SHARED_INDEX,
    KernelArgumentError,
    Status,
)
from r3capture.kernels._device import can_write_host_directly
from r3capture.kernels.alloc_reference import gather_alloc_reference
from r3capture.kernels.gather_alloc import GatherAllocLaunch, gather_alloc

__all__ = [
    "GatherAllocLaunch",
    "KernelArgumentError",
    "STATUS_BAD_BLOCK",
    "STATUS_BAD_INDEX",
    "STATUS_BAD_LAUNCH",
    "STATUS_BAD_REJECTED",
    "STATUS_BAD_ROWS",
    "STATUS_NO_STOCK",
    "STATUS_OK",
    "STATUS_SHARED_INDEX",
    "Status",
    "can_write_host_directly",
    "gather_alloc",
    "gather_alloc_reference",
]
