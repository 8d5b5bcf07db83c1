"""RequestTable: rows, keys and the per-request slot ring (numpy only, no torch, no store)."""

from __future__ import annotations

from copy import deepcopy

import numpy as np
import pytest

from r3capture.aux_output.request_table import NO_CURSOR, RequestTable
from r3capture.store import KEY_WORDS, KeyObjects, key_objects, rows_of_key_objects


def keys(*values: int) -> KeyObjects:
    rows = np.zeros((len(values), KEY_WORDS), np.uint64)
    rows[:, 1] = values
    return key_objects(rows)


def hash_words(keys: KeyObjects) -> list[int]:
    """Word 1 of each key (the value ``keys`` put there)."""
    return rows_of_key_objects(keys)[:, 1].tolist()


def extend(table, rows, firsts, counts, slots):
    """``table.rings.extend`` on lists (int64 arrays, as the commit passes them)."""
    table.rings.extend(*(np.asarray(a, np.int64) for a in (rows, firsts, counts, slots)))


def test_extend_starts_new_rows_at_their_first_block_and_wraps():
    table = RequestTable(ring_width=4)
    assert table.rings.ring.shape == (table.capacity, 4) and table.rings.ring.dtype == np.int32
    a, b = table.add("a", 0), table.add("b", 0)
    # New rows: a takes blocks 5..7, b blocks 0..1; each row's base is its first block.
    extend(table, [a, b], [5, 0], [3, 2], [10, 11, 12, 20, 21])
    rings = table.rings
    assert (rings.base[a], rings.end[a], rings.base[b], rings.end[b]) == (5, 8, 0, 2)
    assert table.rings.ring[a].tolist() == [-1, 10, 11, 12]  # blocks 5, 6, 7 at block % 4
    assert table.rings.ring[b].tolist() == [20, 21, -1, -1]
    assert table.rings.unbound_slots(np.array([a, b])).tolist() == [10, 11, 12, 20, 21]
    # a hands blocks 5 and 6 to the store, then continues at its end (8) into columns that
    # wrap around; its base stays where the store left it.
    assert table.rings.take_leading(np.array([a]), np.array([2])).tolist() == [10, 11]
    assert (table.rings.base[a], table.rings.end[a]) == (7, 8)
    extend(table, [a], [8], [3], [13, 14, 15])
    assert (table.rings.base[a], table.rings.end[a]) == (7, 11)
    assert table.rings.ring[a].tolist() == [13, 14, 15, 12]  # blocks 8, 9, 10 wrapped
    assert table.rings.unbound_slots(np.array([a])).tolist() == [12, 13, 14, 15]
    # b continues at its end; a is untouched.
    extend(table, [b], [2], [1], [22])
    assert table.rings.unbound_slots(np.array([a])).tolist() == [12, 13, 14, 15]
    assert table.rings.unbound_slots(np.array([b])).tolist() == [20, 21, 22]
    # The arena row of a position, as the emit reads it, wraps the same way.
    positions = np.array([7 * 16 + 3, 10 * 16 + 15, 2 * 16])
    assert table.rings.arena_rows(np.array([a, a, b]), positions, 16).tolist() == [
        12 * 16 + 3,
        15 * 16 + 15,
        22 * 16,
    ]


def test_extend_of_a_row_whose_blocks_were_all_bound_continues_at_its_end():
    """A row that handed every block to the store (``base == end > 0``) still has blocks:
    its next slots start at its end, not at a new first block."""
    table = RequestTable(ring_width=2)
    a = table.add("a", 0)
    extend(table, [a], [3], [2], [7, 8])
    table.rings.take_leading(np.array([a]), np.array([2]))
    assert (table.rings.base[a], table.rings.end[a]) == (5, 5)
    extend(table, [a], [5], [2], [9, 10])  # a full ring again: 5..6
    assert (table.rings.base[a], table.rings.end[a]) == (5, 7)
    assert table.rings.unbound_slots(np.array([a])).tolist() == [9, 10]


def test_ring_overflow_is_refused_before_any_change():
    table = RequestTable(ring_width=3)
    a, b = table.add("a", 0), table.add("b", 0)
    extend(table, [a], [0], [2], [1, 2])
    state = (table.rings.ring.copy(), table.rings.base.copy(), table.rings.end.copy())

    def unchanged():
        return all(np.array_equal(x, y) for x, y in zip(state, (table.rings.ring, table.rings.base,
                                                                table.rings.end)))  # fmt: skip

    message = "a request needs {} unbound hash blocks, more than the slot ring holds \\(3\\)"
    # b (new) fits; a would hold blocks 0..3: refused, and b is not given its slots either.
    with pytest.raises(OverflowError, match=message.format(4)):
        extend(table, [b, a], [0, 2], [1, 2], [5, 6, 7])
    assert unchanged()
    # A new row wider than the ring on its own.
    with pytest.raises(OverflowError, match=message.format(5)):
        extend(table, [b], [9], [5], [5, 6, 7, 8, 9])
    assert unchanged()
    # The first row that overflows names the count.
    with pytest.raises(OverflowError, match=message.format(6)):
        extend(table, [b, a], [0, 2], [6, 2], range(8))
    assert unchanged()
    # Exactly the ring: accepted; and once a's first blocks are bound, room again.
    extend(table, [a], [2], [1], [3])
    assert table.rings.unbound_slots(np.array([a])).tolist() == [1, 2, 3]
    table.rings.take_leading(np.array([a]), np.array([2]))
    extend(table, [a], [3], [2], [4, 5])
    assert table.rings.unbound_slots(np.array([a])).tolist() == [3, 4, 5]


def extend_per_row(table, rows, firsts, counts, slots):
    """The same take through ``extend_row``, one row after the other."""
    slots = np.asarray(slots, np.int64)
    offset = 0
    for row, first, count in zip(np.asarray(rows).tolist(), firsts, counts):
        table.rings.extend_row(row, int(first), slots[offset : offset + count])
        offset += count


def take_leading_per_row(table, rows, counts):
    parts = [table.rings.take_leading_row(r, c) for r, c in zip(rows.tolist(), counts.tolist())]
    return np.concatenate([np.empty(0, np.int64), *parts])


@pytest.mark.parametrize("per_row", [False, True], ids=["vector", "per_row"])
@pytest.mark.parametrize("seed", range(150))
def test_extend_matches_a_block_by_block_model(seed, per_row):
    """On random tables (rows added, removed and reused, blocks handed to the store, takes
    that overflow, rings that wrap), ``extend`` keeps every row's unbound slots, base and
    end equal to a dict of block -> slot per request, and refuses exactly the takes that
    would hold more than the ring, leaving everything unchanged. ``extend_row`` and
    ``take_leading_row`` (the small steps' forms) keep the same model; a row that would
    overflow is refused before it changes (the rows before it in the take have theirs)."""
    extend_rows = extend_per_row if per_row else extend
    take = take_leading_per_row if per_row else lambda t, *a: t.rings.take_leading(*a)
    rng = np.random.default_rng(seed)
    width = int(rng.integers(1, 8))
    table = RequestTable(ring_width=width, capacity=2)
    model: dict[int, dict] = {}  # row -> {"base", "end", "slots": {block: slot}}
    names = iter(range(10**6))
    next_slot = 0
    for _ in range(14):
        if rng.random() < 0.3 or len(table) < 2:
            new = [f"r{next(names)}" for _ in range(int(rng.integers(1, 4)))]
            for row in table.add_many(new, [0] * len(new)).tolist():
                model[row] = {"base": 0, "end": 0, "slots": {}}
        if rng.random() < 0.15 and len(table) > 1:
            request_id = list(table.index)[int(rng.integers(len(table)))]
            row = table.index[request_id]
            entry = model.pop(row)
            freed = table.remove([request_id])
            blocks = range(entry["base"], entry["end"])
            assert freed.tolist() == [entry["slots"][b] for b in blocks]
        live = table.live_rows()
        chosen = rng.choice(live, size=int(rng.integers(1, len(live) + 1)), replace=False)
        # Publication hands some leading blocks over.
        held = np.array([model[r]["end"] - model[r]["base"] for r in chosen.tolist()])
        handed = np.minimum(held, rng.integers(0, 3, len(chosen)))
        leading = take(table, chosen, handed).tolist()
        expected = []
        for row, n in zip(chosen.tolist(), handed.tolist()):
            entry = model[row]
            expected += [entry["slots"][b] for b in range(entry["base"], entry["base"] + n)]
            entry["base"] += n
        assert leading == expected
        # A take: each chosen row continues at its end, or starts at a random first block.
        firsts = [model[r]["end"] or int(rng.integers(0, 20)) for r in chosen.tolist()]
        counts = rng.integers(0, width + 2, len(chosen)).tolist()
        slots = list(range(next_slot, next_slot + sum(counts)))
        needed = [
            first + count - (model[r]["base"] if model[r]["end"] else first)
            for r, first, count in zip(chosen.tolist(), firsts, counts)
        ]
        before = deepcopy((table.rings.ring, table.rings.base, table.rings.end))
        over = next((i for i, n in enumerate(needed) if n > width), None)
        if over is not None and (not per_row or over == 0):
            with pytest.raises(OverflowError, match=f"needs {needed[over]} unbound"):
                extend_rows(table, chosen, firsts, counts, slots)
            after = (table.rings.ring, table.rings.base, table.rings.end)
            assert all(np.array_equal(x, y) for x, y in zip(before, after))
        else:
            applied = len(chosen) if over is None else over
            if over is None:
                extend_rows(table, chosen, firsts, counts, slots)
            else:
                with pytest.raises(OverflowError, match=f"needs {needed[over]} unbound"):
                    extend_rows(table, chosen, firsts, counts, slots)
            next_slot += len(slots)
            taken = iter(slots)
            for row, first, count in list(zip(chosen.tolist(), firsts, counts))[:applied]:
                entry = model[row]
                if not entry["end"]:
                    entry["base"] = first
                for block in range(first, first + count):
                    entry["slots"][block] = next(taken)
                entry["end"] = first + count
        for row, entry in model.items():
            assert (table.rings.base[row], table.rings.end[row]) == (entry["base"], entry["end"])
            blocks = range(entry["base"], entry["end"])
            assert table.rings.unbound_slots(np.array([row])).tolist() == [
                entry["slots"][b] for b in blocks
            ]
    assert sorted(model) == sorted(table.live_rows().tolist())


def fresh_of(table: RequestTable, rows) -> list[bool] | None:
    """``take_fresh`` of ``rows``: the flags it wrote (as bools), or None when it said no row
    is fresh; it writes no flag past the launch's rows, nor any when it says none."""
    rows = np.asarray(rows, np.int64)
    flags = np.full(len(rows) + 2, 7, np.uint8)
    if not table.take_fresh(rows, flags):
        assert (flags == 7).all()
        return None
    assert (flags[len(rows) :] == 7).all() and set(flags[: len(rows)].tolist()) <= {0, 1}
    return flags[: len(rows)].astype(bool).tolist()


def test_take_fresh_names_each_added_row_once():
    table = RequestTable(ring_width=2)
    a, b = table.add("a", 0), table.add("b", 0)
    assert table.unlaunched == {a, b}
    assert fresh_of(table, np.array([a])) == [True]
    assert table.unlaunched == {b}
    # a again, alone: nothing fresh, though b still is.
    assert fresh_of(table, np.array([a])) is None
    assert table.num_unlaunched == 1
    assert fresh_of(table, np.array([b, a])) == [True, False]
    assert table.num_unlaunched == 0 and not table.unlaunched
    assert fresh_of(table, np.array([a, b])) is None
    assert fresh_of(table, np.array([], np.int64)) is None
    # New rows after launches: only they are fresh, in the launch's order.
    c, d = table.add_many(["c", "d"], [0, 0]).tolist()
    assert table.num_unlaunched == 2
    assert fresh_of(table, np.array([d, a, c, b])) == [True, False, True, False]
    assert table.num_unlaunched == 0


def test_removing_rows_keeps_the_unlaunched_count_and_reused_rows_are_fresh():
    table = RequestTable(ring_width=2, capacity=2)
    a, b, c = (table.add(name, 0) for name in "abc")  # grows past its capacity
    fresh_of(table, np.array([a]))
    assert table.num_unlaunched == 2
    table.remove(["a"])  # launched: the count stays
    assert table.num_unlaunched == 2
    table.remove(["b"])  # not launched: one fewer
    assert table.num_unlaunched == 1
    # A detached row removed by row, unlaunched, then a launched one.
    fresh_of(table, np.array([c]))
    d = table.add("d", 0)
    table.detach("d")
    table.remove(["d"], rows=[d])
    assert table.num_unlaunched == 0
    # The freed rows come back fresh: a launch names them as fresh again.
    e, f = table.add_many(["e", "f"], [0, 0]).tolist()
    assert {e, f} <= {a, b, d} and table.unlaunched == {e, f}
    assert table.num_unlaunched == 2
    assert fresh_of(table, np.array([c, e, f])) == [False, True, True]
    # Growth keeps what was launched.
    names = [f"g{i}" for i in range(2 * table.capacity)]
    rows = table.add_many(names, [0] * len(names))
    assert table.unlaunched == set(rows.tolist())
    assert table.num_unlaunched == len(names)
    table.clear()
    assert table.num_unlaunched == 0 and len(table) == 0


@pytest.mark.parametrize("seed", range(100))
def test_num_unlaunched_counts_the_live_rows_no_launch_named(seed):
    """On random adds, removals (by id and of detached rows by row), launches and growth,
    ``num_unlaunched`` equals the live and detached rows not launched, and ``take_fresh``
    names exactly the launched rows not launched before."""
    rng = np.random.default_rng(seed)
    table = RequestTable(ring_width=2, capacity=1)
    names = iter(range(10**6))
    detached: dict[str, int] = {}
    launched: set[int] = set()  # the model: rows a launch named since they were added
    for _ in range(20):
        action = rng.random()
        if action < 0.35 or not len(table):
            new = [f"r{next(names)}" for _ in range(int(rng.integers(1, 4)))]
            launched.difference_update(table.add_many(new, [0] * len(new)).tolist())
        elif action < 0.5:
            request_id = list(table.index)[int(rng.integers(len(table)))]
            table.remove([request_id])
        elif action < 0.6:
            request_id = list(table.index)[int(rng.integers(len(table)))]
            detached[request_id] = table.index[request_id]
            table.detach(request_id)
        elif action < 0.7 and detached:
            ids = list(detached)
            table.remove(ids, rows=[detached.pop(i) for i in ids])
        elif len(table):
            live = table.live_rows()
            rows = rng.choice(live, size=int(rng.integers(1, len(live) + 1)), replace=False)
            before = [row in launched for row in rows.tolist()]
            fresh = fresh_of(table, rows)
            if all(before):
                assert fresh is None
            else:
                assert fresh == [not b for b in before]
            launched.update(rows.tolist())
        held = [*table.index.values(), *detached.values()]
        assert table.unlaunched == {row for row in held if row not in launched}


def test_keys_grow_and_release_tail_first_in_row_order():
    table = RequestTable(ring_width=2, capacity=1)
    a = table.add("a", 0)
    b = table.add("b", 0)  # the table grows past its capacity
    first = keys(1, 2, 3, 7)
    table.add_keys([a, b], first, [3, 1])
    table.add_keys([a], keys(*range(4, 40)), [36])
    assert table.num_keys[a] == 39 and table.num_keys[b] == 1
    assert hash_words(table.keys_of(a, 1, 4)) == [2, 3, 4]
    order = table.release_order([b, a])
    assert hash_words(order) == [7, *range(39, 0, -1)]
    # The very objects added come back, so the store matches them by identity.
    assert order[0] is first[3] and table.keys_of(a, 0, 1)[0] is first[0]


def test_removed_rows_are_reused_fresh_and_version_bumps():
    table = RequestTable(ring_width=4)
    a = table.add("a", 5)
    table.cursor[a], table.scheduled[a], table.finished[a] = 9, 12, True
    table.add_keys([a], keys(1), [1])
    fresh_of(table, np.array([a]))
    extend(table, [a], [0], [2], [3, 4])
    version = table.version
    assert table.remove(["a"]).tolist() == [3, 4]
    assert table.version > version and "a" not in table.index
    again = table.add("c", 2)
    assert again == a
    fresh = (
        table.cursor,
        table.scheduled,
        table.emit,
        table.rings.base,
        table.rings.end,
        table.num_keys,
    )
    assert [int(column[again]) for column in fresh] == [NO_CURSOR, 0, 2, 0, 0, 0]
    assert not table.finished[again] and again in table.unlaunched
    assert len(table.release_order([again])) == 0
    with pytest.raises(KeyError):
        table.rows(["a"])


def test_clear_frees_every_unbound_slot_in_add_order():
    table = RequestTable(ring_width=4)
    rows = [table.add(name, 0) for name in ("x", "y", "z")]
    extend(table, rows, [0, 3, 5], [1, 2, 1], [7, 8, 9, 6])
    assert table.live_rows().tolist() == rows
    assert table.clear().tolist() == [7, 8, 9, 6]
    assert len(table) == 0


def test_add_many_takes_fresh_rows_and_grows_past_double():
    table = RequestTable(ring_width=2, capacity=2)
    assert table.capacity == 2 and len(table.cursor) == 2 and table.rings.ring.shape == (2, 2)
    first = table.add("a", 1)
    table.cursor[first] = 7
    table.remove(["a"])
    names = [f"r{i}" for i in range(9)]  # more than twice the capacity at once
    rows = table.add_many(names, list(range(10, 19)))
    assert rows.dtype == np.int64 and len(set(rows.tolist())) == 9
    assert table.capacity >= 9 and first in rows.tolist()  # the freed row is reused
    assert table.rows(names).tolist() == rows.tolist()
    assert table.emit[rows].tolist() == list(range(10, 19))
    assert (table.cursor[rows] == NO_CURSOR).all() and not table.finished[rows].any()
    assert (table.rings.end[rows] == 0).all() and (table.num_keys[rows] == 0).all()
    assert table.rings.ring.shape == (table.capacity, 2) and (table.rings.ring[rows] == -1).all()
    assert table.add_many([], []).tolist() == [] and len(table) == 9


@pytest.mark.parametrize("seed", range(100))
def test_window_slots_follow_each_ring(seed):
    """``unbound_slots`` and ``take_leading`` return each row's blocks in block order, read
    from its ring column ``block % width`` (rings that wrap, hand blocks over, hold none),
    and ``take_leading`` advances only the chosen rows' bases."""
    rng = np.random.default_rng(seed)
    width = int(rng.integers(2, 9))
    table = RequestTable(ring_width=width, capacity=4)
    rows = [table.add(f"r{i}", 0) for i in range(6)]
    next_slot = 0
    for _ in range(8):
        row = int(rng.choice(rows))
        held = int(table.rings.end[row] - table.rings.base[row])
        if held and rng.random() < 0.4:
            table.rings.take_leading(np.array([row]), np.array([int(rng.integers(1, held + 1))]))
        elif held < width:
            end, base = int(table.rings.end[row]), int(table.rings.base[row])
            first = end or int(rng.integers(0, 20))
            last = (base if end else first) + int(rng.integers(0, width))
            if last >= first:
                count = last + 1 - first
                extend(table, [row], [first], [count], range(next_slot, next_slot + count))
                next_slot += count
    chosen = np.asarray(rng.permutation(rows)[: int(rng.integers(1, 7))], np.int64)
    held = np.maximum(table.rings.end[chosen] - table.rings.base[chosen], 0)
    handed = np.asarray([int(rng.integers(0, h + 1)) for h in held.tolist()], np.int64)

    def expected(row: int, first: int, count: int) -> list[int]:
        return [int(table.rings.ring[row, block % width]) for block in range(first, first + count)]

    bases = table.rings.base.copy()
    want_unbound = [
        slot
        for row, count in zip(chosen.tolist(), held.tolist())
        for slot in expected(row, int(bases[row]), count)
    ]
    want_leading = [
        slot
        for row, count in zip(chosen.tolist(), handed.tolist())
        for slot in expected(row, int(bases[row]), count)
    ]
    unbound = table.rings.unbound_slots(chosen).tolist()
    leading = table.rings.take_leading(chosen, handed).tolist()
    rest = table.rings.unbound_slots(chosen).tolist()
    assert unbound == want_unbound and leading == want_leading
    moved = bases.copy()
    moved[chosen] += handed
    assert table.rings.base.tolist() == moved.tolist()
    assert len(unbound) == held.sum() and len(leading) == handed.sum()
    # Row by row, the handed-over blocks are the leading part of what was unbound.
    assert sorted(leading + rest) == sorted(unbound)


def test_ring_widths_keep_one_step_on_the_device():
    from r3capture.aux_output.sizing import REATTACH_TOKENS, ring_widths

    assert REATTACH_TOKENS == 256
    # 8,192-token budget, B = 16, two steps in flight: the host holds three steps of 513
    # blocks (a partial first block included) and one more; the device one step, one more
    # and 16 blocks of reattachment.
    assert ring_widths(8192, 16, 2) == (3 * 513 + 1, 513 + 1 + 16)
    assert ring_widths(8192, 16, 1) == (2 * 513 + 1, 513 + 1 + 16)
    # Small budgets: the reattachment room outgrows the steps in flight, and the device
    # ring is the host's.
    assert ring_widths(64, 4, 2) == (3 * 17 + 1,) * 2


def test_rows_reuse_answers_from_another_cache_without_replacing_it():
    table = RequestTable(ring_width=2)
    a, b = (table.add(name, 0) for name in "ab")
    scheduled = table.rows(["a", "b"], cache="scheduled")
    # The batch names the scheduled ids in their order: the scheduler's array itself.
    assert table.rows(["a", "b"], cache="batch", reuse="scheduled") is scheduled
    # Another order: looked up, and kept under "batch" only.
    swapped = table.rows(["b", "a"], cache="batch", reuse="scheduled")
    assert swapped.tolist() == [b, a]
    assert table.rows(["b", "a"], cache="batch", reuse="scheduled") is swapped
    assert table.rows(["a", "b"], cache="scheduled") is scheduled
    # A removal anywhere makes both stale.
    table.remove(["b"])
    with pytest.raises(KeyError):
        table.rows(["a", "b"], cache="batch", reuse="scheduled")
    assert table.rows(["a"], cache="batch", reuse="scheduled").tolist() == [a]


def test_rows_cache_answers_only_the_same_ids_in_the_same_version():
    table = RequestTable(ring_width=2)
    a, b, c = (table.add(name, 0) for name in "abc")
    first = table.rows(["a", "b"], cache="batch")
    assert first.tolist() == [a, b]
    # Steady decode: an equal list (not the same object) gets the very array back.
    assert table.rows(["a", "b"], cache="batch") is first
    # Same version, other ids or order: looked up again, under any cache name.
    assert table.rows(["b", "a"], cache="batch").tolist() == [b, a]
    assert table.rows(["a", "b", "c"], cache="batch").tolist() == [a, b, c]
    assert table.rows(["c"], cache="other").tolist() == [c]
    assert table.rows(["a", "b", "c"], cache="batch").tolist() == [a, b, c]
    # "a" leaves and comes back on another row (its old one goes to "d"): the same list of
    # ids now names other rows.
    table.remove(["a"])
    assert table.add("d", 0) == a
    a_again = table.add("a", 0)
    assert a_again not in (a, b, c)
    assert table.rows(["a", "b", "c"], cache="batch").tolist() == [a_again, b, c]
    # Without a cache name nothing is kept: the next lookup under a name looks up again.
    table.rows(["d"])
    assert table.rows(["d"], cache="batch").tolist() == [a]


def test_advance_moves_only_the_named_rows_cursors_and_finish_marks_one_row():
    table = RequestTable(ring_width=2)
    a, b, c = (table.add(name, 0) for name in "abc")
    table.advance(np.array([c, a]), [7, 3], [8, 4], [7, 0])
    assert table.cursor[[a, b, c]].tolist() == [3, NO_CURSOR, 7]
    assert table.scheduled[[a, b, c]].tolist() == [4, 0, 8]
    assert table.emit[[a, b, c]].tolist() == [0, 0, 7]
    table.mark_finished(b)
    assert table.finished[[a, b, c]].tolist() == [False, True, False]


def _random_table(rng: np.random.Generator) -> RequestTable:
    """A table with live rows in every state: launched or not, cursors, keys, finished,
    partial first blocks, unbound blocks that wrap their ring, and free rows."""
    table = RequestTable(ring_width=4, capacity=2)
    ids = [f"r{i}" for i in range(12)]
    rows = table.add_many(ids, rng.integers(0, 50, len(ids)).tolist())
    table.remove(ids[:3])  # free rows in the middle
    rows = rows[3:]
    fresh_of(table, rows[rng.random(len(rows)) < 0.5])
    table.advance(rows, *(rng.integers(0, 90, len(rows)) for _ in range(3)))
    firsts = rng.integers(0, 9, len(rows))
    counts = rng.integers(0, 5, len(rows))
    extend(table, rows, firsts, counts, range(100, 100 + int(counts.sum())))
    table.rings.take_leading(rows, np.minimum(table.rings.end[rows] - table.rings.base[rows], 1))
    table.add_keys(rows.tolist(), keys(*range(1, 2 * len(rows) + 1)), [2] * len(rows))
    partial = rows[rng.random(len(rows)) < 0.3]
    table.rings.mark_partial_first(partial, rng.integers(1, 4, len(partial)))
    for row in rows[rng.random(len(rows)) < 0.3].tolist():
        table.mark_finished(row)
    return table


def _state(table: RequestTable) -> tuple:
    rings = table.rings
    return (
        *(getattr(table, name).tolist() for name in (*RequestTable._INT_FIELDS, "finished")),
        *(getattr(rings, name).tolist() for name in ("ring", "base", "end", "partial")),
        [list(k) for k in table._keys],
        table._free_rows,
        table.index,
        table.unlaunched,
        table.rings.num_partial,
    )


@pytest.mark.parametrize("seed", range(40))
def test_removing_a_few_rows_one_by_one_equals_the_vector_form(seed, monkeypatch):
    """``remove``'s two forms (scalar reads and writes for a few rows, vector calls for
    more) return the same slots and leave the same table, whichever rows go."""
    import r3capture.aux_output.request_table as request_table

    rng = np.random.default_rng(seed)
    table = _random_table(rng)
    live = list(table.index)
    gone = list(rng.choice(live, size=int(rng.integers(1, len(live) + 1)), replace=False))
    results = []
    for most_per_row in (0, 10**6):
        monkeypatch.setattr(request_table, "REMOVE_PER_ROW_MAX", most_per_row)
        copy = deepcopy(table)
        slots = copy.remove(gone)
        assert slots.dtype == np.int64
        results.append((slots.tolist(), _state(copy)))
    assert results[0] == results[1]
    assert all(row not in results[0][1][-3].values() for row in map(table.index.get, gone))
