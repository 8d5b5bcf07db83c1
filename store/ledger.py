"""The store's bookkeeping: which keys exist, their slots, reference counts and recency.

``Ledger.admit`` applies one publication (a batch of keys plus retains and releases) with the
rules of vLLM 0.33.0's ``BlockObjectStore.put``, in its order:

1. batch keys are deduplicated in first-occurrence order; the last occurrence's payload wins;
2. batch keys that are stored and unreferenced are replaced (their slot is freed; they take
   the new payload); referenced ones keep their bytes;
3. retains add one reference per occurrence (a first reference takes a key out of the order);
4. releases drop one reference per occurrence; keys reaching zero are *terminal*, in the order
   they reach it. All releases are checked before anything changes;
5. unreferenced batch keys become most recent in batch order, then terminal keys that are
   stored (or in the batch) in release order;
6. while stored keys (new batch keys included) exceed ``num_slots``, the least recent
   unreferenced keys are evicted, skipping batch keys that are not terminal.

Batch keys that survive are returned as an ``Admission``: the caller gives them slots (and,
when every key is referenced and the ledger holds more than ``num_slots``, grows first).

A key has an *entry* (a ``KeyIndex`` id) while it holds a slot or a reference. Per entry the
ledger keeps ``slot`` (``NO_SLOT``; ``PENDING`` for a batch key counted as stored whose slot
comes after eviction), ``refs``, and its recency stamp (``Recency``). Every per-entry array has
one extra element at the end, a sentinel read through entry id -1 (absent key): ``NO_SLOT``,
zero references, not in order. No bytes live here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from r3capture.store.key_index import KeyIndex
from r3capture.store.keys import key_string
from r3capture.store.positions import positions as _positions
from r3capture.store.recency import Recency
from r3capture.store.slot_pool import SlotPool

NO_SLOT = -1
PENDING = -2
_NO_IDS = np.empty(0, dtype=np.int64)


@dataclass
class Admission:
    """Batch keys that need a slot, in first-occurrence order."""

    entries: np.ndarray  # int64 [m] entry ids
    positions: np.ndarray  # int64 [m] batch position of each one's payload (last occurrence)


class Ledger:
    """Keys -> slots, reference counts and recency, with vLLM 0.33.0's publication rules.

    Args:
        num_slots: how many keys may be stored before eviction.
        pool: receives the slots of replaced and evicted keys, in the order they are freed.
    """

    def __init__(self, num_slots: int, pool: SlotPool) -> None:
        self.num_slots = num_slots
        self.num_stored = 0
        self.index = KeyIndex(entries=64)
        self.recency = Recency(self.index.capacity)
        self.slot = np.full(self.index.capacity + 1, NO_SLOT, dtype=np.int64)
        self.refs = np.zeros(self.index.capacity + 1, dtype=np.int64)
        # Scratch: reference changes of a call (all zero between calls), batch positions.
        self._delta = np.zeros(self.index.capacity + 1, dtype=np.int64)
        self._mark = np.zeros(self.index.capacity + 1, dtype=np.int64)
        self._pool = pool

    def admit(self, batch: np.ndarray, retains: np.ndarray, releases: np.ndarray) -> Admission:
        """Apply one publication (key rows each); see the module docstring. Raises
        ``KeyError`` (nothing changed) if a key is released more often than it is held."""
        n, t = len(batch), len(retains)
        rows = np.concatenate((batch, retains, releases)) if t or len(releases) else batch
        ids, created = self.index.find_or_insert(rows)
        if self.index.capacity >= len(self.slot):
            self._fit()
        held, let = ids[n : n + t], ids[n + t :]
        final = self._check_releases(held, let, created) if len(let) else None
        slot, refs = self.slot, self.refs

        unique, last = self._dedup(ids[:n])
        if n:
            old = slot[unique]
            stored = old >= 0
            kept = np.count_nonzero(stored)
            if not kept:  # all new, or retained before their first publication
                slot[unique] = PENDING
            else:
                replaced = stored & (refs[unique] == 0)
                if np.count_nonzero(replaced):
                    self._pool.push(old[replaced])
                slot[unique[~stored | replaced]] = PENDING
            self.num_stored += len(unique) - kept

        terminal = _NO_IDS
        if final is not None:
            terminal = self._release(held, let, final)
        elif t:
            np.add.at(refs, held, 1)
        if t:
            self.recency.forget(held)
        keep_from = self.recency.clock + 1
        unreferenced = refs[unique] == 0
        if np.count_nonzero(unreferenced):
            self.recency.touch(unique[unreferenced], distinct=True)
        keep_to = self.recency.clock + 1
        if len(terminal):
            stored = slot[terminal] != NO_SLOT
            self.recency.touch(terminal[stored], distinct=True)
            self.index.remove(terminal[~stored])  # no slot, no reference: gone
        excess = self.num_stored - self.num_slots
        if excess > 0:
            # Only a terminal batch key can be evicted before it has a slot.
            self._evict(excess, keep_from, keep_to, pending=n > 0 and len(terminal) > 0)
        if not n:
            return Admission(_NO_IDS, _NO_IDS)
        waiting = slot[unique] == PENDING
        if np.count_nonzero(waiting) == len(unique):
            return Admission(unique, last)
        return Admission(unique[waiting], last[waiting])

    def assign(self, entries: np.ndarray, slots: np.ndarray) -> None:
        """Give admitted entries their slots."""
        self.slot[entries] = slots

    def lookup(self, rows: np.ndarray, *, touch: bool) -> np.ndarray:
        """Slots of ``rows`` (``int64 [n]``; negative where a key is not stored). When every
        key is stored and ``touch``, the unreferenced ones become most recent in order."""
        ids = self.index.find(rows)
        slots = self.slot[ids]
        if touch and np.count_nonzero(slots < 0) == 0:
            self.recency.touch(ids[self.refs[ids] == 0], distinct=False)
        return slots

    def entry(self, row: np.ndarray) -> int:
        """Entry id of one key row, -1 if it has none (no recency change)."""
        return int(self.index.find(row.reshape(1, -1))[0])

    def order(self) -> np.ndarray:
        """Key rows of the stored unreferenced keys, next victim first."""
        return self.index.rows(self.recency.order())

    def _fit(self) -> None:
        """Size the per-entry arrays to the index's entry capacity."""
        size = self.index.capacity + 1
        if size > len(self.slot):
            self.recency.resize(size - 1)
            self.slot = _grown(self.slot, size, NO_SLOT)
            self.refs = _grown(self.refs, size, 0)
            self._delta = _grown(self._delta, size, 0)
            self._mark = _grown(self._mark, size, 0)

    def _dedup(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Distinct ``ids`` in first-occurrence order, and the position of each one's last
        occurrence."""
        positions = _positions(len(ids))
        if len(ids) < 2 or _distinct(ids, positions, self._mark):
            return ids, positions
        distinct, first = np.unique(ids, return_index=True)
        last = len(ids) - 1 - np.unique(ids[::-1], return_index=True)[1]
        order = np.argsort(first)
        return distinct[order], last[order]

    def _check_releases(self, held: np.ndarray, let: np.ndarray, created: np.ndarray) -> np.ndarray:
        """Reference counts the released entries end with (``int64``, one per release).
        Raises ``KeyError`` if one goes negative, after undoing ``created``."""
        delta = self._delta
        if len(held):
            np.add.at(delta, held, 1)
        np.subtract.at(delta, let, 1)
        final = self.refs[let] + delta[let]
        if np.count_nonzero(final < 0):
            delta[held] = 0
            delta[let] = 0
            entry = int(let[np.argmax(final < 0)])
            count = np.count_nonzero(let == entry)
            have = int(self.refs[entry]) + np.count_nonzero(held == entry)
            key = key_string(self.index.rows(entry))
            self.index.remove(created)
            raise KeyError(
                f"release_keys: {key!r} released {count} time(s) but holds {have} reference(s)"
            )
        return final

    def _release(self, held: np.ndarray, let: np.ndarray, final: np.ndarray) -> np.ndarray:
        """Apply the checked retains and releases; return the terminal entries in the order
        they reached zero (each key's last release)."""
        refs, delta = self.refs, self._delta
        changed = np.concatenate((held, let)) if held.size else let
        refs[changed] += delta[changed]  # repeated ids all write the same sum
        delta[changed] = 0
        zero = let[final == 0]
        if _distinct(zero, _positions(len(zero)), self._mark):
            return zero
        # A key repeated here reaches zero at its last release: order by last occurrence.
        distinct, reversed_at = np.unique(zero[::-1], return_index=True)
        return distinct[np.argsort(-reversed_at)]

    def _evict(self, excess: int, keep_from: int, keep_to: int, *, pending: bool) -> None:
        """Evict up to ``excess`` entries; ``pending``: some victims may be PENDING."""
        victims = self.recency.evict(excess, keep_from, keep_to)
        if not victims.size:
            return
        slots = self.slot[victims]
        freed = slots[slots >= 0] if pending else slots  # PENDING victims never had a slot
        if freed.size:
            self._pool.push(freed)
        self.slot[victims] = NO_SLOT
        self.index.remove(victims)
        self.num_stored -= len(victims)


def _distinct(ids: np.ndarray, positions: np.ndarray, scratch: np.ndarray) -> bool:
    """Whether no id repeats: each id writes its position into ``scratch``; a repeated id
    keeps only one of its positions, so another occurrence reads back a different one."""
    scratch[ids] = positions
    return np.count_nonzero(scratch[ids] != positions) == 0


def _grown(array: np.ndarray, size: int, fill: int) -> np.ndarray:
    """``array`` extended to ``size``, new elements (and the moved sentinel) set to ``fill``."""
    grown = np.full(size, fill, dtype=array.dtype)
    grown[: len(array) - 1] = array[:-1]
    return grown
