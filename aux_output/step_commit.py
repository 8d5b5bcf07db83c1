"""The step commit: vLLM 0.33.0's checks and cursor moves for one processed step.

numpy and Python only (no torch, no store), so it is testable on its own. For every request
of the step it decides where the accepted rows start (the capture start: the scheduler's
start, or the request's cursor when it reattaches after a rejected speculative suffix), where
they end, and which rows to return: rows the step captured (``direct``) or rows from before
its capture start, which must be read back from the store (``materialize``, prefix-cache
hits).

Errors are vLLM's: the first request (in batch order) that fails any check names the error,
and for that request the checks come in vLLM's order.

These are vector operations over the step's requests; a small step is committed by a loop
over Python ints instead (``small_step.py``), which hands every step that fails a check to
this commit for its error. ``give_new_slots`` hands the slots a step's launch took from the
free-slot queue to its requests' rings.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from r3capture.aux_output.errors import AuxOutputProtocolError
from r3capture.aux_output.request_table import RequestTable
from r3capture.aux_output.slot_rings import NO_SLOTS

_CHECKS = (
    "auxiliary output request token count must be positive",
    "auxiliary output rejected-token count is invalid",
    "auxiliary output capture moved backwards",
    "auxiliary output capture has an unbacked token gap",
    "auxiliary output capture is not contiguous: a request's first rows must start on a "
    "hash-block boundary",
)


class StepLayout:
    """What ``prepare_output`` knew about a step, one entry per request: ``request_ids``,
    ``rows`` (request-table rows, int64 ``[R]``), ``token_starts`` (the scheduler's start of
    each request's rows, ``[R]``), ``query_start_loc`` (``[R + 1]``) and ``num_tokens``
    (rows scheduled per request, ``[R]``); integer arrays. ``num_rows``: the step's rows
    (``query_start_loc[R]``), an int.

    The host arrays may be given longer (Model Runner V2 sizes them for the most requests):
    they are cut to the step on first read, by the output thread's commit, so the launch
    pays for no view it does not need."""

    __slots__ = (
        "request_ids", "rows", "num_rows", "_starts", "_qsl", "_token_starts",
        "_query_start_loc", "_num_tokens",
    )  # fmt: skip

    def __init__(
        self,
        request_ids: list[str],
        rows: np.ndarray,
        token_starts: np.ndarray,
        query_start_loc: np.ndarray,
        num_rows: int | None = None,
    ) -> None:
        self.request_ids = request_ids
        self.rows = rows
        self._starts = token_starts  # [>= R]
        self._qsl = query_start_loc  # [>= R + 1]
        self.num_rows = int(query_start_loc[len(rows)]) if num_rows is None else num_rows
        self._token_starts: np.ndarray | None = None
        self._query_start_loc: np.ndarray | None = None
        self._num_tokens: np.ndarray | None = None

    @property
    def token_starts(self) -> np.ndarray:
        if self._token_starts is None:
            self._token_starts = self._starts[: len(self.rows)]
        return self._token_starts

    @property
    def query_start_loc(self) -> np.ndarray:
        if self._query_start_loc is None:
            self._query_start_loc = self._qsl[: len(self.rows) + 1]
        return self._query_start_loc

    @property
    def num_tokens(self) -> np.ndarray:
        if self._num_tokens is None:
            qsl = self.query_start_loc
            self._num_tokens = qsl[1:] - qsl[:-1]
        return self._num_tokens


@dataclass
class CommitPlan:
    """Outcome of one commit (int64 arrays over the step's requests)."""

    capture_starts: np.ndarray  # [R] position of each request's first accepted row
    token_ends: np.ndarray  # [R] end of its accepted rows (the new cursor)
    emit_starts: np.ndarray  # [R] first row to return (the emit cursor before the commit)
    direct: np.ndarray  # requests whose returned rows all come from this step
    materialize: np.ndarray  # requests whose returned rows start before their capture start
    rows_written: int  # rows the kernel wrote for the step (its step_info; 0 without one)


def commit_step(
    layout: StepLayout,
    table: RequestTable,
    num_sampled: np.ndarray,
    num_rejected: np.ndarray,
    step_info: np.ndarray | None,
    block_size: int,
    partial_first_ok: bool = False,
) -> CommitPlan:
    """Check one step and move the cursors of its requests in ``table``.

    ``num_sampled``/``num_rejected``: the host counts, 1-D integer arrays of ``>= R``
    entries (``process_output`` checked them with ``check_host_counts``); ``step_info``:
    the kernel's ``int32 [R, 4]`` (start, rows written or -1, status, slots taken) or None
    for an empty step. ``partial_first_ok``: a request's first capture may start inside a
    hash block (a P/D decoder whose prompt KV came from a prefiller; vLLM refuses it).
    Raises ``AuxOutputProtocolError`` without changing ``table``.
    """
    rows, starts, num_tokens = layout.rows, layout.token_starts, layout.num_tokens
    num_reqs = len(rows)
    sampled = num_sampled[:num_reqs]
    accepted = num_tokens - num_rejected[:num_reqs]
    cursor = table.cursor[rows]
    fresh = cursor < 0  # NO_CURSOR: the request's first capture starts where scheduled
    cursor = np.where(fresh, starts, cursor)
    capture_starts = np.minimum(starts, cursor)
    # Every check in one pass; which one failed is worked out only on failure.
    bad = (accepted < 0) | (accepted > num_tokens)
    bad |= num_tokens <= 0
    bad |= starts < cursor
    bad |= (starts > cursor) & (cursor >= table.scheduled[rows])
    if not partial_first_ok:
        bad |= fresh & (accepted > 0) & (capture_starts % block_size != 0)
    rows_written = 0
    if step_info is not None:
        # The kernel placed every accepted row where the host expects it.
        start, written, status = step_info[:, :3].T
        bad |= status != 0
        bad |= written < accepted
        bad |= start != capture_starts
        rows_written = int(np.add.reduce(written, dtype=np.int64))
    if bad.any():
        _raise_first_error(
            layout, table, fresh & (not partial_first_ok), cursor, bad, step_info,
            capture_starts, accepted, block_size,
        )  # fmt: skip
    token_ends = capture_starts + accepted
    emit_starts = table.emit[rows]
    emits = (sampled > 0) & (emit_starts <= token_ends)
    before = emit_starts < capture_starts
    direct = (emits & ~before).nonzero()[0]
    materialize = (emits & before).nonzero()[0]
    table.advance(rows, token_ends, starts + num_tokens, np.where(emits, token_ends, emit_starts))
    return CommitPlan(capture_starts, token_ends, emit_starts, direct, materialize, rows_written)


def _raise_first_error(
    layout: StepLayout,
    table: RequestTable,
    fresh: np.ndarray,
    cursor: np.ndarray,
    bad: np.ndarray,
    step_info: np.ndarray | None,
    capture_starts: np.ndarray,
    accepted: np.ndarray,
    block_size: int,
) -> None:
    """vLLM's error for the first request failing a protocol check (in vLLM's order of
    checks); failing none, the first request the kernel did not place as expected."""
    starts, num_tokens = layout.token_starts, layout.num_tokens
    checks = (
        num_tokens <= 0,
        (accepted < 0) | (accepted > num_tokens),
        starts < cursor,
        (starts > cursor) & (cursor >= table.scheduled[layout.rows]),
        fresh & (accepted > 0) & (capture_starts % block_size != 0),
    )
    failed = checks[0] | checks[1] | checks[2] | checks[3] | checks[4]
    if failed.any():
        first = int(np.argmax(failed))
        message = next(text for mask, text in zip(checks, _CHECKS) if mask[first])
        raise AuxOutputProtocolError(f"{message}: request={layout.request_ids[first]}")
    i = int(np.argmax(bad))
    start, written, status = (int(x) for x in step_info[i, :3])
    name, reason = _kernel_failure(layout, step_info, status)
    raise AuxOutputProtocolError(
        "auxiliary output rows were not placed by the capture kernel: "
        f"request={layout.request_ids[i]}, status={status} ({name}), start={start} "
        f"(expected {int(capture_starts[i])}), rows written={written} of "
        f"{int(accepted[i])} accepted; {reason}"
    )


def _kernel_failure(layout: StepLayout, step_info: np.ndarray, status: int) -> tuple[str, str]:
    """The name of ``status`` (a request's ``step_info[:, 2]``) and what the step got wrong."""
    # Imported on the failure path only: the commit itself needs no torch.
    from r3capture.kernels import Status

    if status not in Status._value2member_map_:
        return "unknown", "the kernel writes no such status: step_info was not the kernel's"
    name = Status(status).name
    if name == "SHARED_INDEX":
        sharing = [layout.request_ids[i] for i in np.flatnonzero(step_info[:, 2] == status)]
        return name, (
            "input_batch.idx_mapping gives its request index to another request of the step "
            f"(requests {sharing} failed so), or gave it to two requests of an earlier step "
            "and no new request has taken it since; each request needs an index of its own"
        )
    return name, _KERNEL_FAILURES[name]


# What a request the kernel failed got wrong, by status (kernels/_common.py, docs/errors.md).
_KERNEL_FAILURES = {
    "OK": "the device and host rejected counts must agree",  # placed, but not as expected
    "BAD_REJECTED": "the device num_rejected is negative or above its scheduled rows",
    "BAD_BLOCK": "a block of its rows has no slot the device ring can vouch for: a start "
    "below the blocks the ring keeps, or an entry naming another block or a slot outside "
    "the arena",
    "BAD_ROWS": "the device query_start_loc starts below 0, decreases or passes the rows",
    "BAD_INDEX": "input_batch.idx_mapping gives it a request index outside [0, max_num_seqs)",
    "NO_STOCK": "the free-slot queue could not cover its new blocks",
    "BAD_LAUNCH": "the launch serial is not the last launch's + 1 (the kernel's device state "
    "was launched by another caller, or reset): every request of the step failed",
}


def check_not_overwritten(
    layout: StepLayout, plan: CommitPlan, in_flight: list[StepLayout]
) -> None:
    """Fail closed when a step launched after ``layout`` and still in flight (those after it
    in ``in_flight``, launch order) was scheduled over rows ``layout`` accepted (``plan``):
    in the ``direct`` destination each launch writes the store slots at once, so those
    slots no longer hold this step's rows.

    Only possible with two or more later steps in flight (depth >= 3, pipeline
    parallelism): at depth 2 the one later step was scheduled before this step's result and
    starts past its rows. A scheduler that moves a request back onto rows of a step whose
    result it has not seen recomputes tokens still in flight; vLLM 0.33.0's connector keeps
    each step's rows apart and returns them, and so does the ``staging`` destination (each
    step's rows are placed at its commit).
    """
    for other in in_flight[in_flight.index(layout) + 1 :]:
        _, here, there = np.intersect1d(
            layout.rows, other.rows, assume_unique=True, return_indices=True
        )
        if not here.size:
            continue
        starts = other.token_starts[there]
        ends = starts + other.num_tokens[there]
        accepted_start, accepted_end = plan.capture_starts[here], plan.token_ends[here]
        # A step that accepted no rows (a rejected or optimistic one) has none to lose.
        overlap = (starts < accepted_end) & (ends > accepted_start)
        overlap &= accepted_start < accepted_end
        if overlap.any():
            j = int(np.argmax(overlap))
            i = int(here[j])
            raise AuxOutputProtocolError(
                f"auxiliary output rows [{int(plan.capture_starts[i])}, "
                f"{int(plan.token_ends[i])}) of request {layout.request_ids[i]!r} were "
                f"overwritten by a later step in flight scheduled from {int(starts[j])}; "
                "the direct destination cannot return them "
                "(R3CAPTURE_DESTINATION=staging keeps each step's rows apart)"
            )


def give_new_slots(
    table: RequestTable,
    rows: np.ndarray,
    step_info: np.ndarray,
    slots: np.ndarray,
    block_size: int,
    *,
    placed_only: bool = False,
    partial_first_ok: bool = False,
) -> np.ndarray:
    """Give the step's requests (table ``rows``, int64 ``[R]``) the ``slots`` (int64) their
    launch took from the queue, ``step_info[:, 3]`` of them each, in batch order: each
    request's new blocks start at its ring's end, or at its first captured block (a
    partial one, with ``partial_first_ok``, is marked so). Returns the slots no request
    takes (int64): with ``placed_only`` (a step that failed), those a request the kernel
    failed took, since its launch wrote no ring entry for them (a request sharing its index
    takes them all the same)."""
    taken = step_info[:, 3]
    unplaced_slots = NO_SLOTS
    if placed_only:
        failed = step_info[:, 2] != 0
        if failed.any():
            unplaced = np.repeat(failed, taken)
            unplaced_slots = slots[unplaced]
            slots, taken = slots[~unplaced], np.where(failed, 0, taken)
            if not slots.size:
                return unplaced_slots
    grew = taken.nonzero()[0]
    grown = rows[grew]
    ends = table.rings.end[grown]
    starts = step_info[grew, 0].astype(np.int64)
    firsts = np.where(ends == 0, starts // block_size, ends)
    table.rings.extend(grown, firsts, taken[grew].astype(np.int64), slots)
    if partial_first_ok:
        partial = ((ends == 0) & (starts % block_size != 0)).nonzero()[0]
        if partial.size:
            table.rings.mark_partial_first(grown[partial], starts[partial])
    return unplaced_slots
