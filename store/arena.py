"""The store's bytes: one arena of fixed-size slots in host memory, replaced when it grows."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

logger = logging.getLogger(__name__)

_pin_noop_logged = False


class Arena:
    """``uint8 [physical, object_nbytes]`` slots in (optionally page-locked) host memory.

    ``tensor`` and its numpy view ``np`` are replaced by ``grow``, which bumps ``version``;
    ``on_grow()`` runs before the old arena is copied (e.g. to wait for device writes into it).
    ``pin_memory`` without CUDA is a no-op, logged once.
    """

    def __init__(
        self,
        physical: int,
        object_nbytes: int,
        *,
        pin_memory: bool,
        on_grow: Callable[[], None] | None,
    ) -> None:
        if pin_memory and not torch.cuda.is_available():
            global _pin_noop_logged
            if not _pin_noop_logged:
                _pin_noop_logged = True
                logger.info("pin_memory requested but CUDA is not available: arena is not pinned")
            pin_memory = False
        self.object_nbytes = object_nbytes
        self._pin_memory = pin_memory
        self._on_grow = on_grow
        self.tensor = self._new(physical)
        self.np = self.tensor.numpy()
        self.version = 0

    @property
    def physical(self) -> int:
        return self.tensor.shape[0]

    def grow(self, physical: int) -> None:
        """Copy every slot into a new arena of ``physical`` (more) slots."""
        if self._on_grow is not None:
            self._on_grow()
        tensor = self._new(physical)
        fresh = tensor.numpy()
        fresh[: self.physical] = self.np  # numpy: on this thread, not torch's thread pool
        self.tensor, self.np = tensor, fresh
        self.version += 1

    def write(self, slots: list[int], blocks: np.ndarray) -> None:
        """Copy ``blocks`` (uint8 ``[n, object_nbytes]``) into slots ``slots`` (``n`` ints)."""
        if not slots:
            return
        first, n = slots[0], len(slots)
        if slots[-1] - first == n - 1 and slots == list(range(first, first + n)):
            self.np[first : first + n] = blocks  # one run: one slice copy
        else:
            self.np[np.asarray(slots, np.int64)] = blocks

    def gather(self, slots: np.ndarray, out: np.ndarray) -> None:
        """Copy slots ``slots`` (int64 ``[n]``) into ``out`` (uint8 ``[n, object_nbytes]``,
        C-contiguous)."""
        take_rows(self.np, slots, out)

    def _new(self, physical: int) -> torch.Tensor:
        shape = (physical, self.object_nbytes)
        return torch.empty(shape, dtype=torch.uint8, pin_memory=self._pin_memory)


def take_rows(source: np.ndarray, index: np.ndarray, out: np.ndarray) -> None:
    """``out[i] = source[index[i]]`` for rows of a 2-D C-contiguous ``source`` (``index``:
    int64 ``[n]``; ``out``: ``[n, row]`` C-contiguous); ``IndexError`` for an index out of
    range, before anything is copied.

    One memcpy a row on the calling thread. torch's ``index_select`` runs large gathers on
    its thread pool, which waits for every one of its threads: on a busy machine, for one
    that was descheduled (milliseconds). numpy's ``take`` copies a row at a time unless it
    must buffer ``out``, which it does in its default mode; the bounds are checked here
    instead, so its ``clip`` mode never clips."""
    if len(index) and (index.min() < 0 or index.max() >= len(source)):
        bad = index[(index < 0) | (index >= len(source))]
        raise IndexError(f"rows {bad.tolist()[:8]} out of range for {len(source)} rows")
    np.take(source, index, axis=0, out=out, mode="clip")
