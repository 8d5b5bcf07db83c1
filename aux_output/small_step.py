"""The commit of a small step as one loop over its requests.

A step of up to ``PER_REQUEST_MAX`` requests (the long tail of a rollout batch, a handful of
agents or chats decoding) spends most of its commit on the fixed cost of vector calls: each
numpy call costs about a microsecond whatever the batch, and the vector commit makes a few
dozen of them.
``commit_small_step`` does the same work over Python ints instead:

1. one pass checks every request as vLLM does (``step_commit``'s checks, same order, same
   outcome) and works out its cursors and the rows to return, writing nothing;
2. a second hands each request the slots its launch took from the free-slot queue, moves the
   cursors, and lists the arena rows of the returned rows through the slot ring;
3. one gather copies those rows out of the arena.

It returns None, having changed nothing, for a step it does not take: one that fails any
check (the vector commit then raises vLLM's error for it) or returns more than
``EMIT_ROWS_MAX`` rows captured in the step (a finished prefill: copying it dwarfs the vector
calls, and listing its arena rows one by one costs more than the vector form). A step it
takes is committed exactly as the vector commit would commit it:
``tests/aux_output/test_small_step.py`` checks both on the same random steps.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from r3capture.aux_output.request_table import RequestTable
from r3capture.aux_output.step_commit import StepLayout
from r3capture.aux_output.types import AuxRequestOutput

# Second form of the commit, for steps of up to this many requests.
PER_REQUEST_MAX = 32
# Most rows a small commit returns from the step's own capture.
EMIT_ROWS_MAX = 64


class SmallCommit:
    """What a small commit leaves for ``RequestBook.commit``: the outputs of the requests
    whose returned rows the step captured, the prefix hits to read from the store
    (``(index in the step, emit start, token end)``), the table rows whose capture crossed a
    block end (only their blocks can have become ready to publish) and the rows the kernel
    wrote."""

    __slots__ = ("outputs", "materialize", "completing", "rows_written")

    def __init__(
        self,
        outputs: dict[str, AuxRequestOutput],
        materialize: list[tuple[int, int, int]],
        completing: list[int],
        rows_written: int,
    ) -> None:
        self.outputs = outputs
        self.materialize = materialize
        self.completing = completing
        self.rows_written = rows_written


def commit_small_step(
    layout: StepLayout,
    table: RequestTable,
    step_info: np.ndarray,
    num_sampled: np.ndarray,
    num_rejected: np.ndarray,
    *,
    block_size: int,
    partial_first_ok: bool,
    take_slots: Callable[[int], np.ndarray],
    arena_rows: np.ndarray,
) -> SmallCommit | None:
    """Commit one step of ``layout``'s requests (see the module docstring), or return None
    with nothing changed.

    ``step_info``: the kernel's ``int32 [R, 4]`` (start, rows written, status, slots taken);
    ``num_sampled``/``num_rejected``: the host counts (``>= R`` entries each);
    ``take_slots(total)``: the slots (int64 ``[total]``, batch order) the launch took from
    the queue, called once; ``arena_rows``: the store arena as rows ``[slots * B, L, K]``.
    """
    B = block_size
    rows = layout.rows.tolist()
    num_reqs = len(rows)
    starts = layout.token_starts.tolist()
    bounds = layout.query_start_loc.tolist()
    sampled = num_sampled[:num_reqs].tolist()
    rejected = num_rejected[:num_reqs].tolist()
    placed = step_info.tolist()
    cursors, scheduled, emits = table.cursor, table.scheduled, table.emit
    # Per request: (row, new cursor, new scheduled end, new emit cursor).
    moves = []
    direct: list[tuple[int, int, int]] = []
    materialize: list[tuple[int, int, int]] = []
    completing: list[int] = []
    rows_written = emitted_rows = total_taken = 0
    for i in range(num_reqs):
        row, start, r = rows[i], starts[i], rejected[i]
        n = bounds[i + 1] - bounds[i]
        cursor = cursors.item(row)
        fresh = cursor < 0  # NO_CURSOR: the first capture starts where scheduled
        if fresh:
            cursor = start
        accepted = n - r
        if n <= 0 or r < 0 or accepted < 0 or start < cursor:
            return None
        if start > cursor and cursor >= scheduled.item(row):
            return None
        # start >= cursor here: a reattached request captures from its cursor.
        capture = cursor
        if fresh and accepted > 0 and capture % B and not partial_first_ok:
            return None
        kernel_start, written, status, taken = placed[i]
        if status or written < accepted or kernel_start != capture:
            return None
        rows_written += written
        total_taken += taken
        end = capture + accepted
        if end // B > capture // B:
            completing.append(row)
        emit = emits.item(row)
        if sampled[i] > 0 and emit <= end:
            if emit < capture:
                materialize.append((i, emit, end))
            else:
                direct.append((i, emit, end))
                emitted_rows += end - emit
            moves.append((row, end, start + n, end))
        else:
            moves.append((row, end, start + n, emit))
    if emitted_rows > EMIT_ROWS_MAX:
        return None
    _take_slots(table, rows, placed, take_slots(total_taken), B, partial_first_ok)
    for row, cursor, scheduled_end, emit in moves:
        cursors[row] = cursor
        scheduled[row] = scheduled_end
        emits[row] = emit
    return SmallCommit(
        _emit(layout.request_ids, rows, direct, table, B, arena_rows),
        materialize,
        completing,
        rows_written,
    )


def _take_slots(
    table: RequestTable,
    rows: list[int],
    placed: list[list[int]],
    slots: np.ndarray,
    block_size: int,
    partial_first_ok: bool,
) -> None:
    """Give each request the slots its launch took (``placed[i][3]`` of ``slots``, in batch
    order): its new blocks start at its ring's end, or at its first captured block."""
    if not slots.size:
        return
    offset = 0
    ends = table.rings.end
    for row, (start, _, _, count) in zip(rows, placed):
        if not count:
            continue
        end = ends.item(row)
        table.rings.extend_row(row, end or start // block_size, slots[offset : offset + count])
        offset += count
        if not end and partial_first_ok and start % block_size:
            table.rings.mark_partial_first(np.array([row]), np.array([start]))


def _emit(
    request_ids: list[str],
    rows: list[int],
    direct: list[tuple[int, int, int]],
    table: RequestTable,
    block_size: int,
    arena_rows: np.ndarray,
) -> dict[str, AuxRequestOutput]:
    """Rows ``emit_start .. token_end`` of each ``direct`` request (``(index in the step,
    emit start, token end)``), copied out of the arena with one gather."""
    if not direct:
        return {}
    B = block_size
    ring, width = table.rings.ring, table.rings.ring_width
    index: list[int] = []
    for i, position, end in direct:
        row = rows[i]
        while position < end:
            # A run of rows inside one block is a run of arena rows.
            block = position // B
            stop = min(end, block * B + B)
            first = ring.item(row, block % width) * B + position - block * B
            index.extend(range(first, first + stop - position))
            position = stop
    # take, not fancy indexing: the same copy at about a third of the fixed cost for a few rows.
    emitted = arena_rows.take(index, axis=0)
    outputs = {}
    offset = 0
    for i, emit_start, end in direct:
        count = end - emit_start
        outputs[request_ids[i]] = AuxRequestOutput(emit_start, emitted[offset : offset + count])
        offset += count
    return outputs
