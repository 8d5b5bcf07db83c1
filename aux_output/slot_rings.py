"""Each request's ring of store slots for its unbound hash blocks, as columns by table row.

The slot of hash block ``b`` of the request at row ``r`` sits at ``ring[r, b % W]``. A ring
holds its request's *unbound* blocks ``base .. end - 1``: blocks complete and get keys in
order, so everything below ``base`` is bound in the store (or was a cached prefix), and the
unbound blocks are one contiguous range of at most ``W`` blocks. The kernel takes the slots
on the device; each commit hands the rings the ones its step took (``extend``), and
publication hands the leading ones over to the store (``take_leading``). ``RequestTable``
owns the rows (``RequestTable.rings``): it grows them and releases a row with its request.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class SlotRings:
    """The slot rings of a table's rows; callers read the columns and change them only
    through the methods.

    Args:
        ring_width: ``W``, most unbound blocks one request can hold.
    """

    def __init__(self, ring_width: int) -> None:
        self.ring_width = int(ring_width)
        self.ring = np.empty((0, self.ring_width), np.int32)
        # base: first unbound block; end: one past the last block with a slot (0 until the
        # request takes its first slots); partial: one past the first captured position
        # when the request's first capture started inside a block (that block is never
        # published), else 0.
        self.base = self.end = self.partial = np.empty(0, np.int64)
        # Rows whose first block is partial (``mark_partial_first``) and not yet dropped.
        self.num_partial = 0

    def grow(self, capacity: int) -> None:
        """Rows up to ``capacity`` (more than now), the new ones without blocks."""
        old = len(self.base)
        for name in ("base", "end", "partial"):
            column = np.zeros(capacity, np.int64)
            column[:old] = getattr(self, name)
            setattr(self, name, column)
        ring = np.full((capacity, self.ring_width), -1, np.int32)
        ring[:old] = self.ring
        self.ring = ring

    def release(self, rows: Sequence[int], per_row: bool) -> np.ndarray:
        """The rows of requests that leave lose their blocks: returns their unbound slots
        (int64) for the caller to free. ``per_row``: ``rows`` are a few ints, read and
        written one by one; else any int sequence, by vector calls."""
        if per_row:
            slots = np.array(self._unbound_slots_each(rows), np.int64)
            if self.num_partial:
                self.num_partial -= sum(self.partial.item(row) > 0 for row in rows)
            for row in rows:
                self.base[row] = self.end[row] = self.partial[row] = 0
            return slots
        taken = np.asarray(rows, np.int64)
        slots = self.unbound_slots(taken)
        if self.num_partial:
            self.num_partial -= int(np.count_nonzero(self.partial[taken]))
        self.base[taken] = self.end[taken] = self.partial[taken] = 0
        return slots

    def extend(
        self, rows: np.ndarray, firsts: np.ndarray, counts: np.ndarray, slots: np.ndarray
    ) -> None:
        """Give each ``rows[i]`` (distinct) the slots of blocks ``firsts[i] ..
        firsts[i] + counts[i] - 1`` from ``slots`` (int64, row by row, block order): the
        blocks its launch took. ``firsts[i]`` is the row's ``end``, or its first block if it
        had none. Raises ``OverflowError`` (before any change) when a request would hold
        more than ``ring_width`` unbound blocks."""
        ends = self.end[rows]
        bases = np.where(ends == 0, firsts, self.base[rows])
        lasts = firsts + counts
        too_wide = lasts - bases > self.ring_width
        if too_wide.any():
            i = int(np.argmax(too_wide))
            raise _ring_overflow(int(lasts[i] - bases[i]), self.ring_width)
        row_of, block = _block_runs(rows, firsts, counts)
        self.ring[row_of, block % self.ring_width] = slots
        self.base[rows] = bases
        self.end[rows] = lasts

    def extend_row(self, row: int, first: int, slots: np.ndarray) -> None:
        """``extend`` for one row (a Python int): blocks ``first ..`` get ``slots`` (int64).
        Raises ``OverflowError`` before changing the row."""
        end = self.end.item(row)
        base = first if end == 0 else self.base.item(row)
        last = first + len(slots)
        width = self.ring_width
        if last - base > width:
            raise _ring_overflow(last - base, width)
        ring = self.ring[row]
        at = first % width
        head = min(len(slots), width - at)
        ring[at : at + head] = slots[:head]
        if head < len(slots):  # the run wraps past the ring's end
            ring[: len(slots) - head] = slots[head:]
        self.base[row] = base
        self.end[row] = last

    def mark_partial_first(self, rows: np.ndarray, first_positions: np.ndarray) -> None:
        """Rows (int64, distinct, each with its first block just taken by ``extend``) whose
        first capture started at ``first_positions`` (int64), inside that block: its earlier
        rows were never captured, so the block is never published; ``drop_partial_first``
        frees it once its rows were returned."""
        self.partial[rows] = first_positions + 1
        self.num_partial += len(rows)

    def partial_start(self, row: int) -> int | None:
        """The first captured position of ``row`` while its partial first block is held."""
        marked = int(self.partial[row]) if self.num_partial else 0
        return marked - 1 if marked else None

    def drop_partial_first(
        self, rows: np.ndarray, done_to: np.ndarray, block_size: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Of ``rows`` (int64, distinct), the partial first blocks whose captured rows are
        all in and returned (``done_to``, int64 ``[len(rows)]``: the lesser of each row's
        cursor and emit cursor, past the block) leave the ring; returns their rows and slots
        (int64), the slots for the store's reserve."""
        marked = self.partial[rows]
        ends = ((marked - 1) // block_size + 1) * block_size  # the partial block's end
        done = (marked > 0) & (done_to >= ends)
        dropped = rows[done]
        if not dropped.size:
            return dropped, NO_SLOTS
        self.partial[dropped] = 0
        self.num_partial -= len(dropped)
        return dropped, self.take_leading(dropped, np.ones(len(dropped), np.int64))

    def take_leading(self, rows: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Hand the first ``counts[i]`` unbound blocks of each ``rows[i]`` (distinct; int64
        arrays) over to the store: returns their slots (int64, row by row, block order) and
        advances ``base``."""
        bases = self.base[rows]
        slots = self._window_slots(rows, bases, counts)
        self.base[rows] = bases + counts
        return slots

    def take_leading_row(self, row: int, count: int) -> np.ndarray:
        """``take_leading`` for one row (Python ints)."""
        base = self.base.item(row)
        width = self.ring_width
        at = base % width
        ring = self.ring[row]
        if at + count <= width:
            slots = ring[at : at + count].astype(np.int64)
        else:
            slots = np.concatenate((ring[at:], ring[: at + count - width])).astype(np.int64)
        self.base[row] = base + count
        return slots

    def _unbound_slots_each(self, rows: Sequence[int]) -> list[int]:
        """``unbound_slots`` of a few ``rows`` (ints) by scalar reads."""
        ring, width = self.ring, self.ring_width
        return [
            ring.item(row, block % width)
            for row in rows
            for block in range(self.base.item(row), self.end.item(row))
        ]

    def unbound_slots(self, rows: np.ndarray) -> np.ndarray:
        """Slots (int64) of the unbound blocks of ``rows``, row by row."""
        base = self.base[rows]
        return self._window_slots(rows, base, np.maximum(self.end[rows] - base, 0))

    def _window_slots(self, rows: np.ndarray, firsts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Slots (int64) of blocks ``firsts[i] .. firsts[i] + counts[i] - 1`` of each
        ``rows[i]`` (int64 arrays; the blocks must lie in the row's ring), row by row."""
        row_of, block = _block_runs(rows, firsts, counts)
        return self.ring[row_of, block % self.ring_width].astype(np.int64)

    def arena_rows(self, rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
        """Arena row (slot * B + offset, int64) of token ``positions[j]`` of ``rows[j]``; the
        position must lie in an unbound block."""
        blocks = positions // block_size
        slots = self.ring[rows, blocks % self.ring_width].astype(np.int64)
        return slots * block_size + positions % block_size


# No slots: what a call that hands none over returns (shared; never written).
NO_SLOTS = np.empty(0, np.int64)


def _ring_overflow(needed: int, width: int) -> OverflowError:
    """The error for a request needing ``needed`` unbound blocks."""
    return OverflowError(
        f"a request needs {needed} unbound hash blocks, more than the slot ring holds ({width})"
    )


def _block_runs(
    rows: np.ndarray, firsts: np.ndarray, counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """For each ``rows[i]``, the blocks ``firsts[i] .. firsts[i] + counts[i] - 1``, flattened:
    ``(row of each block, block index)``, int64."""
    row_of = np.repeat(rows, counts)
    block = np.arange(len(row_of), dtype=np.int64)
    block += np.repeat(firsts - (np.cumsum(counts) - counts), counts)
    return row_of, block
