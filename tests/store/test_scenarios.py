"""Step-by-step scenarios for BlockStore on a tiny arena: exact evictions, slots and counts."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

import r3capture.store.arena as arena_module
import r3capture.store.slot_space as slot_space
from r3capture.store import BlockObjectStoreError, BlockStore, key_rows_from_strings

NB = 4  # object_nbytes: small enough to spell payloads out


def K(name: str) -> str:
    """The vLLM key of a one-letter block name (its hash is the letter's byte)."""
    return f"vllm-artifact/0/{name.encode().hex()}"


def Ks(names: str) -> list[str]:
    return [K(name) for name in names]


def lru(store: BlockStore) -> list[str]:
    """The eviction order as block names."""
    return [bytes.fromhex(key.rsplit("/", 1)[1]).decode() for key in store.eviction_order()]


def blk(ch: str) -> bytes:
    return ch.encode() * NB


def make(capacity: int = 3, reserve: int = 0, **kwargs) -> BlockStore:
    return BlockStore(max_bytes=capacity * NB, object_nbytes=NB, reserve_slots=reserve, **kwargs)


def put(store: BlockStore, keys: str, *, retain: str = "", release: str = "") -> None:
    """Publish one-letter keys whose payload is the letter itself."""
    store.put([(K(k), blk(k)) for k in keys], retain_keys=Ks(retain), release_keys=Ks(release))


def keys_of(store: BlockStore) -> set[str]:
    return {k for k in "abcdefghijklmnopqrstuvwxyz" if K(k) in store}


def test_lru_eviction_and_slot_reuse():
    store = make(capacity=3)
    put(store, "abc")
    assert [store.peek_slot(K(k)) for k in "abc"] == [0, 1, 2]
    assert lru(store) == ["a", "b", "c"]

    # a read makes "a" most recently used
    assert store.get_concatenated(Ks("a")) == blk("a")
    assert lru(store) == ["b", "c", "a"]

    # put [d] -> evicts [b]; d reuses b's slot
    put(store, "d")
    assert keys_of(store) == {"a", "c", "d"}
    assert store.peek_slot(K("d")) == 1
    assert lru(store) == ["c", "a", "d"]

    # put [e, f] -> evicts [c, a] in LRU order; their slots come back as a run
    put(store, "ef")
    assert keys_of(store) == {"d", "e", "f"}
    assert [store.peek_slot(K(k)) for k in "ef"] == [2, 0]
    assert store.get_concatenated(Ks("fde")) == blk("f") + blk("d") + blk("e")
    assert len(store) == 3


def test_lookup_slots_refreshes_recency_like_a_read():
    store = make(capacity=3)
    put(store, "abc")
    np.testing.assert_array_equal(store.lookup_slots(Ks("ba")), [1, 0])
    assert lru(store) == ["c", "b", "a"]
    put(store, "d")  # evicts [c]
    assert keys_of(store) == {"a", "b", "d"}


def test_referenced_keys_are_never_evicted():
    store = make(capacity=3)
    put(store, "abc", retain="a")
    assert store.ref_count(K("a")) == 1
    assert lru(store) == ["b", "c"]
    # put [d, e] -> evicts [b, c], never the older but referenced a
    put(store, "de")
    assert keys_of(store) == {"a", "d", "e"}
    # reads do not move referenced keys into the LRU
    store.get_concatenated(Ks("a"))
    assert lru(store) == ["d", "e"]
    # released: a becomes the most recently used
    put(store, "", release="a")
    assert store.ref_count(K("a")) == 0
    assert lru(store) == ["d", "e", "a"]
    put(store, "f")  # evicts [d]
    assert keys_of(store) == {"a", "e", "f"}


def test_reference_counts_stack():
    store = make(capacity=2)
    put(store, "a", retain="aa")
    assert store.ref_count(K("a")) == 2
    put(store, "", release="a")
    assert store.ref_count(K("a")) == 1
    assert lru(store) == []
    put(store, "bc")  # a is referenced and b, c are the batch itself: nothing can go
    assert store.num_slots == 4
    put(store, "", release="a")
    assert store.ref_count(K("a")) == 0
    assert lru(store) == ["b", "c", "a"]


def test_release_order_is_eviction_order_tail_first():
    store = make(capacity=4)
    put(store, "wxyz", retain="wxyz")
    assert lru(store) == []
    # a finished request releases its blocks tail first
    put(store, "", release="zyxw")
    assert lru(store) == ["z", "y", "x", "w"]
    put(store, "a")  # evicts [z]: the tail block goes first, like the KV cache
    assert K("z") not in store and store.peek_slot(K("a")) == 3
    put(store, "bc")  # evicts [y, x]
    assert keys_of(store) == {"w", "a", "b", "c"}


@pytest.mark.parametrize(
    "releases, order",
    [("wxwx", "wx"), ("xwwx", "wx"), ("wxxw", "xw"), ("wwxx", "wx")],
)
def test_shared_keys_become_evictable_at_their_last_release(releases, order):
    """Two samples of one prompt pin its blocks twice and finish in one step: a block is
    freed by its second release, so the eviction order follows the last occurrences."""
    store = make(capacity=4)
    put(store, "wx", retain="wxwx")
    put(store, "", release=releases)
    assert lru(store) == list(order)
    assert store.ref_count(K("w")) == store.ref_count(K("x")) == 0


def test_released_keys_go_after_the_batch_in_lru_order():
    store = make(capacity=4)
    put(store, "ab", retain="a")
    put(store, "cd", release="a")  # the batch first, then a as the most recent
    assert lru(store) == ["b", "c", "d", "a"]


def test_reput_of_unreferenced_key_replaces_it():
    store = make(capacity=3)
    put(store, "abc")
    store.put([(K("a"), blk("z"))])
    assert store.get_concatenated(Ks("a")) == blk("z")
    assert lru(store) == ["b", "c", "a"]
    assert store.peek_slot(K("a")) == 0  # its old slot is freed and reused at once
    assert len(store) == 3


def test_reput_of_referenced_key_keeps_it():
    store = make(capacity=3)
    put(store, "ab", retain="a")
    store.put([(K("a"), blk("z"))])
    assert store.get_concatenated(Ks("a")) == blk("a")
    assert store.ref_count(K("a")) == 1
    # referenced at the start of the call: kept even when the same call releases it
    store.put([(K("a"), blk("y"))], release_keys=Ks("a"))
    assert store.get_concatenated(Ks("a")) == blk("a")
    assert lru(store) == ["b", "a"]


def test_retain_in_same_call_still_replaces_an_unreferenced_key():
    store = make(capacity=3)
    put(store, "a")
    store.put([(K("a"), blk("z"))], retain_keys=Ks("a"))
    assert store.get_concatenated(Ks("a")) == blk("z")
    assert store.ref_count(K("a")) == 1 and lru(store) == []


def test_duplicate_key_in_batch_last_payload_wins():
    store = make(capacity=3)
    store.put([(K("a"), blk("1")), (K("b"), blk("b")), (K("a"), blk("2"))])
    assert len(store) == 2
    assert lru(store) == ["a", "b"]  # first occurrence sets the batch order
    assert store.get_concatenated(Ks("ab")) == blk("2") + blk("b")


def test_retain_before_put_then_release():
    store = make(capacity=2)
    put(store, "", retain="x")  # the scheduler may retain before the block is published
    assert store.ref_count(K("x")) == 1 and K("x") not in store
    put(store, "xab")  # x is referenced: only a and b may go, and both are this batch
    assert lru(store) == ["a", "b"]
    assert keys_of(store) == {"a", "b", "x"} and store.num_slots == 4
    put(store, "", release="x")
    assert lru(store) == ["a", "b", "x"]


def test_new_key_retained_and_released_in_one_call_is_evicted_first():
    store = make(capacity=2)
    put(store, "ab", retain="ab")
    # c is retained and released by the same call: unreferenced, released, and the only
    # candidate -> evicted immediately (vLLM 0.33.0 does the same)
    put(store, "c", retain="c", release="c")
    assert keys_of(store) == {"a", "b"}
    assert store.num_slots == 2
    with pytest.raises(BlockObjectStoreError):
        store.get_concatenated(Ks("c"))


def test_growth_when_every_object_is_referenced(caplog):
    calls = []
    store = make(capacity=2, on_grow=lambda: calls.append((store.arena_version, store.arena)))
    put(store, "ab", retain="ab")
    old_arena = store.arena
    with caplog.at_level(logging.WARNING, logger=slot_space.__name__):
        put(store, "c")
    assert calls == [(0, old_arena)]  # on_grow ran before the old arena was replaced
    assert store.arena_version == 1 and store.arena is not old_arena
    assert store.num_slots == 4 and tuple(store.arena.shape) == (4, NB)
    # The new size in objects and bytes (4 x NB), and why.
    messages = [r.getMessage() for r in caplog.records]
    assert any("grows from 2 to 4 objects (16 bytes)" in m for m in messages), messages
    assert any("every object is referenced" in m for m in messages), messages
    assert store.get_concatenated(Ks("abc")) == blk("a") + blk("b") + blk("c")
    assert store.peek_slot(K("c")) == 2
    # the grown capacity is the new bound: two more fit, then LRU eviction resumes
    put(store, "de")
    assert store.arena_version == 1 and len(store) == 4  # evicts [c]
    assert keys_of(store) == {"a", "b", "d", "e"}


def test_growth_for_a_batch_larger_than_capacity():
    store = make(capacity=2)
    put(store, "abcde")
    assert store.num_slots == 5  # max(needed, 2 x capacity)
    assert store.get_concatenated(Ks("abcde")) == b"".join(blk(k) for k in "abcde")


def test_missing_key_names_capacity_and_max_bytes():
    store = make(capacity=2)
    put(store, "abc"[:2])
    put(store, "c")  # evicts a
    with pytest.raises(BlockObjectStoreError) as info:
        store.get_array(Ks("ba"))
    message = str(info.value)
    assert repr(K("a")) in message and "used=2" in message and "limit=2" in message
    assert "max_bytes" in message and "--aux-output-config" in message
    assert lru(store) == ["b", "c"]  # a failed read touches nothing
    with pytest.raises(BlockObjectStoreError):
        store.lookup_slots(Ks("z"))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_bytes": 8, "object_nbytes": 0}, "object_nbytes must be a positive"),
        ({"max_bytes": 8, "object_nbytes": -4}, "object_nbytes must be a positive"),
        ({"max_bytes": 3, "object_nbytes": 4}, r"max_bytes must hold at least one object"),
        ({"max_bytes": 8, "object_nbytes": 4, "reserve_slots": -1}, "reserve_slots"),
    ],
    ids=["zero-size", "negative-size", "below-one-object", "negative-reserve"],
)
def test_bad_sizes_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockStore(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"max_bytes": 16, "object_nbytes": 2.5, "reserve_slots": 1}, "object_nbytes"),
        ({"max_bytes": 16.0, "object_nbytes": 4}, "max_bytes"),
        ({"max_bytes": 16, "object_nbytes": 4, "reserve_slots": 1.5}, "reserve_slots"),
        ({"max_bytes": True, "object_nbytes": 1}, "max_bytes"),
        ({"max_bytes": 16, "object_nbytes": None}, "object_nbytes"),
        ({"max_bytes": "16", "object_nbytes": 4}, "max_bytes"),
    ],
    ids=["float-size", "float-bytes", "float-reserve", "bool", "none", "str"],
)
def test_sizes_must_be_ints(kwargs, name):
    """Before, BlockStore(max_bytes=16, object_nbytes=2.5, reserve_slots=1.5) truncated."""
    with pytest.raises(TypeError, match=f"{name} must be an int"):
        BlockStore(**kwargs)
    assert BlockStore(max_bytes=np.int64(16), object_nbytes=np.int32(4)).num_slots == 4


def test_rejected_out_leaves_recency_alone():
    """get_array validates ``out`` before it refreshes recency (it used to refresh first)."""
    store = make(capacity=3)
    put(store, "abc")
    with pytest.raises(ValueError, match="out"):
        store.get_array(Ks("a"), out=np.empty((2, NB), np.uint8))
    assert lru(store) == ["a", "b", "c"]
    put(store, "d")  # a is still the next victim
    assert keys_of(store) == {"b", "c", "d"}


def test_key_rows_everywhere():
    """Every method takes key rows; strings and rows name the same keys."""
    store = make(capacity=3, reserve=2)
    rows = key_rows_from_strings(Ks("abc"))
    store.put_array(rows[:2], np.frombuffer(blk("a") + blk("b"), np.uint8).reshape(2, NB))
    slots = store.allocate(1)
    store.arena_np[slots] = np.frombuffer(blk("c"), np.uint8)
    store.bind(rows[2:], slots, retain_keys=rows[[2, 2]], release_keys=rows[[2]])
    assert store.get_array(rows[[1, 0]]).tobytes() == blk("b") + blk("a")
    assert lru(store) == ["b", "a"]  # c is held; the read made b then a most recent
    assert store.ref_count(rows[2]) == store.ref_count(K("c")) == 1
    assert rows[0] in store and K("a") in store and store.peek_slot(rows[2]) == slots[0]
    np.testing.assert_array_equal(store.lookup_slots(rows[[2]], held=True), slots)
    assert lru(store) == ["b", "a"]
    assert "a" not in store and "vllm-artifact/0/zz" not in store  # not keys: not stored
    with pytest.raises(ValueError, match="key row"):
        rows[:2] in store  # noqa: B015 - the membership test itself must raise
    with pytest.raises(TypeError, match="key string or key row"):
        store.ref_count(None)


def test_failed_call_leaves_no_entries_behind():
    """Keys first seen in a call that fails (bad release) must not linger in any table."""
    store = make(capacity=3)
    put(store, "a", retain="a")
    ledger = store._ledger
    sizes = (len(ledger._slots), len(ledger._refs), len(ledger._lru))
    with pytest.raises(KeyError, match=re.escape(f"{K('z')!r} released 1 time")):
        put(store, "bc", retain="de", release="az")
    assert (len(ledger._slots), len(ledger._refs), len(ledger._lru)) == sizes
    assert keys_of(store) == {"a"} and store.ref_count(K("d")) == 0 and lru(store) == []
    put(store, "bc", retain="d")
    assert keys_of(store) == {"a", "b", "c"} and store.ref_count(K("d")) == 1


def test_malformed_keys_change_nothing():
    store = make(capacity=3, reserve=1)
    put(store, "ab", retain="a")
    slots = store.allocate(1)
    for call in (
        lambda: store.put([(K("c"), blk("c")), ("c", blk("c"))]),
        lambda: store.put_array(Ks("c"), np.zeros((1, NB), np.uint8), release_keys=["a"]),
        lambda: store.bind(Ks("c"), slots, retain_keys=[K("a"), "vllm-artifact/0/x"]),
        lambda: store.get_array(Ks("a") + ["b"]),
    ):
        with pytest.raises(ValueError, match="is not a store key"):
            call()
        assert keys_of(store) == {"a", "b"} and lru(store) == ["b"]
        assert store.ref_count(K("a")) == 1 and store.num_unbound == 1


def test_payload_of_wrong_size_changes_nothing():
    store = make(capacity=3)
    put(store, "a")
    with pytest.raises(
        ValueError, match=re.escape(f"objects[1] ({K('c')!r}): payload has 3 bytes")
    ):
        store.put([(K("b"), blk("b")), (K("c"), b"ccc")], retain_keys=Ks("a"))
    assert keys_of(store) == {"a"} and store.ref_count(K("a")) == 0


@pytest.mark.parametrize(
    "blocks",
    [
        np.zeros((2, NB + 1), np.uint8),
        np.zeros((3, NB), np.uint8),
        np.zeros((1, 2 * NB), np.uint8),
        np.zeros((2, 2 * NB), np.uint8)[:, ::2],
        np.zeros((), np.float64),
        np.array([object()] * 8, dtype=object),
    ],
    ids=["row-too-long", "too-many-rows", "wrong-leading-dim", "strided", "scalar", "object"],
)
def test_put_array_rejects_bad_blocks(blocks):
    store = make(capacity=3)
    with pytest.raises(ValueError, match="blocks"):
        store.put_array(Ks("ab"), blocks)
    assert len(store) == 0


def test_put_array_any_dtype_round_trip():
    # [n, B, L, K] uint16 blocks, as the routed-experts path stores them for > 256 experts
    store = BlockStore(max_bytes=4 * 24, object_nbytes=24, reserve_slots=0)
    blocks = np.arange(3 * 2 * 3 * 2, dtype=np.uint16).reshape(3, 2, 3, 2)
    store.put_array(Ks("abc"), blocks)
    rows = store.get_array(Ks("ca"))
    assert rows.dtype == np.uint8 and rows.shape == (2, 24)
    assert rows.tobytes() == blocks[2].tobytes() + blocks[0].tobytes()
    out = np.full((2, 2, 3, 2), 0xFFFF, dtype=np.uint16)
    view = store.get_array(Ks("bc"), out=out)
    assert np.shares_memory(view, out)
    np.testing.assert_array_equal(out, blocks[1:])
    with pytest.raises(ValueError, match="out"):
        store.get_array(Ks("a"), out=np.empty((2, 24), np.uint8))
    assert store.get_array([]).shape == (0, 24)


def test_release_without_reference_raises_key_error_and_changes_nothing():
    store = make(capacity=3)
    put(store, "ab", retain="a")
    with pytest.raises(KeyError, match=re.escape(f"{K('b')!r} released 1 time")):
        put(store, "c", retain="a", release="ab")
    assert keys_of(store) == {"a", "b"} and store.ref_count(K("a")) == 1
    with pytest.raises(KeyError, match=re.escape(f"{K('a')!r} released 2 time")):
        put(store, "", release="aa")
    put(store, "", retain="a", release="aa")  # retains apply before releases
    assert store.ref_count(K("a")) == 0


def test_release_of_a_key_retained_in_the_same_call():
    """A finishing request's last hashes are retained and released in one call."""
    store = make(capacity=3)
    put(store, "ab", retain="a")
    put(store, "c", retain="c", release="ac")  # c: held only through this call's retain
    assert store.ref_count(K("a")) == 0 and store.ref_count(K("c")) == 0
    with pytest.raises(KeyError, match=re.escape(f"{K('b')!r} released 1 time")):
        put(store, "", retain="a", release="ab")  # a is covered by the retain, b is not
    assert store.ref_count(K("a")) == 0


def test_allocate_bind_free_lifecycle():
    store = make(capacity=2, reserve=2)
    slots = store.allocate(2)
    np.testing.assert_array_equal(slots, [0, 1])
    assert store.num_unbound == 2
    store.arena_np[slots] = np.frombuffer(blk("a") + blk("b"), np.uint8).reshape(2, NB)
    store.bind(Ks("ab"), slots)
    assert store.num_unbound == 0 and len(store) == 2
    assert store.get_concatenated(Ks("ab")) == blk("a") + blk("b")

    # unbound slots are never evicted: put c while 2 slots are held by the producer
    held = store.allocate(2)
    np.testing.assert_array_equal(held, [2, 3])
    put(store, "c")  # evicts [a]; c reuses a's slot, not a held one
    assert store.peek_slot(K("c")) == 0 and K("a") not in store
    store.free(held[:1])
    assert store.num_unbound == 1
    np.testing.assert_array_equal(store.allocate(1), held[:1])  # the freed slot comes back


def test_allocate_mixes_freed_and_fresh_slots_in_take_order():
    """Freed slots come back first (the last freed run, in the order it was freed), then
    never-used ones; the array is read-only, and its slots are unbound for bind and free
    before any other call."""
    store = make(capacity=4, reserve=6)
    first = store.allocate(4)
    store.free(first[1:3])
    again = store.allocate(4)
    np.testing.assert_array_equal(again, [1, 2, 4, 5])
    assert store.num_unbound == 6
    with pytest.raises(ValueError, match="read-only"):
        again[0] = 0
    with pytest.raises(ValueError, match="each slot may appear once"):
        store.free(np.array([3, 3]))
    with pytest.raises(ValueError, match=r"\[6\] are not unbound"):
        store.free(np.array([6]))
    store.free(again[2:])
    store.free(first[[0, 3]])
    assert store.num_unbound == 2
    np.testing.assert_array_equal(store.allocate(3), [5, 0, 3])  # the last run freed, in order


def test_allocate_beyond_reserve_raises():
    store = make(capacity=2, reserve=3)
    store.allocate(2)
    with pytest.raises(RuntimeError, match="reserve_slots=3"):
        store.allocate(2)
    assert store.num_unbound == 2
    with pytest.raises(ValueError, match="n must be >= 0"):
        store.allocate(-1)
    assert make(capacity=1).allocate(0).shape == (0,)


def test_bind_existing_referenced_key_returns_the_slot():
    store = make(capacity=3, reserve=2)
    put(store, "a", retain="a")
    slots = store.allocate(2)
    store.arena_np[slots] = np.frombuffer(blk("z") + blk("b"), np.uint8).reshape(2, NB)
    store.bind(Ks("ab"), slots)
    assert store.get_concatenated(Ks("ab")) == blk("a") + blk("b")  # a kept its bytes
    assert store.num_unbound == 0
    assert store.peek_slot(K("b")) == slots[1]
    # a's unused slot went back to the pool and is the first one handed out again
    np.testing.assert_array_equal(store.allocate(1), slots[:1])


def test_bind_retains_first_keys_before_anything_else_of_the_call():
    """``retain_first_keys`` does what a retain-only call just before would: an unreferenced
    key among them is held before the bind, so it keeps its bytes (``retain_keys`` would
    replace it, ``test_retain_in_same_call_still_replaces_an_unreferenced_key``)."""
    store = make(capacity=3, reserve=2)
    put(store, "ab")
    slots = store.allocate(2)
    store.arena_np[slots] = np.frombuffer(blk("z") + blk("c"), np.uint8).reshape(2, NB)
    store.bind(Ks("ac"), slots, retain_keys=Ks("c"), retain_first_keys=Ks("a"))
    assert store.get_concatenated(Ks("ac")) == blk("a") + blk("c")  # a kept its bytes
    assert store.ref_count(K("a")) == store.ref_count(K("c")) == 1
    assert lru(store) == ["b"] and store.num_unbound == 0
    # Releases are checked against both retains, before anything changes.
    with pytest.raises(KeyError, match="released 2 time"):
        store.bind(Ks(""), slots[:0], release_keys=Ks("bb"), retain_first_keys=Ks("b"))
    assert store.ref_count(K("b")) == 0 and lru(store) == ["b"]
    store.bind(
        Ks(""), slots[:0], release_keys=Ks("bb"), retain_first_keys=Ks("b"), retain_keys=Ks("b")
    )
    assert store.ref_count(K("b")) == 0 and lru(store) == ["b"]


def test_bind_replaces_unreferenced_key_and_dedups():
    store = make(capacity=3, reserve=3)
    put(store, "a")
    old = store.peek_slot(K("a"))
    slots = store.allocate(3)
    store.arena_np[slots] = np.frombuffer(blk("1") + blk("x") + blk("2"), np.uint8).reshape(3, NB)
    store.bind(Ks("axa"), slots)
    assert store.get_concatenated(Ks("ax")) == blk("2") + blk("x")  # last duplicate wins
    assert store.peek_slot(K("a")) == slots[2]
    assert store.num_unbound == 0 and len(store) == 2
    # a's old slot and the first duplicate's slot are free again; the reserve is whole
    assert sorted(store.allocate(3).tolist()) == sorted([old, int(slots[0]), 4])


@pytest.mark.parametrize(
    ("slots", "match"),
    [
        ([7], "not unbound"),
        ([0, 0], "each slot may appear once"),
        ([[0]], "1-D integer"),
        ([0.0], "1-D integer"),
    ],
    ids=["never-allocated", "duplicate", "2-D", "float"],
)
def test_bind_rejects_bad_slots(slots, match):
    store = make(capacity=3, reserve=2)
    store.allocate(2)
    keys = Ks("a" * len(np.asarray(slots).reshape(-1)))
    with pytest.raises(ValueError, match=match):
        store.bind(keys, np.asarray(slots))
    with pytest.raises(ValueError, match=match):
        store.free(np.asarray(slots))
    assert store.num_unbound == 2 and len(store) == 0


def test_bind_rejects_bound_slot_and_length_mismatch():
    store = make(capacity=3, reserve=2)
    slots = store.allocate(2)
    store.bind(Ks("a"), slots[:1])
    with pytest.raises(ValueError, match="not unbound"):
        store.bind(Ks("b"), slots[:1])
    with pytest.raises(ValueError, match="expected 2 slots for 2 keys"):
        store.bind(Ks("bc"), slots[1:])
    assert store.num_unbound == 1
    # More slots than keys: refused too, not bound one key short.
    more = np.concatenate((slots[1:], store.allocate(1)))
    with pytest.raises(ValueError, match="expected 1 slots for 1 keys, got 2"):
        store.bind(Ks("b"), more)
    assert store.num_unbound == 2 and K("b") not in store and lru(store) == ["a"]


def test_bind_growth_calls_on_grow_and_keeps_all_bytes():
    events = []
    store = make(capacity=2, reserve=2, on_grow=lambda: events.append(store.arena_version))
    put(store, "ab", retain="ab")
    slots = store.allocate(2)
    store.arena_np[slots] = np.frombuffer(blk("c") + blk("d"), np.uint8).reshape(2, NB)
    store.bind(Ks("c"), slots[:1], retain_keys=Ks("c"))
    assert events == [0] and store.arena_version == 1
    assert store.num_slots == 4 and tuple(store.arena.shape) == (4 + 2, NB)
    # bound bytes and the still-unbound slot's bytes survived the copy
    assert store.get_concatenated(Ks("abc")) == blk("a") + blk("b") + blk("c")
    assert store.arena_np[slots[1]].tobytes() == blk("d")
    store.bind(Ks("d"), slots[1:])
    assert store.get_concatenated(Ks("d")) == blk("d") and store.num_unbound == 0


def test_reserve_growth_calls_on_grow_and_keeps_every_slot(caplog):
    events = []
    store = make(capacity=2, reserve=2, on_grow=lambda: events.append(store.arena_version))
    put(store, "ab")
    slots = store.allocate(2)
    store.arena_np[slots] = np.frombuffer(blk("c") + blk("d"), np.uint8).reshape(2, NB)
    with pytest.raises(RuntimeError, match="reserve of reserve_slots=2 slots is exhausted"):
        store.allocate(1)
    for bad, error in ((0, ValueError), (-1, ValueError), (1.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="extra"):
            store.grow_reserve(bad)
    assert events == [] and store.arena_version == 0  # refused calls changed nothing
    with caplog.at_level(logging.WARNING, logger=slot_space.__name__):
        store.grow_reserve(3)
    messages = [r.getMessage() for r in caplog.records]
    assert any("reserve grows from 2 to 5 slots (20 bytes)" in m for m in messages), messages
    assert events == [0] and store.arena_version == 1
    assert store.reserve_slots == 5 and store.num_slots == 2
    assert tuple(store.arena.shape) == (2 + 5, NB)
    # Bound and unbound bytes survived the copy; the new room is handed out, eviction is not.
    assert store.get_concatenated(Ks("ab")) == blk("a") + blk("b")
    assert store.arena_np[slots].tobytes() == blk("c") + blk("d")
    more = store.allocate(3)
    assert len(set(more.tolist()) | set(slots.tolist())) == 5
    store.bind(Ks("cd"), slots)
    assert store.eviction_order()[-2:] == Ks("cd") and len(store) == 2


def test_a_single_one_byte_slot_store_has_no_reserve_by_default():
    """The smallest valid sizes; a store built without ``reserve_slots`` has no reserve."""
    store = BlockStore(max_bytes=1, object_nbytes=1)
    assert (store.num_slots, store.reserve_slots, tuple(store.arena.shape)) == (1, 0, (1, 1))
    with pytest.raises(RuntimeError, match="reserve of reserve_slots=0 slots is exhausted"):
        store.allocate(1)
    store.put_array(Ks("a"), np.frombuffer(b"a", np.uint8).reshape(1, 1))
    store.put_array(Ks("b"), np.frombuffer(b"b", np.uint8).reshape(1, 1))  # evicts a
    assert store.get_concatenated(Ks("b")) == b"b" and K("a") not in store


def test_failed_growth_fails_closed():
    def refuse():
        raise MemoryError("no room")

    store = make(capacity=1, on_grow=refuse)
    put(store, "a", retain="a")
    with pytest.raises(MemoryError):
        put(store, "b")
    with pytest.raises(RuntimeError, match="closed"):
        store.get_concatenated(Ks("a"))


def test_pin_memory_without_cuda_is_a_logged_no_op(monkeypatch, caplog):
    monkeypatch.setattr(arena_module.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(arena_module, "_pin_noop_logged", False)
    with caplog.at_level(logging.INFO, logger=arena_module.__name__):
        first = make(pin_memory=True)
        make(pin_memory=True)
    assert not first.arena.is_pinned()
    assert sum("pin_memory" in r.getMessage() for r in caplog.records) == 1


CLOSED_CALLS = {
    "put": lambda s: s.put([]),
    "put_array": lambda s: s.put_array([], np.empty((0, NB), np.uint8)),
    "get_concatenated": lambda s: s.get_concatenated([]),
    "get_array": lambda s: s.get_array([]),
    "lookup_slots": lambda s: s.lookup_slots([]),
    "allocate": lambda s: s.allocate(0),
    "bind": lambda s: s.bind([], np.empty(0, np.int64)),
    "free": lambda s: s.free(np.empty(0, np.int64)),
    "contains": lambda s: K("a") in s,
    "len": len,
    "arena": lambda s: s.arena,
    "arena_np": lambda s: s.arena_np,
    "arena_version": lambda s: s.arena_version,
    "gather_into": lambda s: s.gather_into(np.empty(0, np.int64), np.empty((0, NB), np.uint8)),
    "grow_reserve": lambda s: s.grow_reserve(1),
    "num_unbound": lambda s: s.num_unbound,
    "ref_count": lambda s: s.ref_count(K("a")),
    "eviction_order": lambda s: s.eviction_order(),
    "peek_slot": lambda s: s.peek_slot(K("a")),
}


@pytest.mark.parametrize("call", list(CLOSED_CALLS.values()), ids=list(CLOSED_CALLS))
def test_use_after_close_raises(call):
    store = make(capacity=2, reserve=1)
    put(store, "a")
    call(store)  # works while open
    store.close()
    store.close()  # idempotent
    with pytest.raises(RuntimeError, match="store is closed"):
        call(store)
