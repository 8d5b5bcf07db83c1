"""SlotQueue: the host's account of the kernel's free-slot queue.

Slots go in at the tail from the store's producer reserve, come out at the committed head in
the order the launches took them (wrapping around the ring), the stock ahead of the head is
kept, and a launch that could take more than the queue holds refills first.
"""

from __future__ import annotations

import numpy as np
import pytest

from r3capture.aux_output.slot_queue import SlotQueue
from r3capture.store import BlockStore


def _queue(size: int = 8, stock: int = 4, reserve: int = 16, teardown=lambda: False):
    store = BlockStore(max_bytes=64, object_nbytes=4, reserve_slots=reserve)
    entries = np.full(size, -1, np.int32)
    return SlotQueue(entries, store, stock, teardown), entries, store


def test_refill_fills_the_ring_once_less_than_the_stock_is_ahead_and_commits_take_in_order():
    queue, entries, store = _queue()
    queue.refill()
    assert (queue.tail, queue.committed, queue.num_queued) == (8, 0, 8)
    put = entries.tolist()
    assert len(set(put)) == 8 and store.num_unbound == 8
    assert queue.reserve(bound=3) == 8  # room for the launch: no refill
    # The launch took 1 slot for its first request and 2 for its third, in batch order.
    assert queue.commit(3).tolist() == put[:3]
    assert (queue.committed, queue.num_queued) == (3, 5)
    queue.refill()  # the stock of 4 is still ahead: no store call
    assert (queue.tail, queue.num_queued, store.num_unbound) == (8, 5, 8)
    queue.reserve(bound=2)
    assert queue.commit(2).tolist() == put[3:5]
    queue.refill()  # 3 ahead, fewer than the stock: the ring is filled again
    # The five committed slots stay unbound until their blocks are bound.
    assert (queue.tail, queue.num_queued, store.num_unbound) == (13, 8, 13)
    assert entries[5:8].tolist() == put[5:8] and len(set(entries.tolist())) == 8


def test_entries_wrap_around_the_ring():
    queue, entries, _ = _queue(size=5, stock=4)
    taken = []
    for _ in range(4):
        queue.refill()
        queue.reserve(bound=3)
        first = queue.committed
        slots = queue.commit(3)
        taken.append(slots.tolist())
        # The slots a commit reads are the ones written at those positions, modulo 5.
        assert slots.tolist() == [entries[(first + i) % 5] for i in range(3)]
    flat = [s for step in taken for s in step]
    assert len(flat) == 12 and queue.committed == 12 and queue.tail == 14


def test_a_launch_that_could_take_more_than_the_queue_holds_refills_first():
    queue, _, _ = _queue(size=8, stock=2)
    queue.refill(stock=2)
    assert queue.reserve(bound=2) == 2  # exactly covered
    # A second launch in flight could take 3 more: the queue grows to cover both.
    assert queue.reserve(bound=3) == 5
    assert queue.commit(0).size == 0  # the first took nothing
    assert len(queue.commit(3)) == 3 and queue.committed == 3


def test_a_refill_past_the_queue_size_is_refused_before_any_change():
    queue, entries, store = _queue(size=4, stock=4)
    queue.refill()
    before = entries.copy()
    with pytest.raises(OverflowError, match="queue of 4 entries cannot hold 2 more"):
        queue.refill(stock=6)
    assert np.array_equal(entries, before) and queue.tail == 4 and store.num_unbound == 4


def test_a_short_reserve_applies_recorded_teardown_first_then_grows():
    calls = []
    queue, _, store = _queue(size=32, stock=20, reserve=16, teardown=lambda: calls.append(1))
    queue.refill()  # 32 slots from a reserve of 16: teardown freed none, so it grows
    assert calls == [1] and store.reserve_slots >= 32 and queue.num_queued == 32
