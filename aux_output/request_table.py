"""Per-request worker state as a struct of arrays, so a step's bookkeeping is vectorized.

One row per live request. Numeric state lives in numpy arrays indexed by row; each row also
owns its store keys (key objects, ``r3capture.store.keys``: one per hash block, in block
order; the same objects from the step their hashes arrive to the request's release) and a
ring of store slots for its unbound blocks (``rings``, ``slot_rings.py``).

The table owns these invariants: callers read its columns, and change state only through its
methods (the step commit's cursors with ``advance``, a finish with ``mark_finished``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from r3capture.aux_output.slot_rings import SlotRings
from r3capture.store import NO_KEY_OBJECTS, KeyObjects, join_key_objects

NO_CURSOR = -1
# Every column's value in a free row.
_FRESH_STATE = (
    ("cursor", NO_CURSOR),
    *((name, 0) for name in ("scheduled", "emit", "num_keys")),
    ("finished", False),
)
# Second form of ``remove``, for a few requests (a decode step finishes one or two): scalar
# reads and writes in place of a dozen vector calls halve such a step's process_output at 8
# decoding requests (host_ab: output p99 0.81 at 8 and 32 requests).
REMOVE_PER_ROW_MAX = 8


class RequestTable:
    """Rows of request state; ``rows(ids)`` maps request ids to row indices.

    Args:
        ring_width: ``W``, most unbound blocks one request can hold.
        capacity: initial number of rows (doubles when full).
    """

    _INT_FIELDS = ("cursor", "scheduled", "emit", "num_keys")

    def __init__(self, ring_width: int, capacity: int = 64) -> None:
        self.rings = SlotRings(ring_width)
        self.index: dict[str, int] = {}
        # Rows added and not yet named by a launch (``take_fresh``): a set, not a bool
        # column, because a launch names few new rows and a column costs vector calls.
        self.unlaunched: set[int] = set()
        self._keys: list[list[bytes]] = []
        self._free_rows: list[int] = []
        self._capacity = 0
        # Bumped whenever the id -> row mapping changes (see ``rows``).
        self.version = 0
        self._rows_cache: dict[str, tuple[int, list[str], np.ndarray]] = {}
        # cursor: end of the captured rows (NO_CURSOR before the first capture); scheduled:
        # end of the last scheduled range; emit: first row not yet returned; num_keys: store
        # keys known (one per hash block).
        self.cursor = self.scheduled = self.emit = self.num_keys = np.empty(0, np.int64)
        # finished: the scheduler finished it.
        self.finished = np.empty(0, bool)
        self._grow(capacity)

    def __len__(self) -> int:
        return len(self.index)

    @property
    def capacity(self) -> int:
        return self._capacity

    def _grow(self, capacity: int) -> None:
        old = self._capacity
        for name in self._INT_FIELDS:
            array = np.zeros(capacity, np.int64)
            array[:old] = getattr(self, name)
            setattr(self, name, array)
        self.cursor[old:] = NO_CURSOR
        finished = np.zeros(capacity, bool)
        finished[:old] = self.finished
        self.finished = finished
        self.rings.grow(capacity)
        self._keys.extend([] for _ in range(capacity - old))
        self._free_rows.extend(range(capacity - 1, old - 1, -1))
        self._capacity = capacity

    # ---------------------------------------------------------------- membership
    def add(self, request_id: str, emit_start: int) -> int:
        """``add_many`` for one request; returns its row."""
        return int(self.add_many([request_id], [emit_start])[0])

    def add_many(self, request_ids: Sequence[str], emit_starts: Sequence[int]) -> np.ndarray:
        """Give each new (distinct, not yet present) request a row with emit cursor
        ``emit_starts[i]``; returns the rows (int64 ``[n]``).

        Free rows are kept in the fresh state (no cursor, nothing scheduled, no blocks, no
        keys, not finished; ``remove`` restores it), so adding writes only the emit column.
        """
        n = len(request_ids)
        free = self._free_rows
        if len(free) < n:
            self._grow(max(2 * self._capacity, self._capacity + n - len(free)))
        taken = free[len(free) - n :][::-1]  # last freed, first taken
        del free[len(free) - n :]
        self.index.update(zip(request_ids, taken))
        self.version += 1
        self.unlaunched.update(taken)
        rows = np.array(taken, np.int64)
        self.emit[rows] = emit_starts
        return rows

    def rows(self, request_ids: list[str], cache: str = "", reuse: str = "") -> np.ndarray:
        """int64 row of each id; ``KeyError`` names an id without state. With a ``cache``
        name, a list equal to the one last looked up under that name, with no request added
        or removed since, returns the same array (steady decode sends the same ids every
        step); ``reuse`` names another cache that may answer first (a batch's ids are its
        step's scheduled ids, in the scheduler's order, whenever the batch changes)."""
        for name in (reuse, cache):
            rows = self.cached_rows(request_ids, name) if name else None
            if rows is not None:
                return rows
        rows = np.fromiter(map(self.index.__getitem__, request_ids), np.int64, len(request_ids))
        if cache:
            self._rows_cache[cache] = (self.version, request_ids, rows)
        return rows

    def cached_rows(self, request_ids: list[str], cache: str) -> np.ndarray | None:
        """What ``rows(request_ids, cache=cache)`` would return from its cache, or None (a
        lookup would be needed, and may raise for an id without state)."""
        cached = self._rows_cache.get(cache)
        if cached is not None and cached[0] == self.version and cached[1] == request_ids:
            return cached[2]
        return None

    def detach(self, request_id: str) -> None:
        """Unname a request's row, which keeps its state until ``remove`` by row."""
        del self.index[request_id]
        self.version += 1

    def remove(self, request_ids: Sequence[str], rows: Sequence[int] | None = None) -> np.ndarray:
        """Drop requests (with ``rows``: the ones at ``rows[i]``, named ``request_ids[i]`` or
        detached); returns their unbound slots (int64) for the caller to free."""
        index = self.index
        if rows is None:
            rows = [index.pop(request_id) for request_id in request_ids]
        else:
            for request_id, row in zip(request_ids, rows):
                if index.get(request_id) == row:
                    del index[request_id]
        self.version += 1
        per_row = len(rows) <= REMOVE_PER_ROW_MAX
        slots = self.rings.release(rows, per_row)
        if per_row:
            for row in rows:
                self._reset(row)
        else:
            self._reset(np.asarray(rows, np.int64))
        for row in rows:
            self._keys[row] = []
        self.unlaunched.difference_update(rows)
        self._free_rows.extend(rows)
        return slots

    def _reset(self, rows: int | np.ndarray) -> None:
        """Back to the fresh state ``add_many`` relies on: one row (an int) or many (int64)."""
        for name, fresh in _FRESH_STATE:
            getattr(self, name)[rows] = fresh

    def clear(self) -> np.ndarray:
        """Drop every request; returns all unbound slots (int64)."""
        return self.remove(list(self.index))

    def live_rows(self) -> np.ndarray:
        """Rows of every live request, in the order the requests were added (int64)."""
        return np.fromiter(self.index.values(), np.int64, len(self.index))

    # ---------------------------------------------------------------- cursors
    def advance(self, rows: np.ndarray, cursor: object, scheduled: object, emit: object) -> None:
        """A committed step's new cursors for ``rows`` (int64, distinct): ``cursor`` (end of
        the captured rows), ``scheduled`` (end of the scheduled range) and ``emit`` (first row
        not yet returned), each an int sequence or array aligned with ``rows``."""
        self.cursor[rows] = cursor
        self.scheduled[rows] = scheduled
        self.emit[rows] = emit

    def mark_finished(self, row: int) -> None:
        """The scheduler finished the request at ``row``; its teardown may wait for steps in
        flight (``StepsInFlight``)."""
        self.finished[row] = True

    # ---------------------------------------------------------------- keys
    def add_keys(self, rows: Sequence[int], keys: KeyObjects, counts: Sequence[int]) -> None:
        """Append ``counts[i]`` consecutive ``keys`` to request ``rows[i]`` (the objects
        themselves: later calls hand the store these same objects)."""
        end = 0
        own, num_keys = self._keys, self.num_keys
        for row, count in zip(rows, counts):
            keys_of_row = own[row]
            keys_of_row.extend(keys[end : end + count])
            end += count
            num_keys[row] = len(keys_of_row)

    def keys_of(self, row: int, first_block: int, end_block: int) -> KeyObjects:
        """Keys of blocks ``first_block .. end_block - 1`` of ``row``."""
        return KeyObjects(self._keys[row][first_block:end_block])

    def release_order(self, rows: Sequence[int]) -> KeyObjects:
        """Every key of ``rows``, each request's reversed (vLLM releases a finished request's
        blocks tail first), concatenated in order."""
        if not rows:
            return NO_KEY_OBJECTS
        return join_key_objects(map(reversed, map(self._keys.__getitem__, rows)))

    # ---------------------------------------------------------------- launches
    @property
    def num_unlaunched(self) -> int:
        """Rows (live or detached) that no launch named yet."""
        return len(self.unlaunched)

    def take_fresh(self, rows: np.ndarray, flags: np.ndarray) -> bool:
        """For a launch of ``rows`` (int64, distinct): whether any of them no launch named
        before (its request index may hold an earlier request's state on the device). If so,
        ``flags[:len(rows)]`` (uint8) says which (1) and they are marked launched; if not
        (at the cost of one test when every live row was launched before), ``flags`` is
        left as it is."""
        unlaunched = self.unlaunched
        if not unlaunched:
            return False
        listed = rows.tolist()
        new = unlaunched.intersection(listed)
        if not new:
            return False
        # Set tests and scalar writes: cheaper than building a bool array and casting it
        # into the flags, on the steps that add requests.
        step_flags = flags[: len(listed)]
        step_flags.fill(0)
        for position, row in enumerate(listed):
            if row in new:
                step_flags[position] = 1
        unlaunched.difference_update(new)
        return True
