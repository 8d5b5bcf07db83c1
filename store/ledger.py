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

Batch keys that survive are returned as an ``Admission``; the caller gives them slots with
``assign`` (after growing the arena when every key is referenced and more are stored than
``num_slots``).

Keys are key objects (``keys.py``: one 40-byte ``bytes`` per key row); a table holds the first
object it met for a key. Mechanism, measured against a vectorized (numpy) open-addressing
index: every table is a dict (recency an ``OrderedDict``) driven through ``map``/``filter``/set
algebra, so the per-key work runs in C with a small fixed cost a call. The numpy index took
~150 numpy calls a call: several times slower for the handful of keys of a decode step, and
faster only beyond a few hundred keys (``bench.run store``). Keys are exact: no fingerprints,
so no collisions. No bytes live here.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import compress, filterfalse, islice, repeat
from operator import add, sub

import numpy as np

from r3capture.store.keys import key_object_string, rows_of_key_objects
from r3capture.store.slot_pool import SlotPool

PENDING = -2  # a batch key counted as stored, whose slot comes after eviction
_NO_POSITIONS = np.empty(0, np.int64)
_NO_POSITIONS.flags.writeable = False


@dataclass
class Admission:
    """Batch keys that need a slot, in first-occurrence order."""

    keys: list[bytes]
    # int64 [m] batch position of each one's payload (last occurrence); None when every batch
    # key is admitted, in batch order (the common case, which then needs no array).
    positions: np.ndarray | None


class Ledger:
    """Keys -> slots, reference counts and recency, with vLLM 0.33.0's publication rules.

    Args:
        num_slots: how many keys may be stored before eviction.
        pool: receives the slots of replaced and evicted keys, in the order they are freed.
    """

    def __init__(self, num_slots: int, pool: SlotPool) -> None:
        self.num_slots = num_slots
        self._pool = pool
        self._slots: dict[bytes, int] = {}
        # Stored unreferenced keys, next victim first. An OrderedDict, not a dict: evicting
        # from the head of a dict leaves dead entries every later scan walks over.
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self._refs: dict[bytes, int] = {}

    @property
    def num_stored(self) -> int:
        return len(self._slots)

    def admit(
        self,
        keys: Sequence[bytes],
        retained: Sequence[bytes],
        released: Sequence[bytes],
        retained_first: Sequence[bytes] = (),
    ) -> Admission:
        """Apply one publication (key objects each); see the module docstring.
        ``retained_first`` are retained before step 1, as a publication of retains alone
        just before this one would: one of them that is stored and unreferenced is then
        held, not replaced. Raises ``KeyError`` (nothing changed) if a key is released more
        often than it is held."""
        if retained and released:
            retained, released = self._cancel(retained, released)
            if not (keys or retained_first or retained or released):
                return Admission([], _NO_POSITIONS)
        slots, lru, refs = self._slots, self._lru, self._refs
        distinct = True
        if released:
            every_retain = [*retained_first, *retained] if retained_first else retained
            distinct = self._check_releases(every_retain, released)
        if retained_first:
            self._retain(retained_first)
        unique = dict.fromkeys(keys)
        if slots and unique:
            replaced = list(filter(lru.__contains__, unique))
            if replaced:
                deque(map(lru.__delitem__, replaced), maxlen=0)
                self._pool.push(list(map(slots.pop, replaced)))
            pending = list(filterfalse(slots.__contains__, unique))
        else:
            pending = list(unique)
        if retained:
            self._retain(retained)
        terminal = self._release(released, distinct) if released else []
        lru.update(zip(filterfalse(refs.__contains__, pending) if refs else pending, repeat(None)))
        if terminal:
            deque(map(lru.move_to_end, filter(lru.__contains__, terminal)), maxlen=0)
        slots.update(zip(pending, repeat(PENDING)))
        excess = len(slots) - self.num_slots
        if excess > 0:
            protected = unique.keys() - set(terminal) if terminal else unique.keys()
            evicted = self._evict(excess, protected)
            if evicted:
                pending = [key for key in pending if key not in evicted]
        if not pending:
            return Admission([], _NO_POSITIONS)
        if len(pending) == len(keys):
            return Admission(pending, None)
        last = dict(zip(keys, range(len(keys))))
        return Admission(pending, np.fromiter(map(last.__getitem__, pending), np.int64))

    def _cancel(
        self, retained: Sequence[bytes], released: Sequence[bytes]
    ) -> tuple[Sequence[bytes], Sequence[bytes]]:
        """The retains and releases left once every key both retained and released in the
        call is dropped from both, where that changes nothing: each list distinct, and each
        such key held already, so its count goes up and back down, never reaching zero, and
        it is in no recency order before or after. A finishing request's blocks, which the
        scheduler pins as the request lets them go, come as such a call; a few set
        operations replace the general path's ~20 passes over its keys (at a few hundred
        keys, most of a step's output thread)."""
        retaining, releasing = set(retained), set(released)
        if len(retaining) != len(retained) or len(releasing) != len(released):
            return retained, released
        both = retaining & releasing
        if not both or not self._refs.keys() >= both:
            return retained, released
        if len(both) < len(retaining):
            retained = [key for key in retained if key not in both]
        else:
            retained = ()
        if len(both) < len(releasing):
            released = [key for key in released if key not in both]
        else:
            released = ()
        return retained, released

    def assign(self, keys: list[bytes], slots: list[int]) -> None:
        """Give admitted keys their slots."""
        self._slots.update(zip(keys, slots))

    def lookup(self, keys: Sequence[bytes], *, touch: bool) -> np.ndarray:
        """Slots of ``keys`` (``int64 [n]``; -1 where a key is not stored). When every key is
        stored and ``touch``, the unreferenced ones become most recent in order."""
        slots = np.fromiter(map(self._slots.get, keys, repeat(-1)), np.int64, len(keys))
        lru = self._lru
        if touch and lru and np.count_nonzero(slots < 0) == 0:
            deque(map(lru.move_to_end, filter(lru.__contains__, keys)), maxlen=0)
        return slots

    def slot_of(self, key: bytes) -> int:
        """Slot of one key, -1 if it is not stored (no recency change)."""
        return self._slots.get(key, -1)

    def refs_of(self, key: bytes) -> int:
        """References held on one key (no recency change)."""
        return self._refs.get(key, 0)

    def order(self) -> np.ndarray:
        """Key rows of the stored unreferenced keys, next victim first."""
        return rows_of_key_objects(list(self._lru))

    def _retain(self, retained: Sequence[bytes]) -> None:
        """One reference per occurrence; a key's first reference takes it out of the order."""
        refs, lru = self._refs, self._lru
        distinct = set(retained)
        counts = None if len(distinct) == len(retained) else Counter(retained)
        keys = distinct if counts is None else counts.keys()
        held = keys & refs.keys() if refs else ()
        if held:
            added = repeat(1) if counts is None else map(counts.__getitem__, held)
            refs.update(zip(held, map(add, map(refs.__getitem__, held), added)))
        fresh = keys - held if held else keys
        if lru:
            deque(map(lru.pop, fresh, repeat(None)), maxlen=0)
        refs.update(zip(fresh, repeat(1) if counts is None else map(counts.__getitem__, fresh)))

    def _check_releases(self, retained: Sequence[bytes], released: Sequence[bytes]) -> bool:
        """Raise ``KeyError`` if a key is released more often than it is referenced (held,
        or retained in this call). Returns whether every key occurs once in ``released``."""
        distinct = set(released)
        if len(distinct) == len(released):
            # Each key once: it needs one reference, held already or retained in this call.
            # (Not ``distinct - refs.keys()``: that copies every held key into a set first.)
            unheld = set(filterfalse(self._refs.__contains__, distinct))
            if not unheld or unheld <= set(retained):
                return True
        added = Counter(retained)
        for key, count in Counter(released).items():
            held = self._refs.get(key, 0) + added[key]
            if held < count:
                raise KeyError(
                    f"release_keys: {key_object_string(key)!r} released {count} time(s) but holds "
                    f"{held} reference(s)"
                )
        return len(distinct) == len(released)

    def _release(self, released: Sequence[bytes], distinct: bool) -> list[bytes]:
        """Drop one reference per occurrence (the call's retains already applied); return the
        keys whose last reference went, in the order they reached zero, after appending the
        stored ones to the order."""
        refs, lru, slots = self._refs, self._lru, self._slots
        if distinct:
            # Each key once (a finishing request's blocks, the scheduler's pins): the keys at
            # one reference are the terminal ones, in release order; all of it in C.
            counts = list(map(refs.__getitem__, released))
            terminal = list(compress(released, map((1).__eq__, counts)))
            refs.update(zip(released, map(sub, counts, repeat(1))))
            deque(map(refs.__delitem__, terminal), maxlen=0)
            lru.update(zip(filter(slots.__contains__, terminal), repeat(None)))
            return terminal
        terminal: list[bytes] = []
        for key in released:
            count = refs[key] - 1
            if count:
                refs[key] = count
                continue
            del refs[key]
            if key in slots:
                lru[key] = None
            terminal.append(key)
        return terminal

    def _evict(self, excess: int, protected) -> set[bytes]:
        """Evict ``excess`` unreferenced keys, oldest first, skipping ``protected``; frees
        their slots. Returns the evicted keys that had no slot yet (pending batch keys)."""
        lru, slots = self._lru, self._slots
        victims = list(islice(lru, excess))
        if len(victims) < excess or not protected.isdisjoint(victims):
            victims = []
            for key in lru:
                if key not in protected:
                    victims.append(key)
                    if len(victims) == excess:
                        break
        deque(map(lru.__delitem__, victims), maxlen=0)
        freed = list(map(slots.pop, victims))
        if PENDING not in freed:
            self._pool.push(freed)
            return set()
        self._pool.push([slot for slot in freed if slot >= 0])
        return {key for key, slot in zip(victims, freed) if slot == PENDING}
