"""Lazy, cached probe: can a kernel on this GPU write pinned host memory directly?

Triton turns each tensor argument into a device pointer with
``cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER)``; for pinned host memory on a
device with unified addressing that is the host address itself, and the kernel's stores go
over PCIe straight into the host arena. The probe asks the driver the same question for a
small pinned tensor, after checking the two device attributes that make it possible. Nothing
runs at import time.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

logger = logging.getLogger(__name__)

_CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY = 19
_CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41
_CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3


def kernel_address(tensor: torch.Tensor) -> int | torch.Tensor:
    """What a launch on ``tensor``'s device (or, for pinned host memory, on the current CUDA
    device) may pass for ``tensor``: the address kernels use for its first element, as an
    int, or ``tensor`` itself when the driver does not answer here (no libcuda, no current
    context). Triton's launcher asks the driver this for every tensor argument of every
    launch (``data_ptr()`` then ``cuPointerGetAttribute``); an int skips both. The int is
    valid while ``tensor``'s storage lives."""
    if tensor.is_cuda:
        return tensor.data_ptr()
    libcuda = _libcuda()
    if libcuda is None or tensor.data_ptr() == 0:
        return tensor
    rc, address = _mapped_address(libcuda, tensor.data_ptr())
    if rc != 0:
        logger.info(
            "kernel address of a %s tensor: CUresult %d; passing the tensor", tensor.device, rc
        )
        return tensor
    return address


def _mapped_address(libcuda: ctypes.CDLL, host_address: int) -> tuple[int, int]:
    """``(CUresult, device pointer)`` the driver gives for ``host_address`` in the current
    context (the pointer is meaningful only when the result is 0)."""
    address = ctypes.c_uint64()
    rc = libcuda.cuPointerGetAttribute(
        ctypes.byref(address),
        ctypes.c_int(_CU_POINTER_ATTRIBUTE_DEVICE_POINTER),
        ctypes.c_uint64(host_address),
    )
    return rc, address.value


@functools.cache
def _libcuda() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        logger.info("cannot load libcuda (%s)", exc)
        return None


def can_write_host_directly(device: torch.device | str | int | None = None) -> bool:
    """True when kernels on ``device`` (a CUDA device; None = current) can store into pinned
    host tensors passed as arguments; False on CPU-only machines, ROCm, or any probe failure.
    The answer is cached per device."""
    if not torch.cuda.is_available() or torch.version.hip is not None:
        return False
    if device is None:
        index = torch.cuda.current_device()
    else:
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if device.type != "cuda":
            return False
        index = torch.cuda.current_device() if device.index is None else device.index
    return _probe(index)


@functools.cache
def _probe(index: int) -> bool:
    libcuda = _libcuda()
    if libcuda is None:
        logger.info("direct host writes disabled: libcuda did not load")
        return False
    with torch.cuda.device(index):
        # Makes the device's primary context current on this thread for the driver calls.
        torch.cuda.synchronize()
        dev = ctypes.c_int()
        if libcuda.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(index)) != 0:
            logger.info("direct host writes disabled: cuDeviceGet(%d) failed", index)
            return False
        for attr, name in (
            (_CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, "unified addressing"),
            (_CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY, "mapped host memory"),
        ):
            value = ctypes.c_int()
            rc = libcuda.cuDeviceGetAttribute(ctypes.byref(value), ctypes.c_int(attr), dev)
            if rc != 0 or value.value != 1:
                logger.info("direct host writes disabled: cuda:%d lacks %s", index, name)
                return False
        probe = torch.empty(64, dtype=torch.uint8, pin_memory=True)
        rc, _ = _mapped_address(libcuda, probe.data_ptr())
    if rc != 0:
        logger.info("direct host writes disabled: pinned memory is not mapped (CUresult %d)", rc)
        return False
    return True
