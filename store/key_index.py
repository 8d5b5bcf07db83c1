"""Open-addressing hash map from key rows to dense entry ids, in batches.

Every operation takes a whole batch of key rows (``uint64 [n, KEY_WORDS]``, see keys.py) and
runs as a fixed number of numpy operations plus one short loop per probe round; no Python runs
per key. Entry ids are small dense integers (recycled after ``remove``), so the store keeps its
per-key state (slot, reference count, recency) in flat arrays indexed by entry id.

Layout: a power-of-two table of buckets holding an entry id, ``EMPTY`` or ``TOMBSTONE``, with
linear probing from a key's home bucket. The home bucket is the top bits of a hash that mixes
all five words (an odd multiplier per word, then two xor-shift-multiply rounds), so hashes that
differ only in a few bytes (a counter in the last byte) still spread over the table. A hit is
confirmed by comparing the full row. ``remove`` leaves a tombstone; inserts reuse tombstones, and
the table is rebuilt when live entries plus tombstones pass half of it (or live entries fall
below a sixteenth of it), so probe sequences stay short and the table stays within a constant
factor of the live entries.
"""

from __future__ import annotations

import numpy as np

from r3capture.store.keys import KEY_WORDS

EMPTY = -1
TOMBSTONE = -2
MIN_BUCKETS = 16

_MAX_LOAD = 2  # rebuild when (live + tombstones) * _MAX_LOAD > buckets
_SHRINK_LOAD = 16  # rebuild smaller when live * _SHRINK_LOAD < buckets
_SPARE = 4  # a rebuilt table has about _SPARE buckets per live entry

# One odd multiplier per word, then the splitmix64 finalizer's constants. 0-d arrays keep the
# arithmetic in uint64 without the cost of converting a Python int on every call.
_WORD_MULTIPLIERS = np.array(
    [
        0x9E3779B97F4A7C15,
        0xC2B2AE3D27D4EB4F,
        0x165667B19E3779F9,
        0xD6E8FEB86659FD93,
        0xFF51AFD7ED558CCD,
    ],
    dtype=np.uint64,
)
_MIX_1 = np.array(0xBF58476D1CE4E5B9, dtype=np.uint64)
_MIX_2 = np.array(0x94D049BB133111EB, dtype=np.uint64)
_SHIFT_30 = np.array(30, dtype=np.uint64)
_SHIFT_27 = np.array(27, dtype=np.uint64)
_ONES = np.ones(KEY_WORDS, dtype=np.uint8)
_NO_IDS = np.empty(0, dtype=np.int64)
assert len(_WORD_MULTIPLIERS) == KEY_WORDS


def bucket_hash(rows: np.ndarray) -> np.ndarray:
    """64-bit hash (``uint64 [n]``) of key rows; a table of ``2**b`` buckets uses its top
    ``b`` bits."""
    h = rows @ _WORD_MULTIPLIERS
    h ^= h >> _SHIFT_30
    h *= _MIX_1
    h ^= h >> _SHIFT_27
    h *= _MIX_2
    return h


def rows_equal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise equality of two ``uint64 [n, KEY_WORDS]`` arrays (``bool [n]``)."""
    return ((a == b).view(np.uint8) @ _ONES) == KEY_WORDS


class KeyIndex:
    """Key rows -> entry ids. Batch ``find``, ``find_or_insert`` and ``remove``.

    Args:
        entries: initial entry capacity (grows by doubling).
        buckets: initial table size, a power of two >= ``MIN_BUCKETS``.
    """

    def __init__(self, entries: int = 16, buckets: int = MIN_BUCKETS) -> None:
        assert buckets >= MIN_BUCKETS and buckets & (buckets - 1) == 0, buckets
        entries = max(int(entries), 1)
        self._rows = np.zeros((entries, KEY_WORDS), dtype=np.uint64)  # entry -> key row
        self._bucket_of = np.zeros(entries, dtype=np.int64)  # entry -> its bucket
        # Free entry ids, a stack whose top is the end; ids 0, 1, 2, ... come out first.
        self._free_ids = np.arange(entries - 1, -1, -1, dtype=np.int64)
        self._num_free = entries
        self._table = np.full(buckets, EMPTY, dtype=np.int64)
        self._shift = np.array(64 - buckets.bit_length() + 1, dtype=np.uint64)
        self._live = 0
        self._tombstones = 0

    def __len__(self) -> int:
        return self._live

    @property
    def capacity(self) -> int:
        """Entry ids are ``0 .. capacity - 1``; per-entry side tables must be this long."""
        return len(self._rows)

    @property
    def num_buckets(self) -> int:
        return len(self._table)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Key rows of live entry ids."""
        return self._rows[ids]

    def find(self, rows: np.ndarray) -> np.ndarray:
        """Entry id of each row (``int64 [n]``), ``EMPTY`` (-1) where the key is absent."""
        if not len(rows):
            return _NO_IDS.copy()
        return self._find(rows, self._home(rows))

    def find_or_insert(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Entry id of each row, inserting absent keys (a key repeated in ``rows`` gets one
        entry). Returns ``(ids, created)``: ``created`` lists the new entry ids."""
        ids = self.find(rows)
        missing = (ids < 0).nonzero()[0]
        if not missing.size:
            return ids, _NO_IDS
        ids[missing], created = self._insert(rows[missing])
        return ids, created

    def remove(self, ids: np.ndarray) -> None:
        """Remove distinct live entries; their ids become free for reuse."""
        if not len(ids):
            return
        self._table[self._bucket_of[ids]] = TOMBSTONE
        self._tombstones += len(ids)
        self._live -= len(ids)
        self._push_free(ids)
        if len(self._table) > MIN_BUCKETS and self._live * _SHRINK_LOAD < len(self._table):
            self._rebuild(self._live)

    def _home(self, rows: np.ndarray) -> np.ndarray:
        return (bucket_hash(rows) >> self._shift).view(np.int64)

    def _find(self, rows: np.ndarray, pos: np.ndarray) -> np.ndarray:
        table, stored = self._table, self._rows
        ids = table[pos]
        # EMPTY/TOMBSTONE index the last rows here; the sign test below discards those.
        same = stored[ids] == rows
        if np.count_nonzero(same) == same.size and np.count_nonzero(ids < 0) == 0:
            return ids  # every key in its home bucket: the common case for a hit
        hit = ((same.view(np.uint8) @ _ONES) == KEY_WORDS) & (ids >= 0)
        found = np.where(hit, ids, EMPTY)
        # Probe on past tombstones and other keys; an empty bucket ends a key's search.
        active = (~hit & (ids != EMPTY)).nonzero()[0]
        wrap = len(table) - 1
        while active.size:
            at = (pos[active] + 1) & wrap
            pos[active] = at
            ids = table[at]
            hit = rows_equal(stored[ids], rows[active]) & (ids >= 0)
            found[active[hit]] = ids[hit]
            active = active[~hit & (ids != EMPTY)]
        return found

    def _insert(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Insert absent keys (repeats allowed); return (id per row, created ids)."""
        m = len(rows)
        if (self._live + self._tombstones + m) * _MAX_LOAD > len(self._table):
            self._rebuild(self._live + m)
        new = self._take_ids(m)
        self._rows[new] = rows
        ids, created = self._place(new, self._home(rows))
        if len(created) < m:
            # A key repeated in the batch took one entry; its other ids go back unused.
            self._push_free(np.setdiff1d(new, created, assume_unique=True))
        self._live += len(created)
        return ids, created

    def _place(self, new: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Claim a free bucket for each entry of ``new`` (rows already written), probing
        from ``pos``. Entries whose row equals that of an entry placed in the same round
        (the same key twice) take that entry's id instead. Returns (ids, placed entries)."""
        table, stored = self._table, self._rows
        wrap = len(table) - 1
        ids = new.copy()
        placed = []
        pending = np.arange(len(new))
        while pending.size:
            at = pos[pending]
            before = table[at]
            free = before < 0
            claim, at = pending[free], at[free]
            table[at] = new[claim]
            owner = table[at]  # one claimant per bucket wins, whichever numpy wrote last
            won = owner == new[claim]
            self._tombstones -= np.count_nonzero(before[free][won] == TOMBSTONE)
            self._bucket_of[new[claim[won]]] = at[won]
            placed.append(new[claim[won]])
            lost, owner = claim[~won], owner[~won]
            twin = rows_equal(stored[owner], stored[new[lost]])
            ids[lost[twin]] = owner[twin]
            # Twins move in lockstep (same home, same sequence), so a twin is always met in
            # the round its first copy is placed; everyone else moves one bucket on.
            pending = np.concatenate((pending[~free], lost[~twin]))
            pos[pending] = (pos[pending] + 1) & wrap
        return ids, np.concatenate(placed)

    def _rebuild(self, live: int) -> None:
        """New table of about ``_SPARE`` buckets per live entry; tombstones are dropped."""
        buckets = max(MIN_BUCKETS, 1 << (max(live, 1) * _SPARE - 1).bit_length())
        entries = self._table[self._table >= 0]
        self._table = np.full(buckets, EMPTY, dtype=np.int64)
        self._shift = np.array(64 - buckets.bit_length() + 1, dtype=np.uint64)
        self._tombstones = 0
        if entries.size:
            self._place(entries, self._home(self._rows[entries]))

    def _take_ids(self, m: int) -> np.ndarray:
        if self._num_free < m:
            self._grow_entries(m - self._num_free)
        top = self._num_free
        self._num_free = top - m
        return self._free_ids[top - m : top].copy()

    def _push_free(self, ids: np.ndarray) -> None:
        top = self._num_free
        self._free_ids[top : top + len(ids)] = ids
        self._num_free = top + len(ids)

    def _grow_entries(self, extra: int) -> None:
        old = len(self._rows)
        size = max(2 * old, old + extra)
        rows = np.zeros((size, KEY_WORDS), dtype=np.uint64)
        rows[:old] = self._rows
        bucket_of = np.zeros(size, dtype=np.int64)
        bucket_of[:old] = self._bucket_of
        free_ids = np.empty(size, dtype=np.int64)
        free_ids[: self._num_free] = self._free_ids[: self._num_free]
        self._rows, self._bucket_of, self._free_ids = rows, bucket_of, free_ids
        self._push_free(np.arange(size - 1, old - 1, -1, dtype=np.int64))
