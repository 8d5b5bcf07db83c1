"""The arena's physical slots: which are free, and which a producer holds unbound.

Freed slots form a stack. ``take(n)`` hands out the top ``n`` in the order they were pushed, so
a run freed together (one eviction) comes back as the same run and is written with one slice;
never-used slots (from ``next_slot`` up) come after. Slots handed out by ``allocate`` are
*unbound* until the producer binds or frees them: they are never evicted or handed out twice.
"""

from __future__ import annotations

import numpy as np

from r3capture.store.positions import positions as _positions


class SlotPool:
    """Free and unbound slots of an arena of ``physical`` slots (all arrays sized to it)."""

    def __init__(self, physical: int) -> None:
        self._free = np.empty(physical, dtype=np.int64)
        self._num_free = 0
        self._next_slot = 0
        self._unbound = np.zeros(physical, dtype=bool)
        self.num_unbound = 0
        self._mark = np.zeros(physical, dtype=np.int64)  # scratch for the distinct check

    @property
    def physical(self) -> int:
        return len(self._unbound)

    def grow(self, physical: int) -> None:
        """The arena now has ``physical`` slots (more than before)."""
        free = np.empty(physical, dtype=np.int64)
        free[: self._num_free] = self._free[: self._num_free]
        unbound = np.zeros(physical, dtype=bool)
        unbound[: len(self._unbound)] = self._unbound
        self._free, self._unbound = free, unbound
        self._mark = np.zeros(physical, dtype=np.int64)

    def push(self, slots: np.ndarray) -> None:
        """Return slots to the free stack, in order."""
        top = self._num_free
        self._free[top : top + len(slots)] = slots
        self._num_free = top + len(slots)

    def take(self, n: int) -> np.ndarray:
        """``n`` free slots (``int64 [n]``), the most recently pushed run first."""
        reused = min(n, self._num_free)
        top = self._num_free - reused
        self._num_free = top
        slots = self._free[top : top + reused]
        if reused == n:
            return slots.copy()
        start = self._next_slot
        self._next_slot = start + n - reused
        assert self._next_slot <= len(self._unbound), "arena overcommitted"
        return np.concatenate((slots, np.arange(start, self._next_slot, dtype=np.int64)))

    def allocate(self, n: int) -> np.ndarray:
        """Take ``n`` slots and mark them unbound."""
        slots = self.take(n)
        self._unbound[slots] = True
        self.num_unbound += n
        return slots

    def check_unbound(self, slots: object) -> np.ndarray:
        """``slots`` as ``int64 [n]`` after checking they are distinct unbound slots;
        ``ValueError`` (naming the argument) otherwise."""
        arr = np.asarray(slots)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ValueError(f"slots: expected a 1-D integer array, got {arr.shape} {arr.dtype}")
        if arr.dtype != np.int64:
            arr = arr.astype(np.int64)
        n = len(arr)
        # Negative slots turn into huge unsigned ones and fail the bounds check with the rest.
        try:
            held = np.count_nonzero(self._unbound[arr.view(np.uint64)])
        except IndexError:
            held = -1
        if held != n:
            stray = sorted(
                {s for s in arr.tolist() if not (0 <= s < len(self._unbound) and self._unbound[s])}
            )
            raise ValueError(f"slots: {stray} are not unbound slots from allocate()")
        # A repeated slot keeps one of its positions in the scratch; another reads it back.
        positions = _positions(n)
        self._mark[arr] = positions
        if np.count_nonzero(self._mark[arr] != positions):
            raise ValueError(f"slots: each slot may appear once, got {arr.tolist()}")
        return arr

    def settle(self, slots: np.ndarray) -> None:
        """Checked unbound ``slots`` are bound or freed: they leave the producer."""
        self._unbound[slots] = False
        self.num_unbound -= len(slots)
