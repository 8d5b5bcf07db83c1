"""The host side of the device's free-slot queue: what the kernel may take, and refills.

The kernel takes new slots from a ring of ``Q`` entries (``kernels.gather_alloc``); the host
writes entries at ``tail`` and learns how many each launch took from its ``step_info`` when
the step is committed, in launch order (``committed``). Entries ``committed .. tail - 1``
are free slots allocated from the store's producer reserve; the launches in flight take
from their front.

The output thread refills the queue after a commit that leaves fewer than ``stock`` entries
ahead of the committed head (``stock`` covers every launch that can be in flight), and then
fills the whole ring: a decode step opens a block or two, so a refill per commit that opens
one would cost a store call on a third of the long tail's steps, where one refill now serves
hundreds. The launch checks the stock with one comparison and refills on the main thread
only if it ever fails. Entries are written before a launch is given the larger tail, and a
position is written again only after the launch that took it was committed.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from r3capture.aux_output.slot_rings import NO_SLOTS
from r3capture.store import BlockStore


class SlotQueue:
    """Free store slots for the kernel, in ``queue`` (int32 numpy view of the device's queue).

    Args:
        queue: the entries the kernel reads (pinned or CPU memory, written here).
        store: where slots come from (its producer reserve).
        stock: entries kept ahead of the committed head.
        apply_teardown: applies teardown that is recorded but not yet applied and returns
            whether there was any: the reserve grows only when that frees too few slots.
    """

    def __init__(
        self,
        queue: np.ndarray,
        store: BlockStore,
        stock: int,
        apply_teardown: Callable[[], bool],
    ) -> None:
        if stock > len(queue):
            raise ValueError(f"a stock of {stock} entries does not fit a queue of {len(queue)}")
        self._queue = queue
        self._store = store
        self._stock = stock
        self._apply_teardown = apply_teardown
        self.tail = 0
        self.committed = 0
        # Upper bounds of what each launch in flight can take, oldest first.
        self._in_flight: list[int] = []

    @property
    def num_queued(self) -> int:
        """Slots in the queue that no committed launch took (the launches in flight may)."""
        return self.tail - self.committed

    def reserve(self, bound: int) -> int:
        """Before a launch that can take at most ``bound`` entries: make sure they are there
        beside what the launches in flight can take; returns the tail to launch with."""
        if self.tail - self.committed - sum(self._in_flight) < bound:
            self.refill(sum(self._in_flight) + bound)
        self._in_flight.append(bound)
        return self.tail

    def commit(self, total: int) -> np.ndarray:
        """The oldest launch in flight took ``total`` entries (the sum of its requests'
        counts); returns those slots (int64), in the order its requests took them."""
        self._in_flight.pop(0)
        if not total:
            return NO_SLOTS  # most decode steps open no block
        first = self.committed % len(self._queue)
        end = first + total
        if end <= len(self._queue):
            slots = self._queue[first:end].astype(np.int64)
        else:
            slots = np.concatenate((self._queue[first:], self._queue[: end - len(self._queue)]))
            slots = slots.astype(np.int64)
        self.committed += total
        return slots

    def refill(self, stock: int | None = None) -> None:
        """Put free slots in the queue until ``stock`` entries lie ahead of the committed
        head; by default, when fewer than the configured stock do, until the ring is full."""
        ahead, size = self.tail - self.committed, len(self._queue)
        if stock is None:
            if ahead >= self._stock:
                return
            stock = size
        want = stock - ahead
        if want <= 0:
            return
        if self.tail - self.committed + want > size:
            raise OverflowError(
                f"the free-slot queue of {size} entries cannot hold {want} more "
                f"({self.tail - self.committed} still ahead of the committed head)"
            )
        slots = self._allocate(want)
        first = self.tail % size
        end = first + want
        if end <= size:
            self._queue[first:end] = slots
        else:
            self._queue[first:] = slots[: size - first]
            self._queue[: end - size] = slots[size - first :]
        self.tail += want

    def _allocate(self, n: int) -> np.ndarray:
        """``n`` unbound slots. ``max_num_seqs`` bounds the requests of a step, not those
        holding slots: preempted requests keep their open block while others run, so when
        the reserve runs short it grows (at least doubles) rather than failing."""
        store = self._store
        short = store.num_unbound + n - store.reserve_slots
        if short > 0 and self._apply_teardown():
            short = store.num_unbound + n - store.reserve_slots
        if short > 0:
            store.grow_reserve(max(short, store.reserve_slots))
        return store.allocate(n)
