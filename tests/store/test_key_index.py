"""KeyIndex: batch find / insert / remove against a dict, on keys that collide in the table."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from key_pools import colliding_rows, structured_rows

import r3capture.store.key_index as key_index
from r3capture.store import key_rows
from r3capture.store.key_index import MIN_BUCKETS, KeyIndex, bucket_hash


def check_against(index: KeyIndex, model: dict[bytes, int]) -> None:
    """Every live key maps to its id, ids are distinct and within the capacity."""
    assert len(index) == len(model)
    if model:
        rows = np.frombuffer(b"".join(model), np.uint64).reshape(len(model), -1)
        np.testing.assert_array_equal(index.find(rows), list(model.values()))
        np.testing.assert_array_equal(index.rows(np.array(list(model.values()))), rows)
    ids = list(model.values())
    assert len(set(ids)) == len(ids) and all(0 <= i < index.capacity for i in ids)


def test_find_insert_remove_basics():
    index = KeyIndex()
    rows = structured_rows(5)
    np.testing.assert_array_equal(index.find(rows), [-1] * 5)
    ids, created = index.find_or_insert(rows[[0, 1, 0, 2]])
    assert ids[0] == ids[2] and len(set(ids.tolist())) == 3
    assert sorted(created.tolist()) == sorted(set(ids.tolist()))
    again, created = index.find_or_insert(rows[[2, 3]])
    assert again[0] == ids[3] and created.tolist() == [again[1]]
    index.remove(ids[[0]])
    found = index.find(rows)
    assert found[0] == -1 and found[1] == ids[1] and found[4] == -1
    assert len(index) == 3
    # A removed id is reused by the next insert.
    reused, created = index.find_or_insert(rows[[4]])
    assert reused[0] == ids[0] and created.tolist() == [ids[0]]
    assert index.find(rows[:0]).shape == (0,)


def test_grows_and_shrinks_with_the_live_entries():
    index = KeyIndex(entries=4)
    rows = structured_rows(3000)
    ids, _ = index.find_or_insert(rows)
    assert len(index) == 3000 and index.capacity >= 3000
    assert index.num_buckets >= 4 * 3000
    np.testing.assert_array_equal(index.find(rows), ids)
    index.remove(ids[:2990])
    assert index.num_buckets <= 32 * 10 or index.num_buckets == MIN_BUCKETS
    np.testing.assert_array_equal(index.find(rows[2990:]), ids[2990:])
    np.testing.assert_array_equal(index.find(rows[:2990]), np.full(2990, -1))


def test_churn_keeps_the_table_within_its_load():
    """Removals count against the load until a rebuild, so a store that evicts and inserts
    forever keeps short probes and a table sized to its live keys."""
    index = KeyIndex()
    rows = structured_rows(5000)
    live, _ = index.find_or_insert(rows[:100])
    for cycle in range(49):
        index.remove(live[:50])
        fresh, _ = index.find_or_insert(rows[100 + 50 * cycle : 150 + 50 * cycle])
        live = np.concatenate((live[50:], fresh))
        assert (len(index) + index._removed) * 4 <= index.num_buckets <= 16 * 128
    assert index._reach.max() <= 16
    np.testing.assert_array_equal(index.find(rows[2500:2550]), live[-50:])


@pytest.mark.parametrize("item_size", [32, 16, 4], ids=lambda s: f"{s}B")
def test_structured_hashes_spread_like_random_ones(item_size):
    """Counters in the last bytes of otherwise equal hashes must not pile up in the table."""
    results = {}
    for name, rows in (
        ("structured", structured_rows(4000, item_size)),
        ("random", key_rows(0, np.random.default_rng(7).bytes(4000 * item_size), item_size)),
    ):
        index = KeyIndex()
        ids, _ = index.find_or_insert(rows)
        home = (bucket_hash(rows) >> index._shift).astype(np.int64)
        at_home = np.mean(index._bucket_of[ids] == home)
        results[name] = (at_home, int(index._reach.max()))
    (structured_home, structured_reach), (random_home, random_reach) = results.values()
    assert structured_home > random_home - 0.05
    assert structured_reach <= max(2 * random_reach, 8)


def test_generations_of_one_hash_spread():
    rows = np.concatenate([key_rows(g, bytes(32), 32) for g in range(2000)])
    index = KeyIndex()
    ids, _ = index.find_or_insert(rows)
    home = (bucket_hash(rows) >> index._shift).astype(np.int64)
    assert np.mean(index._bucket_of[ids] == home) > 0.8


key_pool = st.lists(st.integers(0, 19), max_size=12)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), seed=st.integers(0, 3))
def test_matches_a_dict_on_colliding_keys(data, seed):
    """Twenty keys homing at one bucket of every table the index uses at this size: probes,
    reaches, removals that empty buckets inside a run, and rebuilds all happen."""
    pool = colliding_rows(20, seed)
    index = KeyIndex(entries=2)
    model: dict[bytes, int] = {}
    for _ in range(data.draw(st.integers(1, 30), label="steps")):
        op = data.draw(st.sampled_from(["insert", "remove", "find"]))
        picks = data.draw(key_pool, label="keys")
        rows = pool[picks] if picks else pool[:0]
        if op == "insert":
            before = dict(model)
            ids, created = index.find_or_insert(rows)
            fresh = {}
            for pick, entry in zip(picks, ids.tolist()):
                key = pool[pick].tobytes()
                if key in before:
                    assert entry == before[key]
                else:
                    assert fresh.setdefault(key, entry) == entry  # a repeat shares its entry
            assert sorted(created.tolist()) == sorted(fresh.values())
            assert not set(fresh.values()) & set(before.values())
            model.update(fresh)
        elif op == "remove":
            live = list(model)
            chosen = data.draw(st.permutations(live), label="order")[
                : data.draw(st.integers(0, len(live)), label="count")
            ]
            index.remove(np.array([model.pop(key) for key in chosen], dtype=np.int64))
        else:
            expected = [model.get(pool[pick].tobytes(), -1) for pick in picks]
            np.testing.assert_array_equal(index.find(rows), expected)
        check_against(index, model)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.lists(
        st.tuples(st.sampled_from(["insert", "remove"]), st.lists(st.integers(0, 11))),
        max_size=20,
    )
)
def test_correct_when_every_key_has_the_same_hash(steps):
    """A degenerate hash gives every key one home and one fingerprint: lookups must fall back
    to comparing full rows, and inserts must still tell twins from other keys."""
    pool = structured_rows(12)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(key_index, "bucket_hash", lambda rows: np.zeros(len(rows), np.uint64))
        index = KeyIndex(entries=2)
        model: dict[bytes, int] = {}
        for op, picks in steps:
            if op == "insert":
                ids, _ = index.find_or_insert(pool[picks] if picks else pool[:0])
                for pick, entry in zip(picks, ids.tolist()):
                    assert model.setdefault(pool[pick].tobytes(), entry) == entry
            else:
                gone = {pool[pick].tobytes() for pick in picks} & model.keys()
                index.remove(np.array([model.pop(key) for key in gone], dtype=np.int64))
            check_against(index, model)
