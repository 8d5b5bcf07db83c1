"""Per-request worker state as a struct of arrays, so a step's bookkeeping is vectorized.

One row per live request. The numeric cursors live in numpy arrays indexed by row; each row
also owns two Python lists: the request's store keys (one per hash block, in block order)
and the store slots of its *unbound* blocks ``base .. base + len(slots)`` (blocks complete
and get keys in order, so the unbound blocks are always one contiguous range).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

NO_CURSOR = -1


class RequestTable:
    """Rows of request state; ``rows(ids)`` maps request ids to row indices."""

    _INT_FIELDS = (
        "cursor",
        "scheduled",
        "emit",
        "pending",
        "low",
        "base",
        "num_keys",
        "num_slots",
        "tail",
    )

    def __init__(self, capacity: int = 64) -> None:
        self.index: dict[str, int] = {}
        self.keys: list[list[str]] = []
        self.slots: list[list[int]] = []
        self._free_rows: list[int] = []
        self._capacity = 0
        # Bumped whenever the id -> row mapping changes, so callers may cache ``rows(ids)``.
        self.version = 0
        # cursor: capture cursor (NO_CURSOR until the first capture); scheduled: end of the
        # last scheduled range; emit: emit cursor; pending: steps in flight covering the
        # request; low: lowest position the latest prepared step can start at; base: first
        # unbound block; tail: slot of the last unbound block or -1.
        self.cursor = self.scheduled = self.emit = self.pending = np.empty(0, np.int64)
        self.low = np.empty(0, np.int64)
        self.base = self.num_keys = self.num_slots = self.tail = np.empty(0, np.int64)
        self.finished = np.empty(0, bool)
        self._grow(capacity)

    def __len__(self) -> int:
        return len(self.index)

    def _grow(self, capacity: int) -> None:
        old = self._capacity
        for name in self._INT_FIELDS:
            array = np.zeros(capacity, np.int64)
            array[:old] = getattr(self, name)
            setattr(self, name, array)
        finished = np.zeros(capacity, bool)
        finished[:old] = self.finished
        self.finished = finished
        self.keys.extend([] for _ in range(capacity - old))
        self.slots.extend([] for _ in range(capacity - old))
        self._free_rows.extend(range(capacity - 1, old - 1, -1))
        self._capacity = capacity

    def add(self, request_id: str, emit_start: int) -> int:
        if not self._free_rows:
            self._grow(2 * self._capacity)
        row = self._free_rows.pop()
        self.index[request_id] = row
        self.version += 1
        self.cursor[row] = NO_CURSOR
        self.emit[row] = emit_start
        self.scheduled[row] = self.pending[row] = self.base[row] = self.low[row] = 0
        self.num_keys[row] = self.num_slots[row] = 0
        self.tail[row] = -1
        self.finished[row] = False
        self.keys[row] = []
        self.slots[row] = []
        return row

    def rows(self, request_ids: Sequence[str]) -> np.ndarray:
        """int64 row of each id; ``KeyError`` names an id without state."""
        return np.fromiter(map(self.index.__getitem__, request_ids), np.int64, len(request_ids))

    def remove(self, request_id: str) -> list[int]:
        """Drop a request; returns its unbound slots for the caller to free."""
        row = self.index.pop(request_id)
        self.version += 1
        slots = self.slots[row]
        self.keys[row] = []
        self.slots[row] = []
        self._free_rows.append(row)
        return slots

    def clear(self) -> list[int]:
        """Drop every request; returns all unbound slots."""
        slots = [s for row in self.index.values() for s in self.slots[row]]
        for request_id in list(self.index):
            self.remove(request_id)
        return slots

    def keys_added(self, rows: list[int]) -> None:
        """Refresh ``num_keys`` of ``rows`` after their key lists were extended in place."""
        if rows:
            keys = self.keys
            self.num_keys[rows] = [len(keys[row]) for row in rows]

    def handed_over(self, rows: np.ndarray, counts: np.ndarray) -> None:
        """Advance ``base`` of ``rows`` by ``counts`` after the caller removed that many
        leading slots from each row's list (their blocks went to the store)."""
        self.base[rows] += counts
        self.num_slots[rows] -= counts
        emptied = rows[self.num_slots[rows] == 0]
        self.tail[emptied] = -1

    def extend_slots(self, row: int, slots: list[int]) -> None:
        own = self.slots[row]
        own.extend(slots)
        self.num_slots[row] = len(own)
        self.tail[row] = own[-1] if own else -1

    def slot_rows(self, row: int, start: int, end: int, block_size: int) -> np.ndarray:
        """Arena row index of each token position ``start .. end`` (unbound blocks only)."""
        positions = np.arange(start, end, dtype=np.int64)
        own = np.asarray(self.slots[row], dtype=np.int64)
        return own[positions // block_size - self.base[row]] * block_size + positions % block_size
