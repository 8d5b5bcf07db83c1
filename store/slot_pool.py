"""The arena's physical slots: which are free, and which a producer holds unbound.

Freed slots form a stack. ``take(n)`` hands out the top ``n`` in the order they were pushed, so
a run freed together (one eviction) comes back as the same run and is written with one slice;
never-used slots (from ``next_slot`` up) come after. Slots handed out by ``allocate`` are
*unbound* until the producer binds or frees them: they are never evicted or handed out twice.

A list and a set, not numpy arrays: a step hands a few slots back and forth, and the set
algebra runs in C at any size, where numpy's fixed cost per call would dominate.
"""

from __future__ import annotations

import numpy as np


class SlotPool:
    """Free and unbound slots of an arena of ``physical`` slots."""

    def __init__(self, physical: int) -> None:
        self.physical = physical
        self._free: list[int] = []
        self._next_slot = 0
        self._unbound: set[int] = set()

    @property
    def num_unbound(self) -> int:
        return len(self._unbound)

    def grow(self, physical: int) -> None:
        """The arena now has ``physical`` slots (more than before)."""
        self.physical = physical

    def push(self, slots: list[int]) -> None:
        """Return slots to the free stack, in order."""
        self._free += slots

    def take(self, n: int) -> list[int]:
        """``n`` free slots, the most recently pushed run first."""
        free = self._free
        reused = min(n, len(free))
        slots = free[len(free) - reused :]
        del free[len(free) - reused :]
        if reused < n:
            start = self._next_slot
            self._next_slot = start + n - reused
            assert self._next_slot <= self.physical, "arena overcommitted"
            slots += range(start, self._next_slot)
        return slots

    def allocate(self, n: int) -> np.ndarray:
        """Take ``n`` slots and mark them unbound; ``int64 [n]``."""
        slots = self.take(n)
        self._unbound.update(slots)
        return np.array(slots, dtype=np.int64)

    def check_unbound(self, slots: object) -> list[int]:
        """``slots`` as a list after checking they are distinct unbound slots; ``ValueError``
        (naming the argument) otherwise."""
        arr = np.asarray(slots)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ValueError(f"slots: expected a 1-D integer array, got {arr.shape} {arr.dtype}")
        given = arr.tolist()
        distinct = set(given)
        if not distinct <= self._unbound:
            raise ValueError(f"slots: {sorted(distinct - self._unbound)} are not unbound slots "
                             "from allocate()")  # fmt: skip
        if len(distinct) != len(given):
            raise ValueError(f"slots: each slot may appear once, got {given}")
        return given

    def settle(self, slots: list[int]) -> None:
        """Checked unbound ``slots`` are bound or freed: they leave the producer."""
        self._unbound.difference_update(slots)
