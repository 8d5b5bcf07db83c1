"""KeyWorkQueue and Publisher on a real store: a step's new block hashes become the request's
key objects, and the store keeps those very objects, so every later call that hands them
back (publication, prefix-cache reads, the release at teardown) matches them by identity."""

from __future__ import annotations

from r3capture.aux_output.key_work import KeyWorkQueue, StepKeyWork
from r3capture.aux_output.publisher import Publisher
from r3capture.aux_output.request_table import RequestTable
from r3capture.aux_output.types import PackedBlockHashes
from r3capture.store import BlockStore, rows_of_key_objects

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
