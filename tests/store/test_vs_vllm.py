"""Differential test: the same random operations through vLLM 0.33.0's BlockObjectStore and ours.

After every step both stores must hold the same keys with the same bytes, the same LRU order,
reference counts and capacity, and fail with the same error types. vLLM's state is read through
its private tables (read-only peeks, pinned to 0.33.0) so that checking touches no recency.
"""

from __future__ import annotations

import itertools
import logging
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3capture.store import BlockStore
from r3capture.store.keys import as_key_objects

vllm_store = pytest.importorskip(
    "vllm.distributed.aux_output_connector.store",
    reason="vLLM 0.33.0 is not importable here; the differential test needs its BlockObjectStore",
)

NB = 4
# vLLM keys with one-byte hashes "a".."f".
KEYS = [f"vllm-artifact/0/{name.encode().hex()}" for name in "abcdef"]


@pytest.fixture(autouse=True)
def _quiet_vllm_growth_warnings():
    logger = logging.getLogger("vllm.distributed.aux_output_connector.store")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


View = tuple[set[str], list[str], dict[str, int], int, dict[str, bytes]]


def vllm_view(store) -> View:
    """(keys, LRU order, reference counts, capacity, bytes per key) from vLLM's tables."""
    arena = store._arena
    data = {
        key: bytes(arena[slot * store.object_nbytes : (slot + 1) * store.object_nbytes])
        for key, slot in store._slots.items()
    }
    return set(store._slots), list(store._lru), dict(store._references), store.num_slots, data


def our_view(store: BlockStore) -> View:
    keys = {key for key in KEYS if key in store}
    refs = {key: store.ref_count(key) for key in KEYS if store.ref_count(key)}
    data = {key: store.arena_np[store.peek_slot(key)].tobytes() for key in keys}
    return keys, store.eviction_order(), refs, store.num_slots, data


def draw_releases(data, store: BlockStore, retains: list[str]) -> list[str]:
    """Mostly releases of references that are held (so sequences run long), in any order;
    one time in fifty an extra release that may have no reference."""
    held = [key for key in KEYS for _ in range(store.ref_count(key))] + retains
    picks = data.draw(
        st.lists(st.integers(0, max(len(held) - 1, 0)), unique=True, max_size=min(3, len(held))),
        label="releases",
    )
    releases = [held[i] for i in picks]
    if data.draw(st.integers(0, 49), label="stray release?") == 0:
        releases.append(data.draw(st.sampled_from(KEYS), label="stray"))
    return releases


def outcome(fn, *args, **kwargs):
    """(result, None) or (None, error type name): the two BlockObjectStoreError classes are
    distinct objects with the same name and base."""
    try:
        return fn(*args, **kwargs), None
    except Exception as error:  # noqa: BLE001 - the type itself is what is compared
        return None, type(error).__name__


# Both differential tests: slow examples are expected, and the fixture only silences a
# logger, so it needs no reset between examples.
DIFFERENTIAL = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
STORES = given(data=st.data(), capacity=st.integers(1, 4))


@settings(DIFFERENTIAL, max_examples=300)
@STORES
def test_same_behaviour_as_vllm(data, capacity):
    theirs = vllm_store.BlockObjectStore(max_bytes=capacity * NB, object_nbytes=NB)
    ours = BlockStore(max_bytes=capacity * NB, object_nbytes=NB)
    stamps = itertools.count(1)
    for _ in range(data.draw(st.integers(1, 30), label="steps")):
        if data.draw(st.booleans(), label="put?"):
            keys = data.draw(st.lists(st.sampled_from(KEYS), max_size=5), label="keys")
            payloads = [struct.pack("<I", next(stamps)) for _ in keys]
            retains = data.draw(st.lists(st.sampled_from(KEYS), max_size=2), label="retains")
            releases = draw_releases(data, ours, retains)
            refs = {"retain_keys": retains, "release_keys": releases}
            got = outcome(ours.put, list(zip(keys, payloads)), **refs)
            objects = [vllm_store.BlockObject(k, p) for k, p in zip(keys, payloads)]
            want = outcome(theirs.put, objects, **refs)
            assert got == want
            if want[1] is not None:
                # vLLM raises a KeyError half-way through its bookkeeping (ours checks first
                # and changes nothing): past this point the two are not comparable.
                assert want[1] == "KeyError"
                return
        else:
            keys = data.draw(st.lists(st.sampled_from(KEYS), max_size=4), label="keys")
            assert outcome(ours.get_concatenated, keys) == outcome(theirs.get_concatenated, keys)
        assert our_view(ours) == vllm_view(theirs)
    for key in KEYS:  # every key through the public API, in the same order on both
        assert outcome(ours.get_concatenated, [key]) == outcome(theirs.get_concatenated, [key])
    if data.draw(st.booleans(), label="close?"):
        ours.close()
        theirs.close()
        ours.close()
        theirs.close()
        for call, args in (("put", ([],)), ("get_concatenated", (KEYS[:1],))):
            got = outcome(getattr(ours, call), *args)
            assert got == outcome(getattr(theirs, call), *args) == (None, "RuntimeError")


def test_missing_key_error_is_vllms_type():
    theirs = vllm_store.BlockObjectStore(max_bytes=NB, object_nbytes=NB)
    ours = BlockStore(max_bytes=NB, object_nbytes=NB)
    for store in (theirs, ours):
        with pytest.raises(RuntimeError) as info:
            store.get_concatenated(["vllm-artifact/0/ff"])
        assert type(info.value).__name__ == "BlockObjectStoreError"


@pytest.mark.parametrize(
    ("max_bytes", "object_nbytes"), [(8, 0), (8, -1), (3, 4)], ids=["zero", "negative", "small"]
)
def test_bad_sizes_raise_value_error_in_both(max_bytes, object_nbytes):
    with pytest.raises(ValueError):
        vllm_store.BlockObjectStore(max_bytes=max_bytes, object_nbytes=object_nbytes)
    with pytest.raises(ValueError):
        BlockStore(max_bytes=max_bytes, object_nbytes=object_nbytes)


@settings(DIFFERENTIAL, max_examples=200)
@STORES
def test_retains_cancelled_by_releases_match_vllm(data, capacity):
    """A put of no objects that retains and releases the same keys (the scheduler pinning a
    finishing request's blocks as the request lets them go): nothing changes when each key is
    distinct and held, and everything else (unheld, stored or not, repeated, a different
    set) takes the general path; both must match vLLM."""
    theirs = vllm_store.BlockObjectStore(max_bytes=capacity * NB, object_nbytes=NB)
    ours = BlockStore(max_bytes=capacity * NB, object_nbytes=NB)
    stamps = itertools.count(1)
    for _ in range(data.draw(st.integers(1, 12), label="steps")):
        keys = data.draw(st.lists(st.sampled_from(KEYS), max_size=4), label="keys")
        payloads = [struct.pack("<I", next(stamps)) for _ in keys]
        retains = data.draw(st.lists(st.sampled_from(KEYS), max_size=4), label="retains")
        refs = {"retain_keys": retains, "release_keys": draw_releases(data, ours, retains)}
        got = outcome(ours.put, list(zip(keys, payloads)), **refs)
        want = outcome(theirs.put, [vllm_store.BlockObject(k, p) for k, p in zip(keys, payloads)],
                       **refs)  # fmt: skip
        assert got == want
        if want[1] is not None:
            return
        held = [key for key in KEYS if ours.ref_count(key)]
        pins = data.draw(st.lists(st.sampled_from(held or KEYS), max_size=4), label="pins")
        if data.draw(st.booleans(), label="one unheld or stored-only key?"):
            pins.append(data.draw(st.sampled_from(KEYS), label="extra"))
        order = data.draw(st.permutations(pins), label="release order")
        extra = data.draw(st.lists(st.sampled_from(KEYS), max_size=2), label="retained only")
        let_go = data.draw(st.lists(st.sampled_from(held or KEYS), max_size=2), label="let go")
        refs = {"retain_keys": pins + extra, "release_keys": [*order, *let_go]}
        keys = data.draw(st.lists(st.sampled_from(KEYS), max_size=2), label="keys with them")
        payloads = [struct.pack("<I", next(stamps)) for _ in keys]
        got = outcome(ours.put, list(zip(keys, payloads)), **refs)
        want = outcome(theirs.put, [vllm_store.BlockObject(k, p) for k, p in zip(keys, payloads)],
                       **refs)  # fmt: skip
        assert got == want
        if want[1] is not None:
            return
        assert our_view(ours) == vllm_view(theirs)


def test_releases_cancel_their_retains_only_when_that_changes_nothing():
    store = BlockStore(max_bytes=4 * NB, object_nbytes=NB)
    a, b, c = KEYS[:3]
    store.put([(a, b"aaaa"), (b, b"bbbb"), (c, b"cccc")], retain_keys=[a, b])
    ledger = store._ledger
    objects = dict(zip((a, b, c), as_key_objects([a, b, c])))
    ka, kb, kc = (objects[key] for key in (a, b, c))
    assert ledger._cancel([ka, kb], [kb, ka]) == ((), ())
    assert ledger._cancel([kc, ka, kb], [kb, ka]) == ([kc], ())  # c retained only
    assert ledger._cancel([ka], [kb, ka]) == ((), [kb])  # b released only
    for retains, releases in (
        ([ka, kc], [kc, ka]),  # c is not held: its release makes it unreferenced
        ([ka, ka], [ka, ka]),  # repeated
        ([ka, kb, kb], [ka, kb]),  # a retain repeated
        ([kb], [ka, ka]),  # a release repeated
        ([ka], [kb]),  # nothing in common
    ):
        assert ledger._cancel(retains, releases) == (retains, releases)
