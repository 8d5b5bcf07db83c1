"""A bounds checker for kernels run under the Triton interpreter.

On a GPU, a load or store outside the tensors a kernel was given is an illegal memory access
(or silent corruption); under the interpreter it reads or writes whatever host memory lies
there, and no test notices. While ``checked_memory_accesses()`` is active, every launch
records the byte extent of each tensor argument as given (the view, not its whole storage),
and every lane of a ``tl.load``, ``tl.store`` or atomic read-modify-write whose mask is on
must fall inside one of them, or the launch raises ``OutOfBoundsAccess`` naming the address
and the extents (the interpreter re-raises it as an ``InterpreterError`` that quotes it).
Compare-and-swap and block pointers are not checked: r3capture's kernel uses neither.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
from triton.runtime import interpreter


class OutOfBoundsAccess(AssertionError):
    """An interpreted load, store or atomic outside every tensor argument of its launch."""


def tensor_extent(t: torch.Tensor) -> tuple[int, int] | None:
    """``[lo, hi)`` bytes a strided view can touch; None when it has no elements."""
    if t.numel() == 0:
        return None
    low = sum(min(0, (n - 1) * s) for n, s in zip(t.shape, t.stride()))
    high = sum(max(0, (n - 1) * s) for n, s in zip(t.shape, t.stride()))
    base = t.data_ptr()
    return base + low * t.element_size(), base + (high + 1) * t.element_size()


class _Extents:
    """The merged extents of the running launch's tensor arguments."""

    def __init__(self) -> None:
        self.lo = np.empty(0, np.uint64)
        self.hi = np.empty(0, np.uint64)

    def set_from(self, args) -> None:
        tensors = [interpreter._unwrap_tensor(arg) for arg in args]
        spans = sorted(
            span
            for t in tensors
            if isinstance(t, torch.Tensor) and (span := tensor_extent(t)) is not None
        )
        merged: list[list[int]] = []
        for lo, hi in spans:
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self.lo = np.array([lo for lo, _ in merged], np.uint64)
        self.hi = np.array([hi for _, hi in merged], np.uint64)

    def check(self, what: str, ptrs, mask) -> None:
        nbytes = ptrs.get_element_ty().primitive_bitwidth // 8
        addresses = np.broadcast_to(ptrs.data, np.shape(mask.data))[mask.data.astype(bool)]
        addresses = addresses.astype(np.uint64).ravel()
        if not addresses.size:
            return
        at = np.searchsorted(self.lo, addresses, side="right") - 1
        # An address below every extent gets at = -1, which reads the appended empty end.
        ends = np.append(self.hi, np.uint64(0))
        inside = addresses + np.uint64(nbytes) <= ends[at]
        if not inside.all():
            bad = int(addresses[~inside][0])
            extents = ", ".join(f"[{lo:#x}, {hi:#x})" for lo, hi in zip(self.lo, self.hi))
            raise OutOfBoundsAccess(
                f"{what} of {nbytes} bytes at {bad:#x} ({int((~inside).sum())} such lanes) "
                f"lies outside every tensor argument: {extents}"
            )


@contextlib.contextmanager
def checked_memory_accesses() -> Iterator[None]:
    """Check every interpreted load and store against the launch's tensor arguments."""
    extents = _Extents()
    builder = interpreter.InterpreterBuilder
    executor = interpreter.GridExecutor
    saved = builder.create_masked_load, builder.create_masked_store, executor._init_args_hst
    saved_atomic = builder.create_atomic_rmw

    def init_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = saved[2](self, args_dev, kwargs)
        extents.set_from([*args_hst, *kwargs_hst.values()])
        return args_hst, kwargs_hst

    def load(self, ptrs, mask, other, *rest):
        extents.check("a load", ptrs, mask)
        return saved[0](self, ptrs, mask, other, *rest)

    def store(self, ptrs, value, mask, *rest):
        extents.check("a store", ptrs, mask)
        return saved[1](self, ptrs, value, mask, *rest)

    def atomic_rmw(self, op, ptrs, value, mask, *rest):
        extents.check("an atomic", ptrs, mask)
        return saved_atomic(self, op, ptrs, value, mask, *rest)

    builder.create_masked_load, builder.create_masked_store = load, store
    builder.create_atomic_rmw = atomic_rmw
    executor._init_args_hst = init_args
    try:
        yield
    finally:
        builder.create_masked_load, builder.create_masked_store, executor._init_args_hst = saved
        builder.create_atomic_rmw = saved_atomic
