"""Triton kernels of r3capture, their host launchers and torch references.

``gather_pack`` (one launch per engine step) gathers each request's accepted routed-experts
rows, casts them to uint8/uint16 and writes them block-aligned into a slot arena;
``gather_pack_reference`` is its torch oracle and CPU fallback.
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
from r3capture.kernels.gather_pack import GatherPackLaunch, gather_pack
from r3capture.kernels.reference import gather_pack_reference

__all__ = [
    "GatherPackArgumentError",
    "GatherPackLaunch",
    "GatherPackShape",
    "STATUS_BAD_BLOCK",
    "STATUS_BAD_REJECTED",
    "STATUS_BAD_ROWS",
    "STATUS_OK",
    "Status",
    "can_write_host_directly",
    "gather_pack",
    "gather_pack_reference",
]
