"""The step commit: vLLM 0.33.0's checks and cursor moves for one processed step, as vectors.

numpy only (no torch, no store), so it is testable on its own. For every request of the step
it decides where the accepted rows start (the capture start: the scheduler's start, or the
request's cursor when it reattaches after a rejected speculative suffix), where they end, and
which rows to return: rows the step captured (``direct``) or rows from before its capture
start, which must be read back from the store (``materialize``, prefix-cache hits).

Errors are vLLM's: the first request (in batch order) that fails any check names the error,
and for that request the checks come in vLLM's order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from r3capture.aux_output.errors import AuxOutputProtocolError
from r3capture.aux_output.request_table import NO_CURSOR, RequestTable

_CHECKS = (
    "auxiliary output request token count must be positive",
    "auxiliary output rejected-token count is invalid",
    "auxiliary output capture moved backwards",
    "auxiliary output capture has an unbacked token gap",
    "auxiliary output capture is not contiguous: a request's first rows must start on a "
    "hash-block boundary",
)


@dataclass
class StepLayout:
    """What ``prepare_output`` knew about a step (all int64, one entry per request)."""

    request_ids: list[str]
    rows: np.ndarray  # request-table rows [R]
    token_starts: np.ndarray  # the scheduler's start of each request's rows [R]
    query_start_loc: np.ndarray  # [R + 1]
    num_tokens: np.ndarray = field(init=False)  # rows scheduled per request [R]

    def __post_init__(self) -> None:
        self.num_tokens = self.query_start_loc[1:] - self.query_start_loc[:-1]


@dataclass
class CommitPlan:
    """Outcome of one commit (int64 arrays over the step's requests)."""

    capture_starts: np.ndarray  # [R] position of each request's first accepted row
    token_ends: np.ndarray  # [R] end of its accepted rows (the new cursor)
    emit_starts: np.ndarray  # [R] first row to return (the emit cursor before the commit)
    direct: np.ndarray  # requests whose returned rows all come from this step
    materialize: np.ndarray  # requests whose returned rows start before their capture start


def commit_step(
    layout: StepLayout,
    table: RequestTable,
    num_sampled: np.ndarray,
    num_rejected: np.ndarray,
    step_info: np.ndarray | None,
    block_size: int,
) -> CommitPlan:
    """Check one step and move the cursors of its requests in ``table``.

    ``num_sampled``/``num_rejected``: the host counts (``[>= R]``); ``step_info``: the
    kernel's ``int32 [R, 3]`` (start, rows written or -1, status) or None for an empty step.
    Raises ``AuxOutputProtocolError`` without changing ``table``.
    """
    rows, starts = layout.rows, layout.token_starts
    num_reqs = len(rows)
    num_tokens = layout.num_tokens
    given = {"num_sampled": np.asarray(num_sampled), "num_rejected": np.asarray(num_rejected)}
    for name, counts in given.items():
        if counts.ndim != 1 or counts.shape[0] < num_reqs or counts.dtype.kind not in "iu":
            raise ValueError(
                f"{name} must be a 1-D integer array of >= {num_reqs} counts (one per request "
                f"of the step); got {counts.dtype} of shape {counts.shape}"
            )
    sampled = given["num_sampled"][:num_reqs]
    rejected = given["num_rejected"][:num_reqs]
    rejected = rejected.astype(np.int64, copy=False)
    accepted = num_tokens - rejected
    cursor = table.cursor[rows]
    fresh = cursor == NO_CURSOR
    cursor = np.where(fresh, starts, cursor)
    reattach = starts > cursor
    capture_starts = np.where(reattach, cursor, starts)
    checks = (
        num_tokens <= 0,
        (rejected < 0) | (accepted < 0),
        starts < cursor,
        reattach & (cursor >= table.scheduled[rows]),
        fresh & (accepted > 0) & (capture_starts % block_size != 0),
    )
    failed = checks[0] | checks[1] | checks[2] | checks[3] | checks[4]
    if np.count_nonzero(failed):
        first = int(np.argmax(failed))
        message = next(text for mask, text in zip(checks, _CHECKS) if mask[first])
        raise AuxOutputProtocolError(f"{message}: request={layout.request_ids[first]}")
    if step_info is not None:
        _check_kernel(layout.request_ids, step_info, capture_starts, accepted)

    token_ends = capture_starts + accepted
    emit_starts = table.emit[rows]
    emits = (sampled > 0) & (emit_starts <= token_ends)
    before = emit_starts < capture_starts
    direct = (emits & ~before).nonzero()[0]
    materialize = (emits & before).nonzero()[0]
    table.cursor[rows] = token_ends
    table.scheduled[rows] = starts + num_tokens
    emitted = rows[emits]
    table.emit[emitted] = token_ends[emits]
    return CommitPlan(capture_starts, token_ends, emit_starts, direct, materialize)


def _check_kernel(
    request_ids: Sequence[str],
    step_info: np.ndarray,
    expected_starts: np.ndarray,
    accepted: np.ndarray,
) -> None:
    """Every request's rows were placed where the host expects them, all of them."""
    bad = (step_info[:, 2] != 0) | (step_info[:, 1] < accepted)
    bad |= step_info[:, 0] != expected_starts
    if np.count_nonzero(bad):
        i = int(np.argmax(bad))
        start, written, status = (int(x) for x in step_info[i])
        raise AuxOutputProtocolError(
            "auxiliary output rows were not placed by the capture kernel: "
            f"request={request_ids[i]}, status={status}, start={start} "
            f"(expected {int(expected_starts[i])}), rows written={written} of "
            f"{int(accepted[i])} accepted; the device and host rejected counts must agree"
        )
