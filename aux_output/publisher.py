"""Publication: hand complete, keyed blocks to the store, with the scheduler's pins.

A block is published once it is complete (the request's capture cursor passed its end) and
its key has arrived; both happen in block order, so each request publishes a prefix of its
unbound blocks. Publication binds the slot the kernel already filled to the key: no bytes
move. Each store call folds in a step's reference changes (retained keys first, then
released ones, as vLLM's store applies them), so the store sees exactly vLLM's sequence of
updates.

``publish`` decides on the spot which blocks leave the request table, but only queues the
store call; ``flush`` applies the queued calls in order, on the output thread (a step's key
work publishes there too, ``key_work.py``; only a prefix-cache reset in ``begin_step``
publishes on the main thread), as vLLM's store work waits for its writer thread; whoever
reads the store flushes first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from r3capture.aux_output.request_table import RequestTable
from r3capture.aux_output.slot_rings import NO_SLOTS
from r3capture.store import NO_KEY_OBJECTS, BlockStore, KeyObjects, join_key_objects

_NO_ROWS = np.empty(0, np.int64)
# Second form, for a few rows (a decode step publishes a block or two): a loop over them cuts
# the output thread's total by a tenth at 1-8 decoding requests (host_ab).
PER_ROW_MAX = 8


class Publisher:
    """Queues and applies the store calls of publication; frees slots of torn-down requests."""

    def __init__(self, store: BlockStore, table: RequestTable, block_size: int) -> None:
        self._store = store
        self._table = table
        self._block_size = block_size
        self._queued: list[tuple[KeyObjects, np.ndarray, KeyObjects, KeyObjects]] = []

    def publish(
        self,
        rows: np.ndarray | list[int] = _NO_ROWS,
        retain_keys: KeyObjects = NO_KEY_OBJECTS,
        release_keys: KeyObjects = NO_KEY_OBJECTS,
        *,
        finished: Sequence[str] = (),
        finished_rows: Sequence[int] | None = None,
    ) -> None:
        """Take every complete, keyed, unbound block of table ``rows`` (distinct; int64 or a
        list of ints) out of the table and queue one store call that binds them and applies
        ``retain_keys`` then ``release_keys``.

        Then the teardown of the requests ``finished`` (at ``finished_rows`` when given, for
        a row no longer named by its id): every key of theirs is released in the same call,
        after ``release_keys`` and each request's tail first, as vLLM releases a finished
        request's blocks; they leave the table and their unbound slots return to the store's
        reserve. Every teardown goes through here."""
        table = self._table
        if finished:
            if finished_rows is None:
                finished_rows = [table.index[request_id] for request_id in finished]
            release_keys = join_keys((release_keys, table.release_order(finished_rows)))
        keys, slots = NO_KEY_OBJECTS, NO_SLOTS
        if 0 < len(rows) <= PER_ROW_MAX:
            keys, slots = self._take_ready_per_row(rows if type(rows) is list else rows.tolist())
        elif len(rows):
            rows = np.asarray(rows, np.int64)
            # A request without a cursor (-1) gets min(.., -1) - base < 0: nothing ready.
            cursor_blocks = table.cursor[rows] // self._block_size
            ready = np.minimum(table.num_keys[rows], cursor_blocks) - table.rings.base[rows]
            if table.rings.num_partial:
                # A partial first block (P/D decoders) is never published, and blocks
                # come out in order: nothing until it leaves (``RequestBook.commit``).
                ready[table.rings.partial[rows] > 0] = 0
            chosen = (ready > 0).nonzero()[0]
            if chosen.size:
                rows, ready = rows[chosen], ready[chosen]
                bases = table.rings.base[rows]
                parts = [
                    table.keys_of(row, base, base + count)
                    for row, base, count in zip(rows.tolist(), bases.tolist(), ready.tolist())
                ]
                keys = join_key_objects(parts) if len(parts) > 1 else parts[0]
                slots = table.rings.take_leading(rows, ready)
        if len(keys) or len(retain_keys) or len(release_keys):
            self._queued.append((keys, slots, retain_keys, release_keys))
        if finished:
            self.free(table.remove(finished, finished_rows))

    def _take_ready_per_row(self, rows: list[int]) -> tuple[KeyObjects, np.ndarray]:
        """``publish``'s choice for a few ``rows``, row by row: the keys and slots (int64)
        of their ready blocks, taken out of the table."""
        table, block_size = self._table, self._block_size
        key_parts, slot_parts = [], []
        for row in rows:
            base = table.rings.base.item(row)
            ready = min(table.num_keys.item(row), table.cursor.item(row) // block_size) - base
            if ready > 0 and not (table.rings.num_partial and table.rings.partial.item(row)):
                key_parts.append(table.keys_of(row, base, base + ready))
                slot_parts.append(table.rings.take_leading_row(row, ready))
        if not key_parts:
            return NO_KEY_OBJECTS, NO_SLOTS
        if len(key_parts) == 1:
            return key_parts[0], slot_parts[0]
        return join_key_objects(key_parts), np.concatenate(slot_parts)

    def flush(self) -> None:
        """Apply every queued store call, in the order it was queued. A call that only
        retains (a step's new keys, before their blocks are complete) rides on the next
        call as its first retains: the same store updates in one call, where a decode step
        that completes a block would otherwise make two."""
        queued, self._queued = self._queued, []
        first: KeyObjects = NO_KEY_OBJECTS
        last = len(queued) - 1
        for i, (keys, slots, retain_keys, release_keys) in enumerate(queued):
            if i < last and not len(keys) and not len(release_keys):
                first = join_keys((first, retain_keys))
                continue
            self._store.bind(
                keys,
                slots,
                retain_keys=retain_keys,
                release_keys=release_keys,
                retain_first_keys=first,
            )
            first = NO_KEY_OBJECTS

    def free(self, slots: np.ndarray) -> None:
        """Return unbound slots (int64) of requests that are gone to the store's reserve."""
        if len(slots):
            self._store.free(slots)


def join_keys(parts: Iterable[KeyObjects]) -> KeyObjects:
    """``parts`` concatenated in order, empty ones left out (a single part as it is)."""
    parts = [part for part in parts if len(part)]
    if not parts:
        return NO_KEY_OBJECTS
    return parts[0] if len(parts) == 1 else join_key_objects(parts)
