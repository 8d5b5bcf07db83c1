"""Recency order of the store's evictable entries: stamps plus a lazily pruned FIFO.

An entry is *in order* while it is stored and unreferenced. ``touch`` hands out increasing
stamps in call order, records each entry's latest stamp in ``stamp`` and appends the
``(entry, stamp)`` pairs to a FIFO, so the FIFO is sorted by stamp. A pair is live while
``stamp[entry]`` still equals its stamp; touching an entry again, or ``forget`` (its first
reference, its eviction), makes its old pair stale without looking for it. Eviction walks the
FIFO from the head: the next victim is the oldest live pair.

Bounds: the FIFO is compacted (stale pairs dropped) when it runs out of room and grows only when
live pairs would fill more than half of it, so it holds at most about four pairs per entry in
order plus one batch.
"""

from __future__ import annotations

import numpy as np

_MIN_FIFO = 64
_NO_IDS = np.empty(0, dtype=np.int64)


class Recency:
    """Least-recently-used order over entry ids.

    Attributes:
        stamp: ``int64 [entries + 1]``, each entry's latest stamp, 0 when the entry is not in
            order. The last element is a sentinel for entry id -1 and stays 0.
        clock: the last stamp handed out.
    """

    def __init__(self, entries: int) -> None:
        self.stamp = np.zeros(entries + 1, dtype=np.int64)
        self.clock = 0
        self._ids = np.zeros(_MIN_FIFO, dtype=np.int64)
        self._stamps = np.zeros(_MIN_FIFO, dtype=np.int64)
        self._head = 0
        self._tail = 0

    def resize(self, entries: int) -> None:
        """Make room for entry ids ``0 .. entries - 1`` (never shrinks)."""
        old = len(self.stamp) - 1
        if entries > old:
            stamp = np.zeros(entries + 1, dtype=np.int64)
            stamp[:old] = self.stamp[:old]
            self.stamp = stamp

    def touch(self, ids: np.ndarray, *, distinct: bool) -> None:
        """Make ``ids`` the most recent entries, one after another (an entry touched twice
        ends up at its last position). ``distinct``: the caller knows no id repeats."""
        n = len(ids)
        if not n:
            return
        stamps = np.arange(self.clock + 1, self.clock + 1 + n, dtype=np.int64)
        self.clock += n
        if distinct:
            self.stamp[ids] = stamps
        else:
            # A repeated index in a plain assignment may keep any of its values; the newest
            # stamp is also the largest, so a maximum keeps the last touch.
            np.maximum.at(self.stamp, ids, stamps)
        if self._tail + n > len(self._ids):
            self._make_room(n)
        tail = self._tail
        self._ids[tail : tail + n] = ids
        self._stamps[tail : tail + n] = stamps
        self._tail = tail + n

    def forget(self, ids: np.ndarray) -> None:
        """Take ``ids`` out of the order (a first reference, an eviction)."""
        self.stamp[ids] = 0

    def evict(self, excess: int, keep_from: int, keep_to: int) -> np.ndarray:
        """Take up to ``excess`` entries out of the order, oldest first, and return them
        (``int64``, in that order). Entries whose stamp lies in ``[keep_from, keep_to)`` are
        skipped and keep their place."""
        head, tail = self._head, self._tail
        cut = tail
        if keep_from < keep_to:
            cut = head + int(np.searchsorted(self._stamps[head:tail], keep_from))
        # Usually the oldest pairs hold enough live ones: one look at them.
        stop = min(cut, head + 2 * excess + _MIN_FIFO)
        ids = self._ids[head:stop]
        live = (self.stamp[ids] == self._stamps[head:stop]).nonzero()[0]
        if len(live) >= excess:
            taken = live[:excess]
            self._head = head + int(taken[-1]) + 1
            victims = ids[taken]
        else:
            found = [ids[live]] if len(live) else []
            need, self._head = self._scan(stop, cut, excess - len(live), found)
            if need and cut < tail:
                resume = head + int(np.searchsorted(self._stamps[head:tail], keep_to))
                self._scan(resume, tail, need, found)
            if not found:
                return _NO_IDS
            victims = np.concatenate(found) if len(found) > 1 else found[0]
        self.stamp[victims] = 0
        return victims

    def order(self) -> np.ndarray:
        """Entries in order, next victim first (introspection)."""
        ids = self._ids[self._head : self._tail]
        return ids[self.stamp[ids] == self._stamps[self._head : self._tail]]

    def _scan(self, start: int, end: int, need: int, found: list[np.ndarray]) -> tuple[int, int]:
        """Collect up to ``need`` live pairs from FIFO positions ``start .. end - 1`` into
        ``found``; return (how many are still needed, the position after the last one
        taken, or ``end``)."""
        at = start
        while need and at < end:
            stop = min(end, at + max(2 * need, _MIN_FIFO))
            ids = self._ids[at:stop]
            live = (self.stamp[ids] == self._stamps[at:stop]).nonzero()[0][:need]
            if live.size:
                found.append(ids[live])
                need -= live.size
            at = at + int(live[-1]) + 1 if not need else stop
        return need, at

    def _make_room(self, n: int) -> None:
        """Drop stale pairs; grow when live ones would fill more than half the FIFO."""
        ids = self._ids[self._head : self._tail]
        stamps = self._stamps[self._head : self._tail]
        live = self.stamp[ids] == stamps
        ids, stamps = ids[live], stamps[live]
        size = len(self._ids)
        while 2 * (len(ids) + n) > size:
            size *= 2
        if size != len(self._ids):
            self._ids = np.zeros(size, dtype=np.int64)
            self._stamps = np.zeros(size, dtype=np.int64)
        self._ids[: len(ids)] = ids
        self._stamps[: len(ids)] = stamps
        self._head, self._tail = 0, len(ids)
