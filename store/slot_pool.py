"""The arena's physical slots: which are free, and which a producer holds unbound.

Freed slots form a stack. ``take(n)`` hands out the top ``n`` in the order they were pushed, so
a run freed together (one eviction) comes back as the same run and is written with one slice;
never-used slots (from ``next_slot`` up) come after. Slots handed out by ``allocate`` are
*unbound* until the producer binds or frees them: they are never evicted or handed out twice.

A list and a set, not numpy arrays: a step hands a few slots back and forth, and the set
algebra runs in C at any size, where numpy's fixed cost per call would dominate. The one
exception is what ``take`` returns: the worker's ``allocate`` runs on the thread that
launches the forward, for up to a whole prefill chunk of slots, so ``take`` builds them as
one numpy range (freed slots written over its head), ``allocate`` hands that array out
read-only, and the set learns of its slots only when the next ``check_unbound`` or
``settle`` needs it, on the thread that binds them.
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
        # Arrays handed out by ``allocate`` and not yet added to ``_unbound``, with their size.
        self._allocated: list[np.ndarray] = []
        self._num_allocated = 0

    @property
    def num_unbound(self) -> int:
        return len(self._unbound) + self._num_allocated

    @property
    def num_free(self) -> int:
        """Freed slots waiting to be taken again (never-used ones not counted)."""
        return len(self._free)

    def grow(self, physical: int) -> None:
        """The arena now has ``physical`` slots (more than before)."""
        self.physical = physical

    def push(self, slots: list[int]) -> None:
        """Return slots to the free stack, in order."""
        self._free += slots

    def take(self, n: int) -> np.ndarray:
        """``n`` free slots (``int64 [n]``): the most recently pushed run first, in the order
        it was pushed, then never-used ones."""
        free = self._free
        reused = min(n, len(free))
        start = self._next_slot
        self._next_slot = start + n - reused
        assert self._next_slot <= self.physical, "arena overcommitted"
        # Never-used slots by one arange, freed ones written over its head.
        slots = np.arange(start - reused, self._next_slot, dtype=np.int64)
        if reused:
            slots[:reused] = free[len(free) - reused :]
            del free[len(free) - reused :]
        return slots

    def allocate(self, n: int) -> np.ndarray:
        """``take(n)``, its slots marked unbound; the array is read-only (the pool keeps it
        until it adds the slots to its unbound set)."""
        slots = self.take(n)
        slots.flags.writeable = False
        self._allocated.append(slots)
        self._num_allocated += n
        return slots

    def _note_allocated(self) -> set[int]:
        """The unbound set, with every slot ``allocate`` handed out since the last call."""
        unbound = self._unbound
        if self._allocated:
            for slots in self._allocated:
                unbound.update(slots.tolist())
            self._allocated.clear()
            self._num_allocated = 0
        return unbound

    def check_unbound(self, slots: object) -> list[int]:
        """``slots`` as a list after checking they are distinct unbound slots; ``ValueError``
        (naming the argument) otherwise."""
        arr = np.asarray(slots)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ValueError(f"slots: expected a 1-D integer array, got {arr.shape} {arr.dtype}")
        given = arr.tolist()
        distinct = set(given)
        unbound = self._note_allocated()
        if not distinct <= unbound:
            raise ValueError(f"slots: {sorted(distinct - unbound)} are not unbound slots "
                             "from allocate()")  # fmt: skip
        if len(distinct) != len(given):
            raise ValueError(f"slots: each slot may appear once, got {given}")
        return given

    def settle(self, slots: list[int]) -> None:
        """Checked unbound ``slots`` are bound or freed: they leave the producer."""
        self._note_allocated().difference_update(slots)
