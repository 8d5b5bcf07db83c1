"""Model-based test on key rows: BlockStore driven through its array API against vLLM 0.33.0's
BlockObjectStore driven with the same keys as strings. Ours gets each call's keys in one of
its forms: rows, strings, the key objects a caller keeps (the same objects call after call,
as the worker hands them) or equal objects made afresh.

The keys are near-identical (one byte, the generation or the hash length apart), so a store
that compared less than a whole key row would mix them up. Traffic: publications by
``put_array`` and by allocate + write + ``bind`` (duplicates in a batch), bulk retains and
releases with repeats, lookups, growth, and error cases. After every step both stores hold the
same keys, bytes, reference counts, capacity and eviction order. An error must be vLLM's error
type and leave our store unchanged; vLLM's store is rebuilt from ours after its half-done
KeyError.
"""

from __future__ import annotations

import functools
import itertools
import logging
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from key_pools import similar_rows

from r3capture.store import BlockStore, KeyObjects, key_objects, key_string

vllm_store = pytest.importorskip(
    "vllm.distributed.aux_output_connector.store",
    reason="vLLM 0.33.0 is not importable here; the differential test needs its BlockObjectStore",
)

NB = 4
POOL_SIZE = 8


@pytest.fixture(autouse=True)
def _quiet_growth_warnings():
    loggers = [logging.getLogger(vllm_store.__name__), logging.getLogger("r3capture.store")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    yield
    for logger, level in zip(loggers, levels):
        logger.setLevel(level)


class Keys:
    """A pool of near-identical key rows, their vLLM strings and one key object each."""

    def __init__(self, seed: int) -> None:
        self.rows = similar_rows(POOL_SIZE, seed, item_sizes=(32, 16))
        self.strings = [key_string(row) for row in self.rows]
        self.objects = key_objects(self.rows)

    def as_rows(self, picks: list[int]) -> np.ndarray:
        return self.rows[picks] if picks else self.rows[:0]

    def as_strings(self, picks: list[int]) -> list[str]:
        return [self.strings[i] for i in picks]

    def as_objects(self, picks: list[int]) -> KeyObjects:
        """The pool's own objects, as a caller that keeps them (the worker) hands them back."""
        return KeyObjects(self.objects[i] for i in picks)

    def as_new_objects(self, picks: list[int]) -> KeyObjects:
        """Equal objects made afresh: the store must match them by value."""
        return key_objects(self.as_rows(picks).copy())

    def converter(self, form: str):
        return getattr(self, f"as_{form}")


FORMS = ("rows", "strings", "objects", "new_objects")


@functools.cache
def pool(seed: int) -> Keys:
    return Keys(seed)


View = tuple[set[str], list[str], dict[str, int], int, dict[str, bytes]]


def vllm_view(store) -> View:
    """(keys, LRU order, reference counts, capacity, bytes per key) from vLLM's tables."""
    arena = store._arena
    data = {
        key: bytes(arena[slot * store.object_nbytes : (slot + 1) * store.object_nbytes])
        for key, slot in store._slots.items()
    }
    return set(store._slots), list(store._lru), dict(store._references), store.num_slots, data


def our_view(store: BlockStore, keys: Keys, *, both_forms: bool = False) -> View:
    """The same through the public introspection API (keys as rows; ``both_forms`` also
    checks that their strings name the same keys)."""
    stored = {s for row, s in zip(keys.rows, keys.strings) if row in store}
    refs = {s: store.ref_count(row) for row, s in zip(keys.rows, keys.strings)}
    if both_forms:
        assert stored == {s for s in keys.strings if s in store}
        assert refs == {s: store.ref_count(s) for s in keys.strings}
    data = {s: store.arena_np[store.peek_slot(s)].tobytes() for s in stored}
    assert len(store) == len(stored)
    live = {s: n for s, n in refs.items() if n}
    return stored, store.eviction_order(), live, store.num_slots, data


def vllm_copy(store: BlockStore, keys: Keys):
    """A vLLM store in our store's state (used after vLLM failed half-way through a call)."""
    _, order, refs, num_slots, data = our_view(store, keys)
    copy = vllm_store.BlockObjectStore(max_bytes=num_slots * NB, object_nbytes=NB)
    held = [key for key in data if key in refs]
    copy.put(
        [vllm_store.BlockObject(key, data[key]) for key in order + held],
        retain_keys=[key for key, count in refs.items() for _ in range(count)],
    )
    assert vllm_view(copy)[1:] == our_view(store, keys)[1:]
    return copy


def outcome(fn, *args, **kwargs):
    """(result, None) or (None, error type name)."""
    try:
        return fn(*args, **kwargs), None
    except Exception as error:  # noqa: BLE001 - the type itself is what is compared
        return None, type(error).__name__


def releases_are_valid(theirs, retains: list[str], releases: list[str]) -> bool:
    """vLLM 0.33.0 raises KeyError half-way iff a key is released more often than it is held
    (its references plus this call's retains)."""
    return all(
        releases.count(key) <= theirs._references.get(key, 0) + retains.count(key)
        for key in set(releases)
    )


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data(), capacity=st.integers(1, 4), seed=st.integers(0, 2))
def test_key_rows_behave_like_vllm(data, capacity, seed):
    keys = pool(seed)
    theirs = vllm_store.BlockObjectStore(max_bytes=capacity * NB, object_nbytes=NB)
    ours = BlockStore(max_bytes=capacity * NB, object_nbytes=NB, reserve_slots=POOL_SIZE)
    stamps = itertools.count(1)
    picks = st.lists(st.integers(0, POOL_SIZE - 1), max_size=6)
    for _ in range(data.draw(st.integers(1, 30), label="steps")):
        before = our_view(ours, keys)
        op = data.draw(st.sampled_from(["put_array", "bind", "refs", "get", "lookup", "bad"]))
        if op in ("put_array", "bind", "refs"):
            batch = data.draw(picks, label="batch") if op != "refs" else []
            payloads = [struct.pack("<I", next(stamps)) for _ in batch]
            retains = data.draw(picks, label="retains") * data.draw(st.integers(1, 20))
            held = [i for i, s in enumerate(keys.strings) for _ in range(ours.ref_count(s))]
            releases = data.draw(st.permutations(held + retains), label="releases")
            releases = releases[: data.draw(st.integers(0, len(releases)), label="count")]
            if data.draw(st.integers(0, 9), label="over-release?") == 0:
                releases += data.draw(picks, label="extra")
            convert = keys.converter(data.draw(st.sampled_from(FORMS), label="refs' form"))
            refs = {"retain_keys": convert(retains), "release_keys": convert(releases)}
            as_batch = keys.converter(data.draw(st.sampled_from(FORMS), label="batch form"))
            blocks = np.frombuffer(b"".join(payloads), np.uint8).reshape(len(batch), NB)
            if op == "bind":
                slots = ours.allocate(len(batch))
                ours.arena_np[slots] = blocks
                got = outcome(ours.bind, as_batch(batch), slots, **refs)
                if got[1] is not None:
                    ours.free(slots)
            else:
                got = outcome(ours.put_array, as_batch(batch), blocks, **refs)
            objects = [vllm_store.BlockObject(keys.strings[i], p) for i, p in zip(batch, payloads)]
            valid = releases_are_valid(theirs, keys.as_strings(retains), keys.as_strings(releases))
            want = outcome(
                theirs.put,
                objects,
                retain_keys=keys.as_strings(retains),
                release_keys=keys.as_strings(releases),
            )
            assert got == want and (want[1] is None) == valid
            if want[1] is not None:
                assert our_view(ours, keys) == before  # ours checked first: nothing changed
                theirs = vllm_copy(ours, keys)
        elif op == "get":
            batch = data.draw(picks, label="keys")
            convert = keys.converter(data.draw(st.sampled_from(FORMS), label="form"))
            got = outcome(ours.get_array, convert(batch))
            want = outcome(theirs.get_concatenated, keys.as_strings(batch))
            assert (got[0].tobytes() if got[1] is None else None, got[1]) == want
        elif op == "lookup":
            batch = data.draw(picks, label="keys")
            held = all(ours.ref_count(keys.rows[i]) for i in batch)
            convert = keys.converter(data.draw(st.sampled_from(FORMS), label="form"))
            got = outcome(ours.lookup_slots, convert(batch), held=held)
            want = outcome(theirs.get_concatenated, keys.as_strings(batch))
            assert got[1] == want[1]
            if got[1] is None:
                assert ours.arena_np[got[0]].tobytes() == want[0]
        else:  # rejected arguments change nothing, recency included
            rows = keys.as_rows(data.draw(picks.filter(bool), label="keys"))
            bad = {
                "blocks": (ours.put_array, rows, np.zeros((1, NB + 1))),
                "out": (ours.get_array, rows, np.empty(3, np.uint8)),
                "slots": (ours.bind, rows[:1], np.array([10**6])),
                "key": (ours.lookup_slots, [key_string(rows[0]), "vllm-artifact/x"]),
            }
            call, *args = bad[data.draw(st.sampled_from(sorted(bad)), label="bad call")]
            assert outcome(call, *args)[1] == "ValueError"
        assert our_view(ours, keys) == vllm_view(theirs)
        if op == "bad":
            assert our_view(ours, keys) == before
    assert our_view(ours, keys, both_forms=True) == vllm_view(theirs)
