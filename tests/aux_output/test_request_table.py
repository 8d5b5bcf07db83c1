"""RequestTable: rows, keys and the per-request slot ring (numpy only, no torch, no store)."""

from __future__ import annotations

from copy import deepcopy

import numpy as np
import pytest

from r3capture.aux_output import request_table
from r3capture.aux_output.request_table import NO_CURSOR, RequestTable
from r3capture.store import KEY_WORDS, KeyObjects, key_objects, rows_of_key_objects


def keys(*values: int) -> KeyObjects:
    rows = np.zeros((len(values), KEY_WORDS), np.uint64)
    rows[:, 1] = values
    return key_objects(rows)


def hash_words(keys: KeyObjects) -> list[int]:
    """Word 1 of each key (the value ``keys`` put there)."""
    return rows_of_key_objects(keys)[:, 1].tolist()


def _consecutive_slots():
    """An ``allocate(n)`` that hands out slots 0, 1, 2, ... in order (int64)."""
    taken = 0

    def allocate(n):
        nonlocal taken
        taken += n
        return np.arange(taken - n, taken, dtype=np.int64)

    return allocate


@pytest.fixture(params=["vectorized", "per_request"])
def take(request):
    """``take_slots`` (or ``take_slots_per_request``) on lists, handing out ``slots`` (which
    must be exactly what it asks)."""

    def take(table, rows, firsts, lasts, slots):
        def allocate(n):
            assert n == len(slots), (n, slots)
            return np.asarray(slots, np.int64)

        if request.param == "per_request":
            return table.take_slots_per_request(rows, firsts, lasts, allocate)
        arrays = (np.asarray(a, np.int64) for a in (rows, firsts, lasts))
        return table.take_slots(*arrays, allocate)

    return take


def test_ring_holds_the_unbound_window_and_wraps(take):
    table = RequestTable(ring_width=4)
    a, b = table.add("a", 0), table.add("b", 0)
    W2 = 4 + 2  # ring columns plus the block window
    # a takes blocks 5..7 (its first), b blocks 0..1.
    index, values = take(table, [a, b], [5, 0], [7, 1], [10, 11, 12, 20, 21])
    assert index.tolist() == [
        a * W2 + 1, a * W2 + 2, a * W2 + 3, b * W2 + 0, b * W2 + 1,  # slots (block % 4)
        a * W2 + 4, b * W2 + 4, a * W2 + 5, b * W2 + 5,  # each window's first, then last block
    ]  # fmt: skip
    assert values.tolist() == [10, 11, 12, 20, 21, 5, 0, 7, 1]
    assert table.ring.reshape(-1)[index].tolist() == values.tolist()
    assert table.unbound_slots(np.array([a, b])).tolist() == [10, 11, 12, 20, 21]
    # a hands blocks 5 and 6 to the store, then grows into columns that wrap around.
    assert table.take_leading(np.array([a]), np.array([2])).tolist() == [10, 11]
    assert (table.base[a], table.end[a]) == (7, 8)
    _, values = take(table, [a], [99], [10], [13, 14, 15])
    assert values.tolist() == [13, 14, 15, 7, 10]  # firsts ignored: a had blocks already
    assert table.unbound_slots(np.array([a])).tolist() == [12, 13, 14, 15]
    assert table.ring[a].tolist() == [13, 14, 15, 12, 7, 10]  # blocks 8, 9, 10 wrapped
    positions = np.array([7 * 16 + 3, 10 * 16 + 15])
    assert table.arena_rows(np.array([a, a]), positions, 16).tolist() == [
        12 * 16 + 3,
        15 * 16 + 15,
    ]


def test_ring_overflow_is_refused_before_any_change(take):
    table = RequestTable(ring_width=3)
    a = table.add("a", 0)
    take(table, [a], [0], [1], [1, 2])
    ring = table.ring.copy()
    with pytest.raises(OverflowError, match="more than the slot ring holds \\(3\\)"):
        # Refused before any slot is asked for.
        take(table, [a], [0], [3], [])
    assert np.array_equal(table.ring, ring) and table.end[a] == 2


@pytest.mark.parametrize("seed", range(200))
def test_per_request_and_vectorized_slot_taking_agree(seed):
    """Both mechanisms leave the same ring and cursors, ask ``allocate`` for the same
    count, return the same updates and refuse the same overflow, on random tables."""
    rng = np.random.default_rng(seed)
    width = int(rng.integers(2, 9))
    results = []
    for mechanism in ("vectorized", "per_request"):
        step_rng = np.random.default_rng(seed)
        table = RequestTable(ring_width=width, capacity=4)
        rows = [table.add(f"r{i}", 0) for i in range(6)]
        allocate = _consecutive_slots()
        outcomes = []
        for _ in range(6):
            chosen = step_rng.choice(rows, size=int(step_rng.integers(1, 5)), replace=False)
            firsts, lasts = [], []
            for row in chosen.tolist():
                start = int(table.end[row]) if table.end[row] else int(step_rng.integers(0, 20))
                firsts.append(start)
                lasts.append(start + int(step_rng.integers(0, width + 1)))
            if step_rng.random() < 0.5:  # hand some blocks over, as publication does
                held = table.end[chosen] - table.base[chosen]
                table.take_leading(chosen, np.minimum(held, step_rng.integers(0, 3, len(chosen))))
            try:
                if mechanism == "per_request":
                    update = table.take_slots_per_request(chosen.tolist(), firsts, lasts, allocate)
                else:
                    arrays = (np.asarray(a, np.int64) for a in (chosen, firsts, lasts))
                    update = table.take_slots(*arrays, allocate)
                outcomes.append([u.tolist() for u in update])
            except OverflowError as exc:
                outcomes.append(str(exc))
        results.append((outcomes, table.ring.tolist(), table.base.tolist(), table.end.tolist()))
    assert results[0] == results[1]


def test_device_ring_is_narrower_and_holds_the_last_blocks_taken(take):
    table = RequestTable(ring_width=6, device_width=3)
    a = table.add("a", 0)
    D2 = 3 + 2  # device ring columns plus the block window
    index, values = take(table, [a], [0], [1], [10, 11])
    assert index.tolist() == [a * D2 + 0, a * D2 + 1, a * D2 + 3, a * D2 + 4]
    assert values.tolist() == [10, 11, 0, 1]
    # Blocks 2..4 take five unbound blocks on the host; the device window is the last three,
    # so block 1 stays unbound on the host but leaves the device ring.
    index, values = take(table, [a], [0], [4], [12, 13, 14])
    assert index.tolist() == [a * D2 + 2, a * D2 + 0, a * D2 + 1, a * D2 + 3, a * D2 + 4]
    assert values.tolist() == [12, 13, 14, 2, 4]
    assert table.unbound_slots(np.array([a])).tolist() == [10, 11, 12, 13, 14]
    index, values = take(table, [a], [0], [5], [15])
    assert values.tolist() == [15, 3, 5] and index.tolist() == [a * D2 + 2, a * D2 + 3, a * D2 + 4]
    # A take longer than the device ring uploads only the blocks inside the new window.
    table.take_leading(np.array([a]), np.array([5]))  # blocks 0..4 bound: base 5
    index, values = take(table, [a], [0], [9], [16, 17, 18, 19])
    assert values.tolist() == [17, 18, 19, 7, 9]  # block 6 is host-only
    assert table.device_ring()[a].tolist() == [19, 17, 18, 7, 9]  # blocks 9, 7, 8


@pytest.mark.parametrize("device_width", [0, 5])
def test_device_width_must_fit_the_ring(device_width):
    match = f"device_width must be in 1..ring_width \\(4\\), got {device_width}"
    with pytest.raises(ValueError, match=match):
        RequestTable(ring_width=4, device_width=device_width)


@pytest.mark.parametrize("seed", range(150))
def test_device_ring_updates_keep_a_copy_equal_to_the_rebuilt_ring(seed, take):
    """Uploading each take's updates (never two to one entry) into a copy of the device
    ring, rebuilt only when the table grows, keeps every window's entries equal to
    ``device_ring()`` and to the host ring's slots, on random narrow rings."""
    rng = np.random.default_rng(seed)
    width = int(rng.integers(2, 10))
    device_width = int(rng.integers(1, width + 1))
    table = RequestTable(ring_width=width, capacity=2, device_width=device_width)
    next_slot = 0
    copy = table.device_ring()
    names = iter(range(10**6))
    for _ in range(12):
        if rng.random() < 0.3 or len(table) < 3:
            capacity = table.capacity
            new = [f"r{next(names)}" for _ in range(int(rng.integers(2, 4)))]
            table.add_many(new, [0] * len(new))
            if table.capacity != capacity:
                copy = table.device_ring()  # the worker attaches again after a growth
        if rng.random() < 0.2:  # its row is reused fresh by a later request
            table.remove([next(iter(table.index))])
        live = table.live_rows()
        chosen = rng.choice(live, size=int(rng.integers(1, len(live) + 1)), replace=False)
        held = table.end[chosen] - table.base[chosen]
        table.take_leading(chosen, np.minimum(held, rng.integers(0, 3, len(chosen))))
        firsts = rng.integers(0, 20, len(chosen))
        starts = np.where(table.end[chosen] > 0, table.end[chosen], firsts)
        # Takes of up to twice the device ring's width, within the host ring's.
        lasts = starts + rng.integers(0, 2 * device_width + 1, len(chosen))
        bases = np.where(table.end[chosen] > 0, table.base[chosen], firsts)
        lasts = np.minimum(lasts, bases + width - 1)
        grow = lasts >= starts
        rows, firsts, lasts = chosen[grow], firsts[grow], lasts[grow]
        if not len(rows):
            continue
        count = int((lasts + 1 - starts[grow]).sum())
        slots = list(range(next_slot, next_slot + count))
        next_slot += count
        index, values = take(table, rows.tolist(), firsts.tolist(), lasts.tolist(), slots)
        assert len(set(index.tolist())) == len(index)
        copy.reshape(-1)[index] = values
        rebuilt = table.device_ring()
        for row in table.live_rows().tolist():
            if not table.end[row]:
                continue
            lo, hi = copy[row, device_width:].tolist()
            assert hi == table.end[row] - 1 and lo >= max(table.end[row] - device_width, 0)
            blocks = np.arange(lo, hi + 1)
            assert copy[row, blocks % device_width].tolist() == (
                rebuilt[row, blocks % device_width].tolist()
            )
            assert copy[row, blocks % device_width].tolist() == (
                table.ring[row, blocks % width].tolist()
            )
            assert rebuilt[row, device_width:].tolist() == [lo, hi]


def test_new_rows_have_an_empty_window():
    table = RequestTable(ring_width=2, capacity=1)
    rows = [table.add(name, 0) for name in "abc"]  # grows twice
    for row in rows:
        lo, hi = table.ring[row, 2:]
        assert hi < lo and table.end[row] == 0


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


def test_removed_rows_are_reused_fresh_and_version_bumps(take):
    table = RequestTable(ring_width=4)
    a = table.add("a", 5)
    table.cursor[a], table.scheduled[a], table.finished[a] = 9, 12, True
    table.add_keys([a], keys(1), [1])
    take(table, [a], [0], [1], [3, 4])
    version = table.version
    assert table.remove(["a"]).tolist() == [3, 4]
    assert table.version > version and "a" not in table.index
    again = table.add("c", 2)
    assert again == a
    fresh = (table.cursor, table.scheduled, table.emit, table.base, table.end, table.num_keys)
    assert [int(column[again]) for column in fresh] == [NO_CURSOR, 0, 2, 0, 0, 0]
    assert not table.finished[again] and len(table.release_order([again])) == 0
    with pytest.raises(KeyError):
        table.rows(["a"])


def test_clear_frees_every_unbound_slot_in_add_order(take):
    table = RequestTable(ring_width=4)
    rows = [table.add(name, 0) for name in ("x", "y", "z")]
    take(table, rows, [0, 3, 5], [0, 4, 5], [7, 8, 9, 6])
    assert table.live_rows().tolist() == rows
    assert table.clear().tolist() == [7, 8, 9, 6]
    assert len(table) == 0


def test_add_many_takes_fresh_rows_and_grows_past_double():
    table = RequestTable(ring_width=2, capacity=2)
    assert table.capacity == 2 and len(table.cursor) == 2 and table.ring.shape == (2, 4)
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
    assert (table.end[rows] == 0).all() and (table.num_keys[rows] == 0).all()
    assert table.add_many([], []).tolist() == [] and len(table) == 9


@pytest.mark.parametrize("seed", range(100))
def test_window_slots_per_request_and_vectorized_agree(seed, monkeypatch):
    """Both mechanisms behind ``unbound_slots`` and ``take_leading`` return the same slots in
    the same order and leave the same bases, on random rings that wrap, hand blocks over and
    hold none."""
    rng = np.random.default_rng(seed)
    width = int(rng.integers(2, 9))
    table = RequestTable(ring_width=width, capacity=4)
    rows = [table.add(f"r{i}", 0) for i in range(6)]
    allocate = _consecutive_slots()
    for _ in range(8):
        row = int(rng.choice(rows))
        held = int(table.end[row] - table.base[row])
        if held and rng.random() < 0.4:
            table.take_leading(np.array([row]), np.array([int(rng.integers(1, held + 1))]))
        elif held < width:
            first = int(table.end[row]) if table.end[row] else int(rng.integers(0, 20))
            last = int(table.base[row] if table.end[row] else first) + int(rng.integers(0, width))
            if last >= first:
                table.take_slots_per_request([row], [first], [last], allocate)
    chosen = np.asarray(rng.permutation(rows)[: int(rng.integers(1, 7))], np.int64)
    held = np.maximum(table.end[chosen] - table.base[chosen], 0)
    handed = np.asarray([int(rng.integers(0, h + 1)) for h in held.tolist()], np.int64)
    results = []
    for few in (0, 100):
        monkeypatch.setattr(request_table, "FEW_ROWS", few)
        copy = deepcopy(table)
        unbound = copy.unbound_slots(chosen).tolist()
        leading = copy.take_leading(chosen, handed).tolist()
        results.append((unbound, leading, copy.base.tolist(), copy.unbound_slots(chosen).tolist()))
    assert results[0] == results[1]
    unbound, leading, _, rest = results[0]
    assert len(unbound) == held.sum() and len(leading) == handed.sum()
    # Row by row, the handed-over blocks are the leading part of what was unbound.
    assert sorted(leading + rest) == sorted(unbound)


def test_ring_widths_keep_one_step_on_the_device():
    from r3capture.aux_output.slot_planner import ring_widths

    # 8,192-token budget, B = 16, two steps in flight: the host holds three steps of 513
    # blocks (a partial first block included), one more and 16 of lookahead; the device one
    # step, one more, the lookahead and 16 blocks of reattachment.
    assert ring_widths(8192, 16, 2) == (3 * 513 + 1 + 16, 513 + 1 + 16 + 16)
    assert ring_widths(8192, 16, 1) == (2 * 513 + 1 + 16, 513 + 1 + 16 + 16)
    # Small budgets: the lookahead and reattachment room outgrow the steps in flight, and
    # the device ring is the host's.
    assert ring_widths(64, 4, 2) == (3 * 17 + 1 + 64,) * 2


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
