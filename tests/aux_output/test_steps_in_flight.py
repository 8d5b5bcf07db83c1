"""StepsInFlight: which finished requests are torn down when, and a resumed request's new row."""

from __future__ import annotations

import numpy as np

from r3capture.aux_output.request_table import RequestTable
from r3capture.aux_output.step_commit import StepLayout
from r3capture.aux_output.steps_in_flight import StepsInFlight


def _layout(table: RequestTable, ids: list[str]) -> StepLayout:
    rows = table.rows(ids)
    return StepLayout(ids, rows, np.zeros(len(ids), np.int64), np.arange(len(ids) + 1))


def test_a_finished_request_is_torn_down_by_the_last_step_in_flight_that_covers_it():
    table = RequestTable(ring_width=4)
    table.add_many(["a", "b", "c"], [0, 0, 0])
    steps = StepsInFlight(table)
    first, second = _layout(table, ["a", "b"]), _layout(table, ["a"])
    steps.add(first)
    steps.add(second)
    assert steps.finish(["a", "b", "c"]) == ["c"]  # no step covers c: torn down now
    # b's only step settles: its teardown is due; a still has a step in flight.
    assert steps.settle(first, teardown=True) == (["b"], [table.index["b"]])
    # A failed step leaves flight without teardown.
    assert steps.settle(second, teardown=False) == ([], [])
    assert len(steps) == 0


def test_a_request_resumed_under_its_earlier_run_gets_a_new_row_and_the_old_one_is_torn_down():
    table = RequestTable(ring_width=4)
    table.add_many(["a", "b"], [0, 0])
    old_row = table.index["a"]
    steps = StepsInFlight(table)
    earlier = _layout(table, ["a", "b"])
    steps.add(earlier)
    scheduled = {"a": 0, "b": 0}
    # Nothing finished: nothing to detach.
    assert not steps.detach_resumed(scheduled, table.rows(list(scheduled)))
    assert steps.finish(["a"]) == []
    assert steps.detach_resumed(scheduled, table.rows(list(scheduled)))
    assert "a" not in table.index and "b" in table.index
    new_row = table.add("a", 0)
    assert new_row != old_row and not table.finished[new_row]
    # The earlier run settles: its row goes, by row; the id keeps naming the new one.
    ids, rows = steps.settle(earlier, teardown=True)
    assert (ids, rows) == (["a"], [old_row])
    table.remove(ids, rows)
    assert table.index["a"] == new_row and len(table) == 2
