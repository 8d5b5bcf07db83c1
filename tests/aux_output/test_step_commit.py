"""commit_step: vLLM 0.33.0's checks, cursors and emit decisions, on numpy arrays alone.

Every test runs with both mechanisms: the per-request loop (small steps) and the vector
operations (large steps, and every step that fails a check)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from r3capture.aux_output import step_commit
from r3capture.aux_output.errors import AuxOutputProtocolError
from r3capture.aux_output.request_table import NO_CURSOR, RequestTable
from r3capture.aux_output.step_commit import StepLayout, commit_step

B = 4


@pytest.fixture(autouse=True, params=["per-request", "vectorized"])
def mechanism(request, monkeypatch):
    if request.param == "vectorized":
        monkeypatch.setattr(step_commit, "PER_REQUEST_MAX", 0)
    return request.param


def setup(cursors, scheduled=None, emits=None):
    table = RequestTable(ring_width=8)
    names = [f"r{i}" for i in range(len(cursors))]
    for i, name in enumerate(names):
        row = table.add(name, 0 if emits is None else emits[i])
        table.cursor[row] = cursors[i]
        table.scheduled[row] = 0 if scheduled is None else scheduled[i]
    return table, names


def layout(table, names, starts, counts):
    qsl = np.zeros(len(names) + 1, np.int64)
    np.cumsum(counts, out=qsl[1:])
    return StepLayout(names, table.rows(names), np.asarray(starts, np.int64), qsl)


def info(starts, written, taken=None):
    """The kernel's ``step_info``: start, rows written, status 0 and slots taken (which the
    commit does not check: the request book hands them to the table first)."""
    zeros = np.zeros(len(starts))
    taken = zeros if taken is None else taken
    return np.stack([starts, written, zeros, taken], axis=1).astype(np.int32)


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
    if plan.completing is not None:  # the per-request loop's
        # Only r1's rows (10..12) complete a block (8..12); r0 and r2 stay inside theirs.
        assert plan.completing.tolist() == [1]
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


def _random_step(rng: random.Random, num_reqs: int, valid: bool):
    """A table and a step for it: mostly well-formed requests (decode; reattach after a
    rejected suffix, with rows returned up to or past its new end; first capture; a first
    step off a block boundary whose rows are all rejected; prefix hits; nothing sampled);
    with ``valid`` False, one field of one request is corrupted."""
    cursors, scheduled, emits, starts, counts, rejected, sampled = ([] for _ in range(7))
    for _ in range(num_reqs):
        kind = rng.choice(["decode", "reattach", "fresh", "fresh-all-rejected", "hit"])
        cursor = rng.randrange(0, 64)
        n = rng.randrange(1, 6)
        if kind == "fresh":
            start, cur, sched = rng.randrange(0, 16) * B, NO_CURSOR, 0
            emit = rng.choice([start, 0])
        elif kind == "fresh-all-rejected":
            start, cur, sched = rng.randrange(0, 16) * B + rng.randrange(1, B), NO_CURSOR, 0
            emit = rng.choice([start, 0])
        elif kind == "reattach":
            start, cur, sched = cursor + rng.randrange(1, 3), cursor, cursor + 3
            # The rows it returned may reach past what this step accepts (async drafts).
            emit = rng.choice([cursor, cursor + 8])
        else:
            start, cur, sched = cursor, cursor, cursor
            emit = cursor if kind == "decode" else rng.randrange(0, cursor + 1)
        cursors.append(cur), scheduled.append(sched), emits.append(emit)
        starts.append(start), counts.append(n)
        rejected.append(n if kind == "fresh-all-rejected" else rng.randrange(0, n + 1))
        sampled.append(rng.choice([0, 1, 1, 2]))
    if not valid:
        i = rng.randrange(num_reqs)
        field, value = rng.choice(
            [
                ("counts", 0),
                ("rejected", -1),
                ("rejected", counts[i] + 1),
                ("starts", starts[i] - 1),
                ("starts", starts[i] + 5),
                ("starts", starts[i] + 1),
            ]
        )
        {"counts": counts, "rejected": rejected, "starts": starts}[field][i] = value
    table, names = setup(cursors, scheduled=scheduled, emits=emits)
    step = layout(table, names, starts, counts)
    cursor = np.where(np.array(cursors) < 0, starts, cursors)
    capture = np.minimum(starts, cursor)
    accepted = np.array(counts) - np.array(rejected)
    # Without the device's rejected counts the kernel writes every scheduled row.
    written = accepted if rng.random() < 0.5 else np.array(counts)
    # Slots taken: whatever the launch opened (0 to 2 blocks here); the commit ignores them.
    placed = info(capture, written, [rng.randrange(3) for _ in range(num_reqs)])
    if not valid and rng.random() < 0.5:
        i = rng.randrange(num_reqs)
        placed[i, rng.randrange(3)] += rng.choice([-1, 1, 2])
    return table, step, np.array(sampled), np.array(rejected), placed


@pytest.mark.parametrize("mechanism", ["both"])  # this test picks each mechanism itself
@pytest.mark.parametrize("seed", range(300))
def test_per_request_and_vectorized_commits_agree(seed, mechanism, monkeypatch):
    """The loop and the vector operations give the same plan, the same table and the same
    error on random steps of 1 to 40 requests, a third of them malformed; the loop commits
    every step that passes the checks itself (it hands only failures to the vector
    operations)."""
    rng = random.Random(seed)
    num_reqs, valid = rng.randrange(1, 41), rng.random() < 0.67
    vector_calls = []
    vectorized = step_commit._commit_vectorized

    def counting_vectorized(*args, **kwargs):
        vector_calls.append(limit)
        return vectorized(*args, **kwargs)

    monkeypatch.setattr(step_commit, "_commit_vectorized", counting_vectorized)
    results = []
    for limit in (10**6, 0):
        table, step, sampled, rejected, placed = _random_step(random.Random(seed), num_reqs, valid)
        monkeypatch.setattr(step_commit, "PER_REQUEST_MAX", limit)
        try:
            plan = commit_step(step, table, sampled, rejected, placed, block_size=B)
            if plan.completing is not None:
                # The loop names the requests that complete a block; the vector commit
                # leaves that test to publication.
                crossed = plan.token_ends // B > plan.capture_starts // B
                assert plan.completing.tolist() == crossed.nonzero()[0].tolist()
            fields = [f for f in plan.__dataclass_fields__ if f != "completing"]
            outcome = [np.asarray(getattr(plan, f)).tolist() for f in fields]
        except AuxOutputProtocolError as exc:
            outcome = str(exc)
        state = [c[step.rows].tolist() for c in (table.cursor, table.scheduled, table.emit)]
        results.append((outcome, state))
    assert results[0] == results[1]
    committed = not isinstance(results[0][0], str)
    assert vector_calls == ([0] if committed else [10**6, 0])


def _plan(capture_starts, token_ends):
    n = len(capture_starts)
    return step_commit.CommitPlan(
        capture_starts=np.asarray(capture_starts, np.int64),
        token_ends=np.asarray(token_ends, np.int64),
        emit_starts=np.asarray(capture_starts, np.int64),
        direct=np.arange(n),
        materialize=np.empty(0, np.int64),
        rows_written=0,
        completing=None,
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
