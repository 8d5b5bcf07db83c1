"""commit_step: vLLM 0.33.0's checks, cursors and emit decisions, on numpy arrays alone."""

from __future__ import annotations

import numpy as np
import pytest
from random_steps import B, info, layout, setup

from r3capture.aux_output import step_commit
from r3capture.aux_output.errors import AuxOutputProtocolError
from r3capture.aux_output.request_table import NO_CURSOR
from r3capture.aux_output.step_commit import commit_step


def test_reattach_after_rejection_and_emit_split():
    # r0 continues at its cursor; r1's scheduler start (12) is past its cursor (10): the
    # suffix was rejected and its rows belong at 10. r2 is a prefix hit emitting from 0.
    table, names = setup([8, 10, NO_CURSOR], scheduled=[8, 12, 0], emits=[8, 10, 0])
    step = layout(table, names, [8, 12, 16], [1, 4, 3])
    plan = commit_step(
        step,
        table,
        num_sampled=np.array([1, 2, 1]),
        num_rejected=np.array([0, 2, 0]),
        step_info=info([8, 10, 16], [1, 4, 3]),
        block_size=B,
    )
    # r1's kernel wrote its 2 rejected rows too (no device counts): 8 rows crossed.
    assert plan.rows_written == 8
    assert plan.capture_starts.tolist() == [8, 10, 16]
    assert plan.token_ends.tolist() == [9, 12, 19]
    assert plan.direct.tolist() == [0, 1] and plan.materialize.tolist() == [2]
    rows = step.rows
    assert table.cursor[rows].tolist() == [9, 12, 19]
    assert table.scheduled[rows].tolist() == [9, 16, 19]
    assert table.emit[rows].tolist() == [9, 12, 19]


def test_nothing_sampled_emits_nothing_and_keeps_the_emit_cursor():
    table, names = setup([NO_CURSOR], emits=[0])
    step = layout(table, names, [0], [8])
    plan = commit_step(step, table, np.array([0]), np.array([0]), info([0], [8]), B)
    assert plan.direct.size == 0 and plan.materialize.size == 0
    assert table.emit[step.rows].tolist() == [0] and table.cursor[step.rows].tolist() == [8]


@pytest.mark.parametrize(
    "cursors, scheduled, starts, counts, rejected, message, culprit",
    [
        ([4, 4], [4, 4], [4, 4], [1, 0], [0, 0], "token count must be positive", "r1"),
        ([4, 4], [4, 4], [4, 4], [2, 2], [0, 3], "rejected-token count is invalid", "r1"),
        ([4, 4], [4, 4], [4, 4], [2, 2], [-1, 0], "rejected-token count is invalid", "r0"),
        ([4, 8], [4, 8], [4, 6], [1, 1], [0, 0], "capture moved backwards", "r1"),
        ([4, 8], [4, 8], [4, 9], [1, 1], [0, 0], "unbacked token gap", "r1"),
        ([4, NO_CURSOR], [4, 0], [4, 5], [1, 2], [0, 0], "not contiguous", "r1"),
        ([4, NO_CURSOR], [4, 0], [4, 5], [1, 1], [0, 0], "not contiguous", "r1"),
        # The first failing request names the error, whatever the later ones fail.
        ([8, 4], [8, 4], [6, 4], [1, 0], [0, 0], "capture moved backwards", "r0"),
        ([NO_CURSOR, 4], [0, 4], [8, 4], [1, 0], [0, 0], "token count must be positive", "r1"),
        # A request before it at a check's boundary passes: all rows rejected, and a first
        # capture off a block boundary that accepts nothing.
        ([4, 4], [4, 4], [4, 4], [2, 0], [2, 0], "token count must be positive", "r1"),
        ([NO_CURSOR, 4], [0, 4], [5, 4], [2, 0], [2, 0], "token count must be positive", "r1"),
    ],
)
def test_first_failing_request_names_vllms_error(
    cursors, scheduled, starts, counts, rejected, message, culprit
):
    table, names = setup(cursors, scheduled=scheduled)
    before = (table.cursor.copy(), table.emit.copy(), table.scheduled.copy())
    step = layout(table, names, starts, counts)
    with pytest.raises(AuxOutputProtocolError, match=f"{message}.*request={culprit}"):
        sampled = np.ones(2, np.int32)
        commit_step(step, table, sampled, np.array(rejected), info(starts, counts), block_size=B)
    assert all(np.array_equal(a, b) for a, b in zip(before, (table.cursor, table.emit,
                                                          table.scheduled)))  # fmt: skip


@pytest.mark.parametrize(
    "step_info, what",
    [
        (np.array([[4, 2, 2, 0]], np.int32), "status=2"),
        (np.array([[4, 1, 0, 1]], np.int32), "rows written=1 of 2"),
        (np.array([[5, 2, 0, 1]], np.int32), "start=5 \\(expected 4\\)"),
    ],
)
def test_kernel_results_that_disagree_fail_closed(step_info, what):
    table, names = setup([4])
    step = layout(table, names, [4], [2])
    with pytest.raises(AuxOutputProtocolError, match=f"not placed by the capture kernel.*{what}"):
        commit_step(step, table, np.ones(1, int), np.zeros(1, int), step_info, block_size=B)


def _plan(capture_starts, token_ends):
    n = len(capture_starts)
    return step_commit.CommitPlan(
        capture_starts=np.asarray(capture_starts, np.int64),
        token_ends=np.asarray(token_ends, np.int64),
        emit_starts=np.asarray(capture_starts, np.int64),
        direct=np.arange(n),
        materialize=np.empty(0, np.int64),
        rows_written=0,
    )


@pytest.mark.parametrize(
    ("later_starts", "later_counts", "refused"),
    [
        ([18, 30], [1, 1], "r0"),  # back onto r0's accepted rows 18..21
        ([20, 30], [6, 1], "r0"),  # over the last of them
        ([21, 30], [6, 1], None),  # right after them: the usual optimistic step
        ([22, 19], [1, 4], "r1"),  # onto r1's rows 18..20
        ([22, 15], [1, 2], None),  # r1's reattach below its accepted rows
        ([22, 16], [1, 2], None),  # ending right where they begin
    ],
)
def test_a_later_step_scheduled_over_accepted_rows_is_refused(later_starts, later_counts, refused):
    table, names = setup([0, 0, 0])
    step = layout(table, names, [18, 18, 40], [6, 4, 1])
    plan = _plan([18, 18, 40], [21, 20, 40])  # r2 accepted nothing
    in_flight = [
        # Launched before it, over the same rows: this step's writes came after, so fine.
        layout(table, names[:2], [18, 18], [6, 4]),
        step,
        layout(table, names[:2], later_starts, later_counts),
        layout(table, names[2:], [39], [3]),  # r2 across its (empty) accepted range: fine
    ]
    if refused is None:
        step_commit.check_not_overwritten(step, plan, in_flight)
        return
    with pytest.raises(AuxOutputProtocolError, match=f"of request '{refused}' were overwritten"):
        step_commit.check_not_overwritten(step, plan, in_flight)


@pytest.mark.parametrize("placed_only", [False, True])
def test_new_slots_extend_each_ring_and_a_failed_requests_go_back(placed_only):
    """``give_new_slots``: each request's taken slots (``step_info[:, 3]``, batch order)
    extend its ring from its end, or from its first captured block (a partial one marked
    with ``partial_first_ok``); on a failed step (``placed_only``) the slots a request the
    kernel failed took are returned instead, and its ring stays as it was."""
    from r3capture.aux_output.step_commit import give_new_slots

    table, names = setup([NO_CURSOR, 8, NO_CURSOR])
    rows = table.rows(names)
    table.rings.extend(rows[1:2], np.array([2]), np.array([1]), np.array([40]))  # r1: block 2
    step_info = info([6, 12, 9], [2, 4, 3], taken=[1, 1, 2])
    step_info[2, 2] = 5  # the kernel failed r2
    unplaced = give_new_slots(
        table, rows, step_info, np.array([10, 11, 12, 13]), B,
        placed_only=placed_only, partial_first_ok=True,
    )  # fmt: skip
    assert table.rings.end[rows].tolist()[:2] == [2, 4] and table.rings.ring[rows[0], 1] == 10
    assert table.rings.ring[rows[1], 3] == 11 and table.rings.base[rows[1]] == 2
    assert table.rings.partial_start(int(rows[0])) == 6  # block 1 starts at 4: partial
    if placed_only:
        assert unplaced.tolist() == [12, 13] and table.rings.end[rows[2]] == 0
    else:
        assert unplaced.size == 0 and table.rings.end[rows[2]] == 4  # blocks 2, 3 of r2
        assert table.rings.ring[rows[2], 2:4].tolist() == [12, 13]
