"""Random operation sequences: BlockStore against a small, obviously correct model."""

from __future__ import annotations

import copy
import itertools
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3capture.store import BlockObjectStoreError, BlockStore

NB = 4
# vLLM keys with one-byte hashes "a".."f".
KEYS = [f"vllm-artifact/0/{name.encode().hex()}" for name in "abcdef"]


class ModelStore:
    """The store's semantics with plain lists and no slots (vLLM 0.33.0's rules)."""

    def __init__(self, capacity: int, reserve: int) -> None:
        self.capacity = capacity
        self.reserve = reserve
        self.data: dict[str, bytes] = {}
        self.refs: dict[str, int] = {}
        self.lru: list[str] = []  # unreferenced stored keys, next victim first
        self.unbound = 0

    def _to_end(self, key: str) -> None:
        if key in self.lru:
            self.lru.remove(key)
        self.lru.append(key)

    def put(self, objects, retains=(), releases=()) -> None:
        held = {key: self.refs.get(key, 0) + list(retains).count(key) for key in releases}
        for key in set(releases):
            if list(releases).count(key) > held[key]:
                raise KeyError(key)
        batch: dict[str, bytes] = {}
        for key, payload in objects:
            batch[key] = payload  # first occurrence fixes the order, the last payload wins
        referenced_at_start = {key for key in batch if self.refs.get(key, 0)}
        for key in batch:
            if key in self.data and key not in referenced_at_start:
                del self.data[key]
                self.lru.remove(key)
        for key in retains:
            self.refs[key] = self.refs.get(key, 0) + 1
            if key in self.lru:
                self.lru.remove(key)
        terminal = []
        for key in releases:
            self.refs[key] -= 1
            if not self.refs[key]:
                del self.refs[key]
                terminal.append(key)
        for key, payload in batch.items():
            self.data.setdefault(key, payload)
        for key in list(batch) + terminal:
            if key in self.data and not self.refs.get(key):
                self._to_end(key)
        protected = set(batch) - set(terminal)
        excess = len(self.data) - self.capacity
        for key in [key for key in self.lru if key not in protected][: max(excess, 0)]:
            self.lru.remove(key)
            del self.data[key]
        if len(self.data) > self.capacity:
            self.capacity = max(len(self.data), 2 * self.capacity)

    def get(self, keys) -> bytes:
        for key in keys:
            if key not in self.data:
                raise BlockObjectStoreError(key)
        for key in keys:
            if key in self.lru:
                self._to_end(key)
        return b"".join(self.data[key] for key in keys)

    def allocate(self, n: int) -> None:
        if self.unbound + n > self.reserve:
            raise RuntimeError("reserve exhausted")
        self.unbound += n


def assert_same(store: BlockStore, model: ModelStore, held: list[int]) -> None:
    """Compare everything observable without touching recency."""
    assert {key for key in KEYS if key in store} == set(model.data)
    assert len(store) == len(model.data)
    assert store.eviction_order() == model.lru
    assert {key: store.ref_count(key) for key in KEYS} == {k: model.refs.get(k, 0) for k in KEYS}
    assert store.num_slots == model.capacity
    assert store.num_unbound == model.unbound == len(held)
    bound = {key: store.peek_slot(key) for key in model.data}
    for key, slot in bound.items():
        assert store.arena_np[slot].tobytes() == model.data[key], key
    slots = list(bound.values()) + held
    assert len(set(slots)) == len(slots)
    assert all(0 <= s < store.num_slots + store.reserve_slots for s in slots)
    assert len(store.arena_np) == store.num_slots + store.reserve_slots


def outcome(fn, *args, **kwargs):
    """(result, None), or (None, error type) for the errors the store may raise."""
    try:
        return fn(*args, **kwargs), None
    except (KeyError, ValueError, RuntimeError) as error:
        return None, type(error)


key_lists = st.lists(st.sampled_from(KEYS), max_size=5)


@pytest.mark.parametrize("bulk", [False, True], ids=["few-refs", "bulk-refs"])
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), capacity=st.integers(1, 4), reserve=st.integers(0, 3))
def test_store_matches_model(bulk, data, capacity, reserve):
    """``bulk``: pins arrive by the dozens with repeats (a prompt's samples sharing blocks),
    which takes the store's counting paths for large retain and release batches."""
    store = BlockStore(max_bytes=capacity * NB, object_nbytes=NB, reserve_slots=reserve)
    model = ModelStore(capacity, reserve)
    stamps = itertools.count(1)
    held: list[int] = []  # allocated, not yet bound or freed

    def payloads(n):
        return [struct.pack("<I", next(stamps)) for _ in range(n)]

    for _ in range(data.draw(st.integers(1, 25), label="steps")):
        op = data.draw(
            st.sampled_from(["put", "put_array", "get", "refs", "allocate", "bind", "free", "bad"])
        )
        retains = data.draw(st.lists(st.sampled_from(KEYS), max_size=2), label="retains")
        if bulk:
            retains *= 40
            # Repeated releases of held keys (possibly more than held: an error case).
            chosen = data.draw(st.lists(st.sampled_from(KEYS), max_size=3), label="released")
            releases = chosen * data.draw(st.integers(1, 90), label="times")
        else:
            held_refs = [key for key, count in sorted(model.refs.items()) for _ in range(count)]
            releases = data.draw(st.permutations(held_refs + retains), label="releases")[:3]
        if data.draw(st.integers(0, 9), label="stray release?") == 0:
            releases.append(data.draw(st.sampled_from(KEYS), label="stray"))
        if op in ("put", "put_array", "refs"):
            keys = data.draw(key_lists, label="keys") if op != "refs" else []
            objects = list(zip(keys, payloads(len(keys))))
            refs = {"retain_keys": retains, "release_keys": releases}
            if op == "put_array":
                raw = b"".join(p for _, p in objects)
                blocks = np.frombuffer(raw, np.uint8).reshape(len(keys), NB)
                got = outcome(store.put_array, keys, blocks, **refs)
            else:
                got = outcome(store.put, objects, **refs)
            assert got[1] == outcome(model.put, objects, retains, releases)[1]
        elif op == "get":
            keys = data.draw(key_lists, label="keys")
            assert outcome(store.get_concatenated, keys) == outcome(model.get, keys)
        elif op == "allocate":
            n = data.draw(st.integers(0, 3), label="n")
            got = outcome(store.allocate, n)
            assert got[1] == outcome(model.allocate, n)[1]
            if got[1] is None:
                held.extend(got[0].tolist())
        elif op in ("bind", "free"):
            chosen = data.draw(st.permutations(held), label="order")[
                : data.draw(st.integers(0, len(held)), label="count")
            ]
            if op == "free":
                store.free(np.array(chosen, dtype=np.int64))
                model.unbound -= len(chosen)
            else:
                keys = data.draw(
                    st.lists(st.sampled_from(KEYS), min_size=len(chosen), max_size=len(chosen))
                )
                objects = list(zip(keys, payloads(len(keys))))
                for slot, (_, payload) in zip(chosen, objects):
                    store.arena_np[slot] = np.frombuffer(payload, np.uint8)
                slots = np.array(chosen, dtype=np.int64)
                # Retains applied first: a retain-only call and this one, in one call.
                first = data.draw(st.lists(st.sampled_from(KEYS), max_size=2), label="first")
                got = outcome(
                    store.bind,
                    keys,
                    slots,
                    retain_keys=retains,
                    release_keys=releases,
                    retain_first_keys=first,
                )
                before = copy.deepcopy(model)
                model.put([], first)
                expected = outcome(model.put, objects, retains, releases)[1]
                if expected is not None:  # a failed release check changes nothing
                    model = before
                assert got[1] == expected
                if got[1] is None:
                    model.unbound -= len(chosen)
            if op == "free" or got[1] is None:
                held = [slot for slot in held if slot not in chosen]
        else:  # a slot that is not unbound must be refused without any change
            bound = [store.peek_slot(key) for key in model.data]
            if bound:
                got = outcome(store.bind, KEYS[:1], np.array(bound[:1], dtype=np.int64))
                assert got[1] is ValueError
        assert_same(store, model, held)
