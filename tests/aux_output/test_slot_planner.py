"""SlotPlanner: which requests take slots before a launch, and when the store's reserve grows."""

from __future__ import annotations

import numpy as np
import pytest

from r3capture.aux_output.request_table import RequestTable
from r3capture.aux_output.slot_planner import SlotPlanner, lookahead_blocks
from r3capture.aux_output.step_commit import PER_REQUEST_MAX, StepLayout
from r3capture.store import BlockStore

# 256 tokens a block: a request's first row takes its block and one block of lookahead.
B = 256


def _planner(reserve_slots: int, apply_teardown=lambda: False):
    assert lookahead_blocks(B) == 1
    store = BlockStore(max_bytes=64 * 8, object_nbytes=8, reserve_slots=reserve_slots)
    table = RequestTable(ring_width=8, capacity=8)
    return SlotPlanner(table, store, B, apply_teardown), table, store


def _first_rows(table: RequestTable, names: list[str]) -> StepLayout:
    """One step where each new request in ``names`` schedules one row at position 0."""
    table.add_many(names, [0] * len(names))
    rows = table.rows(names)
    return StepLayout(
        names, rows, np.zeros(len(names), np.int64), np.arange(len(names) + 1, dtype=np.int64)
    )


def _started(num_reqs: int):
    """A planner whose ``num_reqs`` requests ("r0", ...) have each taken their first block
    and its lookahead (blocks 0 and 1); returns ``(planner, table, store, names, rows)``."""
    store = BlockStore(max_bytes=8 * 8 * num_reqs, object_nbytes=8, reserve_slots=8 * num_reqs)
    table = RequestTable(ring_width=8, capacity=num_reqs + 1)
    planner = SlotPlanner(table, store, B, lambda: False)
    names = [f"r{i}" for i in range(num_reqs)]
    planner.take_slots(_first_rows(table, names))
    return planner, table, store, names, table.rows(names)


def test_the_reserve_grows_only_when_a_step_asks_for_more_slots_than_it_has_left():
    planner, table, store = _planner(reserve_slots=5)
    planner.take_slots(_first_rows(table, ["a", "b"]))  # 2 slots each
    assert (store.num_unbound, store.reserve_slots) == (4, 5)
    # Two more slots against one left: one short, so the reserve grows (at least doubles)
    # instead of the launch failing.
    updates = planner.take_slots(_first_rows(table, ["c"]))
    assert store.num_unbound == 6 and store.reserve_slots >= 10
    assert len(np.unique(table.unbound_slots(table.rows(["a", "b", "c"])))) == 6
    assert updates is not None


def test_a_step_that_uses_the_reserve_exactly_does_not_grow_it():
    planner, table, store = _planner(reserve_slots=4)
    planner.take_slots(_first_rows(table, ["a", "b"]))
    assert (store.num_unbound, store.reserve_slots) == (4, 4)


def test_recorded_teardown_is_applied_before_the_reserve_grows():
    calls = []

    def apply_teardown():
        # The first call frees the slots of "a" (as a finished request's teardown would).
        calls.append(len(calls))
        if len(calls) > 1:
            return False
        store.free(table.remove(["a"]))
        return True

    planner, table, store = _planner(reserve_slots=4, apply_teardown=apply_teardown)
    planner.take_slots(_first_rows(table, ["a", "b"]))
    planner.take_slots(_first_rows(table, ["c"]))
    assert calls == [0] and store.reserve_slots == 4 and store.num_unbound == 4


@pytest.mark.parametrize("num_reqs", [1, PER_REQUEST_MAX + 1], ids=["per-request", "vector"])
def test_a_request_grows_exactly_when_its_last_row_enters_its_end_block(num_reqs):
    """Each request holds blocks 0 and 1 (its first row's block and the lookahead). A step
    whose last row is token 511 (the last of block 1) takes nothing; one whose last row is
    token 512 (the first of block 2) takes block 2 and one more of lookahead. Both the
    per-request and the vector test of a step."""
    planner, table, store, names, rows = _started(num_reqs)
    assert table.end[rows].tolist() == [2] * num_reqs

    def step(num_rows: int) -> StepLayout:
        starts = np.ones(num_reqs, np.int64)
        return StepLayout(names, rows, starts, np.arange(num_reqs + 1, dtype=np.int64) * num_rows)

    assert planner.take_slots(step(511)) is None
    assert table.end[rows].tolist() == [2] * num_reqs
    assert planner.take_slots(step(512)) is not None
    assert table.end[rows].tolist() == [4] * num_reqs
    assert store.num_unbound == 4 * num_reqs


def test_a_large_step_where_few_requests_grow_takes_their_slots_request_by_request(
    monkeypatch,
):
    """A step of more than ``PER_REQUEST_MAX`` requests (tested with vector operations)
    where at most ``FEW_GROWING`` requests reach past their slots takes theirs with the
    per-request loop; forced onto the vector pass (``FEW_GROWING = 0``) the ring, the
    cursors, the slots taken and the device updates are the same."""
    from r3capture.aux_output import request_table, slot_planner

    num_reqs = PER_REQUEST_MAX + 8
    growing = [3, num_reqs - 1]
    outcomes, used = [], []
    for few in (slot_planner.FEW_GROWING, 0):
        monkeypatch.setattr(slot_planner, "FEW_GROWING", few)
        planner, table, store, names, rows = _started(num_reqs)
        for name in ("take_slots", "take_slots_per_request"):
            original = getattr(request_table.RequestTable, name)

            def spy(self, *args, _name=name, _original=original, _few=few, **kwargs):
                used.append((_few, _name))
                return _original(self, *args, **kwargs)

            monkeypatch.setattr(request_table.RequestTable, name, spy)
        num_rows = np.full(num_reqs, 1, np.int64)
        num_rows[growing] = 512  # rows 1 .. 512: the last enters block 2
        qsl = np.concatenate(([0], np.cumsum(num_rows)))
        updates = planner.take_slots(StepLayout(names, rows, np.ones(num_reqs, np.int64), qsl))
        outcomes.append(
            (
                [u.tolist() for u in updates],
                table.ring[rows].tolist(),
                table.end[rows].tolist(),
                store.num_unbound,
            )
        )
        monkeypatch.undo()
    assert used == [
        (slot_planner.FEW_GROWING, "take_slots_per_request"),
        (0, "take_slots"),
    ]
    assert outcomes[0] == outcomes[1]
    ends = outcomes[0][2]
    assert [i for i, end in enumerate(ends) if end == 4] == growing
