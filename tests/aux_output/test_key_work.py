"""KeyWorkQueue and Publisher on a real store: a step's new block hashes become the request's
key objects, and the store keeps those very objects, so every later call that hands them
back (publication, prefix-cache reads, the release at teardown) matches them by identity."""

from __future__ import annotations

import numpy as np

from r3capture.aux_output.key_work import KeyWorkQueue, StepKeyWork
from r3capture.aux_output.publisher import Publisher
from r3capture.aux_output.request_table import RequestTable
from r3capture.aux_output.types import PackedBlockHashes, key_rows_of
from r3capture.store import BlockStore, KeyObjects, key_objects, rows_of_key_objects

BLOCK_SIZE = 4


def packed(*values: int) -> PackedBlockHashes:
    """32-byte hashes, each the byte ``value`` repeated."""
    return PackedBlockHashes(b"".join(bytes([v]) * 32 for v in values), 32)


def stored_object(store: BlockStore, key: bytes) -> bytes:
    """The object the store's reference table holds for a key equal to ``key``."""
    held = store._ledger._refs
    return next(k for k in held if k == key)


def test_the_store_keeps_the_request_objects_even_when_pinned_in_the_same_step():
    store = BlockStore(max_bytes=64 * 8, object_nbytes=8, reserve_slots=16)
    table = RequestTable(ring_width=4)
    publisher = Publisher(store, table, BLOCK_SIZE)
    queue = KeyWorkQueue(table, publisher)
    row = table.add("a", 0)
    # The scheduler pins the request's two new blocks in the step their hashes arrive.
    work = StepKeyWork(packed(1, 2), None, 0)
    work.rows.append(row)
    work.hashes.append(packed(1, 2))
    queue.record(work)
    queue.apply_all()
    publisher.flush()

    keys = table.keys_of(row, 0, 2)
    assert rows_of_key_objects(keys)[:, 1].tolist() == [0x0101010101010101, 0x0202020202020202]
    assert [store.ref_count(row) for row in rows_of_key_objects(keys)] == [2, 2]
    assert all(stored_object(store, key) is key for key in keys)

    # Teardown: the pins go, then the request's own references, in one store call.
    done = StepKeyWork(None, packed(1, 2), 0)
    done.finishing.append("a")
    queue.record(done)
    queue.apply_all()
    publisher.flush()
    assert len(table) == 0 and store._ledger._refs == {}


def test_add_step_records_only_steps_with_key_work():
    """A step without new hashes, pins, finishes or a reset queues nothing; each of those
    alone queues its work, and a reset's releases are applied at once."""
    from types import SimpleNamespace

    store = BlockStore(max_bytes=64 * 8, object_nbytes=8, reserve_slots=16)
    table = RequestTable(ring_width=4)
    publisher = Publisher(store, table, BLOCK_SIZE)
    queue = KeyWorkQueue(table, publisher)
    row = table.add("a", 0)

    def step(**fields):
        meta = SimpleNamespace(block_hashes={}, retained_block_hashes=None)
        meta.released_block_hashes = PackedBlockHashes(b"", 32)  # present but empty
        meta.__dict__.update(fields)
        return meta

    def add(meta, **kwargs):
        options = dict(pin_generation=0, hash_rows=None, generation=0, finishing=[])
        queue.add_step(meta, **{**options, "reset_releases": None, **kwargs})

    add(step())
    assert queue._queued == []
    add(step(block_hashes={"a": packed(1)}), hash_rows=[row])
    assert [w.rows for w in queue._queued] == [[row]]
    add(step(retained_block_hashes=packed(2)))
    assert queue._queued[-1].pins_retained is not None and len(queue._queued) == 2
    add(step(), finishing=["a"])
    assert queue._queued[-1].finishing == ["a"] and queue.tearing_down == {"a"}
    queue.apply_all()
    assert queue._queued == [] and len(table) == 0 and queue.tearing_down == set()
    add(step(), reset_releases=table.release_order([]))
    assert queue._queued == []  # applied, not queued
    publisher.flush()
    pinned = {pin_key(2): 1}  # a's own key went with its teardown
    assert held(store) == pinned
    # Released pins alone are key work too.
    add(step(released_block_hashes=packed(2)))
    assert queue._queued[-1].pins_released is not None and len(queue._queued) == 1
    queue.apply_all()
    publisher.flush()
    assert held(store) == {}
    # A reset with nothing else to do still releases its keys, at once.
    add(step(retained_block_hashes=packed(3)))
    queue.apply_all()
    publisher.flush()
    assert held(store) == {pin_key(3): 1}
    add(step(), reset_releases=generation_0_keys(3))
    assert queue._queued == []
    publisher.flush()
    assert held(store) == {}
    # Work recorded before a reset is applied before the reset's releases.
    add(step(retained_block_hashes=packed(4)))
    add(step(), reset_releases=generation_0_keys(4))
    assert queue._queued == []
    publisher.flush()
    assert held(store) == {}


def generation_0_keys(*values: int) -> KeyObjects:
    """The store keys of ``packed(*values)`` in generation 0."""
    return key_objects(key_rows_of(packed(*values), 0))


def pin_key(value: int) -> bytes:
    """The store key of ``packed(value)`` in generation 0."""
    return bytes(generation_0_keys(value)[0])


def held(store: BlockStore) -> dict[bytes, int]:
    """Every key the store holds references to, with their count."""
    return {bytes(key): count for key, count in store._ledger._refs.items()}


def test_publication_binds_only_blocks_the_cursor_has_passed():
    """Keys can arrive before a block's rows are all captured (a prompt is hashed whole):
    only blocks both keyed and complete leave the request for the store."""
    store = BlockStore(max_bytes=64 * 8, object_nbytes=8, reserve_slots=16)
    table = RequestTable(ring_width=4)
    publisher = Publisher(store, table, BLOCK_SIZE)
    row = table.add("a", 0)
    table.rings.extend(np.array([row]), np.array([0]), np.array([3]), store.allocate(3))
    table.add_keys([row], generation_0_keys(1, 2, 3), [3])
    rows = np.array([row], np.int64)
    for cursor, published in [(-1, 0), (3, 0), (5, 1), (7, 1), (8, 2), (12, 3)]:
        table.cursor[row] = cursor
        publisher.publish(rows)
        publisher.flush()
        assert table.rings.base[row] == published, cursor
        assert len(store) == published, cursor


def test_a_retain_only_call_rides_on_the_next_store_call(monkeypatch):
    """A decode step that completes a block queues the retain of its new key, then the
    bind of the block: ``flush`` makes them one store call, the retains first; a retain-only
    call with nothing after it is made alone. The store ends as after the two calls."""
    store = BlockStore(max_bytes=64 * 8, object_nbytes=8, reserve_slots=16)
    table = RequestTable(ring_width=4)
    publisher = Publisher(store, table, BLOCK_SIZE)
    queue = KeyWorkQueue(table, publisher)
    calls = []
    bind = store.bind

    def counted(keys, slots, **refs):
        calls.append((len(keys), {name: len(keys) for name, keys in refs.items()}))
        return bind(keys, slots, **refs)

    monkeypatch.setattr(store, "bind", counted)
    row = table.add("a", 0)
    table.rings.extend(np.array([row]), np.array([0]), np.array([1]), store.allocate(1))
    work = StepKeyWork(None, None, 0)
    work.rows.append(row)
    work.hashes.append(packed(1))
    queue.record(work)
    queue.apply_all()  # the key joins the request, its block not yet complete
    table.cursor[row] = BLOCK_SIZE
    publisher.publish(np.array([row], np.int64))
    publisher.flush()
    expect = {"retain_keys": 0, "release_keys": 0, "retain_first_keys": 1}
    assert calls == [(1, expect)]
    assert held(store) == {pin_key(1): 1} and len(store) == 1 and store.num_unbound == 0
    calls.clear()
    queue.record(StepKeyWork(packed(2), None, 0))
    queue.apply_all()
    publisher.flush()
    assert calls == [(0, {"retain_keys": 1, "release_keys": 0, "retain_first_keys": 0})]
    assert held(store) == {pin_key(1): 1, pin_key(2): 1}
