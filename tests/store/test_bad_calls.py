"""BlockStore refuses malformed calls by name and changes nothing, from any reachable state.

Hypothesis builds a store through valid publications, reads and producer allocations, then
makes one malformed call; the store's whole observable state (keys, slots, reference counts,
eviction order, reserve, arena bytes) must be what it was.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3capture.store import BlockObjectStoreError, BlockStore, key_rows_from_strings

NB = 4
CAPACITY, RESERVE = 4, 2
KEYS = [f"vllm-artifact/0/{bytes([i]).hex()}" for i in range(8)]


def fingerprint(store: BlockStore) -> tuple:
    ledger = store._ledger
    return (
        dict(ledger._slots),
        dict(ledger._refs),
        store.eviction_order(),
        store.num_unbound,
        store.num_slots,
        store.arena_version,
        hashlib.sha256(store.arena_np.tobytes()).hexdigest(),
    )


@st.composite
def reachable_stores(draw) -> BlockStore:
    """A store after up to 8 valid calls (puts with retains/releases, reads, allocations)."""
    store = BlockStore(max_bytes=CAPACITY * NB, object_nbytes=NB, reserve_slots=RESERVE)
    held: list[str] = []
    for _ in range(draw(st.integers(0, 8))):
        kind = draw(st.sampled_from(["put", "get", "allocate"]))
        if kind == "put":
            keys = draw(st.lists(st.sampled_from(KEYS), max_size=3))
            retains = draw(st.lists(st.sampled_from(KEYS), max_size=2))
            releases = (
                draw(st.lists(st.sampled_from(held), max_size=2, unique=True)) if held else []
            )
            store.put(
                [(k, bytes([i]) * NB) for i, k in enumerate(keys)],
                retain_keys=retains,
                release_keys=releases,
            )
            held += retains
            for key in releases:
                held.remove(key)
        elif kind == "get":
            stored = [k for k in KEYS if k in store]
            if stored:
                store.get_array(draw(st.lists(st.sampled_from(stored), min_size=1, max_size=3)))
        elif store.num_unbound < RESERVE:
            store.allocate(1)
    return store


def _release_unheld(store: BlockStore) -> None:
    unheld = [k for k in KEYS if not store.ref_count(k)]
    store.put([], release_keys=unheld[:1])


def _read_only_out(store: BlockStore) -> None:
    keys = [k for k in KEYS if k in store][:2] or KEYS[:1]
    out = np.zeros((len(keys), NB), np.uint8)  # the right shape: only its flag is wrong
    out.flags.writeable = False
    store.get_array(keys, out=out)


def _get_into_strided(store: BlockStore) -> None:
    keys = [k for k in KEYS if k in store][:2] or KEYS[:1]
    store.get_array(keys, out=np.zeros((len(keys), 2 * NB), np.uint8)[:, ::2])


def _bytearray_out(store: BlockStore) -> None:
    keys = [k for k in KEYS if k in store][:1] or KEYS[:1]
    store.get_array(keys, out=bytearray(NB))


MALFORMED_CALLS = {
    # name -> (what the message must contain, call)
    "put-short-payload": ("object_nbytes", lambda s: s.put([(KEYS[0], b"x")])),
    "put-str-payload": ("payload", lambda s: s.put([(KEYS[0], "abcd")])),
    "put-bad-key": ("is not a store key", lambda s: s.put([("vllm-artifact/x", b"abcd")])),
    "put-int-key": ("key", lambda s: s.put([(7, b"abcd")])),
    "put-bad-retain": (
        "is not a store key",
        lambda s: s.put([(KEYS[0], b"abcd")], retain_keys=["nope"]),
    ),
    "put-unheld-release": ("released 1 time", _release_unheld),
    "put-array-wrong-rows": (
        "blocks",
        lambda s: s.put_array(KEYS[:2], np.zeros((3, NB), np.uint8)),
    ),
    "put-array-strided": (
        "blocks",
        lambda s: s.put_array(KEYS[:2], np.zeros((2, 2 * NB), np.uint8)[:, ::2]),
    ),
    "put-array-inner-transposed": (
        "blocks",
        lambda s: s.put_array(KEYS[:2], np.zeros((2, NB // 2, 2), np.uint8).transpose(0, 2, 1)),
    ),
    "get-missing": ("max_bytes", lambda s: s.get_array([k for k in KEYS if k not in s][:1])),
    "get-bad-out-size": ("out", lambda s: s.get_array(KEYS[:1], out=np.zeros(NB + 1, np.uint8))),
    "get-readonly-out": ("out: expected a writable numpy array, got a read-only", _read_only_out),
    "get-strided-out": ("out: expected a C-contiguous", _get_into_strided),
    "get-bytearray-out": ("out: expected a writable numpy array, got bytearray", _bytearray_out),
    "get-key-rows-wrong-dtype": ("key", lambda s: s.get_array(np.zeros((1, 5), np.int64))),
    "lookup-bad-key": ("is not a store key", lambda s: s.lookup_slots(["vllm-artifact/0/zz"])),
    "allocate-float": ("n must be an int", lambda s: s.allocate(1.5)),
    "allocate-negative": ("n must be >= 0", lambda s: s.allocate(-1)),
    "allocate-past-reserve": ("reserve_slots", lambda s: s.allocate(RESERVE + 1)),
    "bind-past-arena": ("slot", lambda s: s.bind(KEYS[:1], np.array([CAPACITY + RESERVE]))),
    "bind-negative-slot": ("slot", lambda s: s.bind(KEYS[:1], np.array([-1]))),
    "bind-count-mismatch": ("slots", lambda s: s.bind(KEYS[:2], np.zeros(0, np.int64))),
    "bind-float-slots": ("slot", lambda s: s.bind(KEYS[:1], np.array([0.5]))),
    "bind-2d-slots": ("1-D integer array", lambda s: s.bind(KEYS[:2], np.zeros((1, 2), np.int64))),
    "free-scalar-slot": ("1-D integer array", lambda s: s.free(np.int64(0))),
    "free-unallocated": ("slot", lambda s: s.free(np.array([CAPACITY + RESERVE + 3]))),
}


@settings(max_examples=150, deadline=None)
@given(store=reachable_stores(), name=st.sampled_from(sorted(MALFORMED_CALLS)))
def test_malformed_call_is_named_and_changes_nothing(store, name):
    expected, call = MALFORMED_CALLS[name]
    if name == "get-missing" and all(k in store for k in KEYS):
        return  # nothing is missing in this state
    before = fingerprint(store)
    errors = (ValueError, TypeError, KeyError, RuntimeError, BlockObjectStoreError)
    with pytest.raises(errors) as info:
        call(store)
    assert expected in str(info.value), f"{name}: {info.value}"
    assert fingerprint(store) == before, f"{name} changed the store"


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"max_bytes": 16, "object_nbytes": 2.5}, "object_nbytes"),
        ({"max_bytes": 16, "object_nbytes": 4, "reserve_slots": 1.5}, "reserve_slots"),
        ({"max_bytes": None, "object_nbytes": 4}, "max_bytes"),
        ({"max_bytes": "4", "object_nbytes": 4}, "max_bytes"),
        ({"max_bytes": 16, "object_nbytes": True}, "object_nbytes"),
        ({"max_bytes": 16, "object_nbytes": 4, "reserve_slots": -1}, "reserve_slots"),
    ],
)
def test_constructor_names_the_argument(kwargs, name):
    """Each was truncated or failed with an unnamed TypeError before (issue 10)."""
    with pytest.raises((TypeError, ValueError), match=f"^{name} must"):
        BlockStore(**kwargs)


def test_key_rows_and_strings_agree_for_the_drawn_keys():
    """The property's keys are well-formed: their key rows round-trip."""
    rows = key_rows_from_strings(KEYS)
    assert rows.shape == (len(KEYS), 5) and len({r.tobytes() for r in rows}) == len(KEYS)


@pytest.mark.parametrize("num_keys", [1, 15, 16, 20], ids=lambda n: f"{n}keys")
@pytest.mark.parametrize("bad_out", ["read-only", "strided", "transposed"])
def test_get_array_into_a_bad_out_is_refused_before_any_recency_moves(num_keys, bad_out):
    """Below 16 keys the arena gathers with numpy, from 16 on with torch: either way a bad
    ``out`` is refused by name, and neither the keys' recency nor ``out`` changes."""
    nb = 8
    store = BlockStore(max_bytes=24 * nb, object_nbytes=nb)
    keys = [f"vllm-artifact/0/{i:04x}" for i in range(24)]
    store.put([(k, bytes([i]) * nb) for i, k in enumerate(keys)])
    if bad_out == "read-only":
        out = np.zeros((num_keys, nb), np.uint8)
        out.flags.writeable = False
    elif bad_out == "strided":
        out = np.zeros((num_keys, 2 * nb), np.uint8)[:, ::2]
    else:  # rows of the right size whose inner layout is transposed
        out = np.zeros((num_keys, nb // 2, 2), np.uint8).transpose(0, 2, 1)
    out_before = out.copy()
    before = fingerprint(store)
    with pytest.raises(ValueError, match="^out: expected"):
        store.get_array(keys[:num_keys], out=out)
    assert fingerprint(store) == before
    assert np.array_equal(out, out_before)
