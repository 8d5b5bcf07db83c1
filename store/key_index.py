"""Open-addressing hash map from key rows to dense entry ids, in batches.

Every operation takes a whole batch of key rows (``uint64 [n, KEY_WORDS]``, see keys.py) and
runs as a fixed number of numpy operations plus a short loop over probe windows; no Python runs
per key. Entry ids are small dense integers (recycled after ``remove``), so the store keeps its
per-key state (slot, reference count, recency) in flat arrays indexed by entry id.

Layout: a power-of-two table of buckets, linear probing from a key's home bucket. Each bucket
holds a fingerprint (0 when empty, else the occupant's hash with the low bit set), the
occupant's entry id, and its *reach*: how far past it the keys that call it home were placed
(at most; 0 when all of them sit in it). The hash mixes all five words (an odd multiplier per
word, then a xor-shift-multiply round, so every input bit reaches the top bits); the home bucket
is its top bits, so keys that differ in one byte (a counter in the last byte of the hash) spread
over the table as evenly as random ones.

A lookup compares fingerprints at the home bucket; only keys whose home has a reach look
further, all of them at once over as many buckets as the largest of those reaches (a handful at
this load). So a miss usually costs one bucket, and a removal simply empties its bucket (a
lookup never stops at an empty bucket, so no tombstones are needed). Every fingerprint hit is
confirmed by comparing the full row; a fingerprint shared by two rows (a 64-bit hash collision)
falls back to comparing rows bucket by bucket.

Reaches only grow between rebuilds. The table is rebuilt (to about eight buckets per live
entry) when live entries plus the removals since the last rebuild (counted like tombstones)
pass a quarter of it, or when live entries fall below a thirty-second of it. So at most a
quarter of the buckets are taken: about one key in eight sits past its home, probe reaches stay
short, and the table stays within a constant factor of the live entries (4 to 32 buckets of 24
bytes per live entry).
"""

from __future__ import annotations

import numpy as np

from r3capture.store.keys import KEY_WORDS
from r3capture.store.positions import positions as _positions

MIN_BUCKETS = 16
_SPAN = 64  # most buckets looked at per key and probe round past the home bucket

_ABSENT = -1
_EMPTY = np.uint64(0)
_MAX_LOAD = 4  # rebuild when (live + removed) * _MAX_LOAD > buckets
_SHRINK_LOAD = 32  # rebuild smaller when live * _SHRINK_LOAD < buckets
_SPARE = 8  # a rebuilt table has about _SPARE buckets per live entry

# One odd multiplier per word, then a multiplier from the splitmix64 finalizer. 0-d arrays keep
# the arithmetic in uint64 without converting a Python int on every call.
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
_MIX = np.array(0xBF58476D1CE4E5B9, dtype=np.uint64)
_HALF = np.array(32, dtype=np.uint64)
_ONE = np.array(1, dtype=np.uint64)
_ONES = np.ones(KEY_WORDS, dtype=np.uint8)
_NO_IDS = np.empty(0, dtype=np.int64)
assert len(_WORD_MULTIPLIERS) == KEY_WORDS


def bucket_hash(rows: np.ndarray) -> np.ndarray:
    """64-bit hash (``uint64 [n]``) of key rows; a table of ``2**b`` buckets homes a key at
    the hash's top ``b`` bits."""
    h = rows @ _WORD_MULTIPLIERS
    h ^= h >> _HALF
    h *= _MIX
    return h


def _rows_equal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise equality of two ``uint64 [m, KEY_WORDS]`` arrays (``bool [m]``)."""
    return ((a == b).view(np.uint8) @ _ONES) == KEY_WORDS


def _rows_differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """How many words differ per row (``uint8 [m]``; 0 where the rows are equal)."""
    return (a != b).view(np.uint8) @ _ONES


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
        self._live = 0
        self._new_table(buckets)

    def __len__(self) -> int:
        return self._live

    @property
    def capacity(self) -> int:
        """Entry ids are ``0 .. capacity - 1``; per-entry side tables must be this long."""
        return len(self._rows)

    @property
    def num_buckets(self) -> int:
        return len(self._fp)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Key rows of live entry ids."""
        return self._rows[ids]

    def find(self, rows: np.ndarray) -> np.ndarray:
        """Entry id of each row (``int64 [n]``), -1 where the key is absent."""
        h = bucket_hash(rows)
        return self._find(rows, h | _ONE, (h >> self._shift).view(np.int64))

    def find_or_insert(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Entry id of each row, inserting absent keys (a key repeated in ``rows`` gets one
        entry). Returns ``(ids, created)``: ``created`` lists the new entry ids."""
        h = bucket_hash(rows)
        fq = h | _ONE
        home = (h >> self._shift).view(np.int64)
        ids = self._find(rows, fq, home)
        missing = (ids < 0).nonzero()[0]
        if not missing.size:
            return ids, _NO_IDS
        m = len(missing)
        fq = fq[missing]
        if (self._live + self._removed + m) * _MAX_LOAD > len(self._fp):
            self._rebuild(self._live + m)
            home = self._home(fq)
        else:
            home = home[missing]
        new = self._take_ids(m)
        self._rows[new] = np.take(rows, missing, axis=0)
        placed, created = self._place(new, fq, home, self._next_free(home.copy()))
        if len(created) < m:
            # A key repeated in the batch took one entry; its other ids go back unused.
            self._push_free(np.setdiff1d(new, created, assume_unique=True))
        self._live += len(created)
        ids[missing] = placed
        return ids, created

    def remove(self, ids: np.ndarray) -> None:
        """Remove distinct live entries; their ids become free for reuse."""
        if not len(ids):
            return
        self._fp[self._bucket_of[ids]] = _EMPTY
        self._removed += len(ids)
        self._live -= len(ids)
        self._push_free(ids)
        if len(self._fp) > MIN_BUCKETS and self._live * _SHRINK_LOAD < len(self._fp):
            self._rebuild(self._live)

    def _home(self, fq: np.ndarray) -> np.ndarray:
        # The fingerprint's low bit is below the home's bits.
        return (fq >> self._shift).view(np.int64)

    def _find(self, rows: np.ndarray, fq: np.ndarray, home: np.ndarray) -> np.ndarray:
        hit = self._fp[home] == fq
        found = self._ids[home]
        # Every fingerprint hit is confirmed with the full row (np.take gathers rows several
        # times faster than [] does).
        if np.count_nonzero(hit) == len(rows):  # every key in its home bucket: usual for hits
            same = np.count_nonzero(np.take(self._rows, found, axis=0) != rows) == 0
        else:
            found[~hit] = _ABSENT
            # Only a home with a reach can have its keys elsewhere: a new key's rarely does.
            reach = self._reach[home]
            far = (~hit & (reach > 0)).nonzero()[0]
            if far.size:
                key, ids = self._probe(fq[far], home[far], reach[far])
                found[far[key]] = ids
            differs = _rows_differ(np.take(self._rows, found, axis=0), rows)
            same = np.count_nonzero(differs[found >= 0]) == 0
        return found if same else self._find_exact(rows, home)

    def _probe(
        self, fq: np.ndarray, home: np.ndarray, reach: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Keys not in their home bucket, looked for in the buckets past it, as far as the
        largest ``reach`` among them: one window per key (``_SPAN`` buckets per round).
        Returns (positions in ``fq`` of the keys found, their entry ids)."""
        fp, wrap = self._fp, len(self._fp) - 1
        span = int(reach.max())
        keys, founds = [], []
        for first in range(1, span + 1, _SPAN):
            offsets = _positions(min(span, first + _SPAN - 1) + 1)[first:]
            window = (home[:, None] + offsets) & wrap  # [m, span]
            key, col = (fp[window] == fq[:, None]).nonzero()
            keys.append(key)
            founds.append(self._ids[window[key, col]])
        if len(keys) == 1:
            return keys[0], founds[0]
        return np.concatenate(keys), np.concatenate(founds)

    def _next_free(self, start: np.ndarray) -> np.ndarray:
        """First empty bucket from ``start`` on (inclusive), per key."""
        fp, wrap = self._fp, len(self._fp) - 1
        taken = fp[start] != _EMPTY
        if not np.count_nonzero(taken):
            return start  # every start is empty: the usual case at half load or less
        free = start.copy()
        todo = taken.nonzero()[0]
        while todo.size:
            at = (free[todo] + 1) & wrap
            free[todo] = at
            todo = todo[fp[at] != _EMPTY]
        return free

    def _find_exact(self, rows: np.ndarray, home: np.ndarray) -> np.ndarray:
        """Compare full rows at every bucket of each key's reach (after a fingerprint was
        shared by two rows)."""
        fp, ids, stored, wrap = self._fp, self._ids, self._rows, len(self._fp) - 1
        found = np.full(len(rows), _ABSENT, dtype=np.int64)
        todo, at, left = np.arange(len(rows)), home.copy(), self._reach[home]
        while todo.size:
            same = (fp[at] != _EMPTY) & _rows_equal(np.take(stored, ids[at], axis=0), rows[todo])
            found[todo[same]] = ids[at[same]]
            more = ~same & (left > 0)
            todo, at, left = todo[more], (at[more] + 1) & wrap, left[more] - 1
        return found

    def _place(
        self, new: np.ndarray, fq: np.ndarray, home: np.ndarray, at: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Put entries ``new`` (rows written, fingerprints ``fq``, home buckets ``home``)
        into the table, trying empty buckets ``at`` first. An entry whose row equals that of
        an entry placed in the same round (the same key twice) takes that entry's id
        instead. Returns (id per entry, entries placed)."""
        table, stored, wrap = self._ids, self._rows, len(self._fp) - 1
        ids = new.copy()
        placed = []
        where = np.arange(len(new))  # position in ids of each entry still to place
        while True:
            table[at] = new
            owner = table[at]  # one claimant per bucket wins, whichever numpy wrote last
            won = owner == new
            if np.count_nonzero(won) == len(new):
                self._settle(new, fq, home, at)
                placed.append(new)
                return ids, np.concatenate(placed) if len(placed) > 1 else new
            self._settle(new[won], fq[won], home[won], at[won])
            placed.append(new[won])
            lost = (~won).nonzero()[0]
            twin = _rows_equal(
                np.take(stored, owner[lost], axis=0), np.take(stored, new[lost], axis=0)
            )
            ids[where[lost[twin]]] = owner[lost[twin]]
            # Twins share a home and a probe sequence, so they always meet in the round the
            # first copy is placed; every other loser moves on to the next empty bucket.
            retry = lost[~twin]
            if not len(retry):
                return ids, np.concatenate(placed)
            new, fq, home, where = new[retry], fq[retry], home[retry], where[retry]
            at = self._next_free((at[retry] + 1) & wrap)

    def _settle(self, new: np.ndarray, fq: np.ndarray, home: np.ndarray, at: np.ndarray) -> None:
        """Entries ``new`` own buckets ``at``: fingerprints, back links, home reaches."""
        self._fp[at] = fq
        self._bucket_of[new] = at
        away = (at - home) & (len(self._fp) - 1)
        if np.count_nonzero(away):
            np.maximum.at(self._reach, home, away)

    def _new_table(self, buckets: int) -> None:
        self._fp = np.zeros(buckets, dtype=np.uint64)
        self._ids = np.zeros(buckets, dtype=np.int64)
        self._reach = np.zeros(buckets, dtype=np.int64)
        self._shift = np.array(64 - buckets.bit_length() + 1, dtype=np.uint64)
        self._removed = 0

    def _rebuild(self, live: int) -> None:
        """New table of about ``_SPARE`` buckets per live entry; reaches start afresh."""
        buckets = max(MIN_BUCKETS, 1 << (max(live, 1) * _SPARE - 1).bit_length())
        occupied = self._fp != _EMPTY
        entries, fq = self._ids[occupied], self._fp[occupied]
        self._new_table(buckets)
        if entries.size:
            home = self._home(fq)
            self._place(entries, fq, home, self._next_free(home.copy()))

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
