"""Recycled host memory for large output arrays.

A prefix hit or a finished long prefill hands the scheduler megabytes of rows per step. Written
into fresh memory, those bytes cost a page fault per 4 KiB on first touch whenever the
allocator has handed the pages back to the OS; for a step of dozens of megabyte-sized outputs
(Kimi-K2's multi-turn) that more than doubled the step's host time. The pool keeps such buffers
and hands them out again, but only once nothing refers to them any more: every array it returns
is a view of a pool buffer, so while any view (or anything built on one: a slice,
``torch.from_numpy``, a ``memoryview``) is alive the buffer's reference count stays above the
pool's own and the buffer is not reused. Outputs therefore never alias memory that can be
rewritten before their consumer is done with them.

Small arrays (below ``min_nbytes``) come from ``np.empty``: the allocator's free lists already
serve them from mapped memory.
"""

from __future__ import annotations

import math
import sys

import numpy as np

_PAGE = 4096


def _first_idle(buffers: list[np.ndarray], start: int, idle_refcount: int) -> int:
    """Index of the first buffer at or after ``start`` (wrapping) that only the pool holds, or -1.

    The pool calibrates ``idle_refcount`` through this very function, so the references the
    scan itself adds (the list, the loop variable, the call's argument) cancel out.
    """
    n = len(buffers)
    for offset in range(n):
        i = (start + offset) % n
        buffer = buffers[i]
        if sys.getrefcount(buffer) == idle_refcount:
            return i
    return -1


def _calibrate_idle_refcount() -> int:
    probe = [np.empty(0, np.uint8)]
    for count in range(1, 16):
        if _first_idle(probe, 0, count) == 0:
            return count
    raise RuntimeError("could not calibrate reference counts")  # not CPython-like


def _reference_counting_is_exact() -> bool:
    """CPython with the GIL: an object's reference count is exact at any point we read it."""
    if not hasattr(sys, "getrefcount"):
        return False
    gil_enabled = getattr(sys, "_is_gil_enabled", None)
    return gil_enabled is None or bool(gil_enabled())


def _size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to an eighth of its power of two (at most 12.5 % unused)."""
    unit = max(_PAGE, 1 << max(0, (nbytes - 1).bit_length() - 3))
    return -(-nbytes // unit) * unit


class OutputPool:
    """Hands out C-contiguous arrays backed by buffers recycled once no view is alive.

    Args:
        max_bytes: most bytes of buffers the pool may own at once (in use and idle). When a
            new buffer would pass it, idle buffers are dropped first; if that is not enough
            the array is allocated outside the pool. ``0`` disables pooling.
        min_nbytes: arrays smaller than this are plain ``np.empty``.
    """

    def __init__(self, *, max_bytes: int, min_nbytes: int = 256 * 1024) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        if min_nbytes <= 0:
            raise ValueError(f"min_nbytes must be positive, got {min_nbytes}")
        if not _reference_counting_is_exact():
            max_bytes = 0
        self.max_bytes = int(max_bytes)
        self.min_nbytes = int(min_nbytes)
        self._buffers: dict[int, list[np.ndarray]] = {}
        self._owned_bytes = 0
        self._idle_refcount = _calibrate_idle_refcount() if self.max_bytes else 0
        # Per size class, where the next search starts: buffers come back roughly in the
        # order they went out, so a rotating start finds one in O(1).
        self._next: dict[int, int] = {}
        # reused: served from an idle buffer; allocated: a new pool buffer; unpooled: np.empty
        # (too small, pooling off, or over max_bytes).
        self.stats = {"reused": 0, "allocated": 0, "unpooled": 0}

    @property
    def owned_bytes(self) -> int:
        """Bytes of buffers the pool holds, whether handed out or idle."""
        return self._owned_bytes

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An uninitialised C-contiguous array of ``shape`` and ``dtype``."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.min_nbytes or self.max_bytes == 0:
            self.stats["unpooled"] += 1
            return np.empty(shape, dtype)
        size = _size_class(nbytes)
        buffer = self._take_idle(size)
        if buffer is None:
            buffer = self._allocate(size)
            if buffer is None:
                self.stats["unpooled"] += 1
                return np.empty(shape, dtype)
        return buffer[:nbytes].view(dtype).reshape(shape)

    def clear(self) -> None:
        """Forget every buffer; arrays already handed out stay valid (they own a reference)."""
        self._buffers.clear()
        self._next.clear()
        self._owned_bytes = 0

    def _take_idle(self, size: int) -> np.ndarray | None:
        buffers = self._buffers.get(size)
        if not buffers:
            return None
        i = _first_idle(buffers, self._next.get(size, 0), self._idle_refcount)
        if i < 0:
            return None
        self._next[size] = i
        self.stats["reused"] += 1
        return buffers[i]

    def _allocate(self, size: int) -> np.ndarray | None:
        if self._owned_bytes + size > self.max_bytes:
            self._drop_idle(self._owned_bytes + size - self.max_bytes)
            if self._owned_bytes + size > self.max_bytes:
                return None
        buffer = np.empty(size, np.uint8)
        self._buffers.setdefault(size, []).append(buffer)
        self._owned_bytes += size
        self.stats["allocated"] += 1
        return buffer

    def _drop_idle(self, needed: int) -> None:
        """Let go of idle buffers, largest classes first, until ``needed`` bytes are freed."""
        for size in sorted(self._buffers, reverse=True):
            buffers = self._buffers[size]
            i = _first_idle(buffers, 0, self._idle_refcount)
            while i >= 0 and needed > 0:
                del buffers[i]
                needed -= size
                self._owned_bytes -= size
                i = _first_idle(buffers, i, self._idle_refcount) if buffers else -1
            if not buffers:
                del self._buffers[size]
                self._next.pop(size, None)
            if needed <= 0:
                return
