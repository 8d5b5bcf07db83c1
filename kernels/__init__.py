"""Triton kernels of r3capture, their host launchers and torch references.

``gather_pack`` (one launch per engine step) gathers each request's accepted routed-experts
rows, casts them to uint8/uint16 and writes them block-aligned into a slot arena;
``gather_pack_reference`` is its torch oracle and CPU fallback. ``gather_alloc`` does the
same with the slots taken on the device, from a queue the host refills (``docs/device_slots.md``);
``gather_alloc_reference`` is its oracle.
"""

from r3capture.kernels._common import (
    STATUS_BAD_BLOCK,
    STATUS_BAD_REJECTED,
    STATUS_BAD_ROWS,
    STATUS_OK,
    GatherPackArgumentError,
    GatherPackShape,
    Status,
)
from r3capture.kernels._device import can_write_host_directly
from r3capture.kernels.alloc_reference import gather_alloc_reference
from r3capture.kernels.gather_alloc import GatherAllocLaunch, gather_alloc
from r3capture.kernels.gather_pack import GatherPackLaunch, gather_pack
from r3capture.kernels.reference import gather_pack_reference

__all__ = [
    "GatherAllocLaunch",
    "GatherPackArgumentError",
    "GatherPackLaunch",
    "GatherPackShape",
    "STATUS_BAD_BLOCK",
    "STATUS_BAD_REJECTED",
    "STATUS_BAD_ROWS",
    "STATUS_OK",
    "Status",
    "can_write_host_directly",
    "gather_alloc",
    "gather_alloc_reference",
    "gather_pack",
    "gather_pack_reference",
]
