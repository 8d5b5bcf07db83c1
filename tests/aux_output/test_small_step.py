"""The small-step commit against the vector commit, on the same random steps.

``commit_small_step`` must commit every well-formed step it takes exactly as the vector path
does (the slots its launch took, then ``commit_step``, then ``RowReader.emit``): the same
outputs, byte for byte, the same prefix hits, the same cursors, ring and slots. A malformed
step it must hand back untouched (None, nothing written, no slot taken), for the vector
commit to raise vLLM's error.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
from random_steps import B, random_step

from r3capture.aux_output import small_step
from r3capture.aux_output.errors import AuxOutputProtocolError
from r3capture.aux_output.output_pool import OutputPool
from r3capture.aux_output.row_reader import RowReader
from r3capture.aux_output.small_step import commit_small_step
from r3capture.aux_output.step_commit import commit_step

L, K = 2, 3
SLOTS = 4096


def _with_slots(rng: random.Random, table, step, placed) -> np.ndarray:
    """Give each request of ``step`` a slot for the block its capture starts in (unless it
    has none yet), and set the kernel's slots taken (``placed[:, 3]``) to the blocks its
    written rows enter beyond that; returns an arena of random rows ``[SLOTS * B, L, K]``."""
    next_slot = 1000  # taken slots come from 0; the ones held before from here
    for i, row in enumerate(step.rows.tolist()):
        capture, written = int(placed[i, 0]), int(placed[i, 1])
        first = capture // B
        if table.cursor[row] >= 0:  # a request with a cursor holds its capture's block
            table.rings.extend_row(row, first, np.array([next_slot], np.int64))
            next_slot += 1
            first += 1
        last = (capture + written - 1) // B if written > 0 else first - 1
        placed[i, 3] = max(0, last + 1 - first)
    arena = np.frombuffer(rng.randbytes(SLOTS * B * L * K), np.uint8)
    return arena.reshape(SLOTS * B, L, K).copy()


def _state(table, rows):
    columns = (
        table.cursor,
        table.scheduled,
        table.emit,
        table.rings.base,
        table.rings.end,
        table.rings.partial,
    )
    return [c[rows].tolist() for c in columns] + [table.rings.ring[rows].tolist()]


def _taker(log):
    """A free-slot queue that hands out 0, 1, 2, ... and logs each commit's total."""

    def take(total):
        first = sum(log)
        log.append(total)
        return np.arange(first, first + total, dtype=np.int64)

    return take


def _vector_commit(table, step, placed, sampled, rejected, arena, log):
    """What ``RequestBook.commit`` does for a step the small commit does not take."""
    taken = placed[:, 3].astype(np.int64)
    slots = _taker(log)(int(taken.sum()))
    grew = taken.nonzero()[0]
    if grew.size:
        rows = step.rows[grew]
        ends = table.rings.end[rows]
        firsts = np.where(ends == 0, placed[grew, 0].astype(np.int64) // B, ends)
        table.rings.extend(rows, firsts, taken[grew], slots)
    plan = commit_step(step, table, sampled, rejected, placed, B)
    store = SimpleNamespace(arena_np=arena.reshape(-1, B * L * K))
    reader = RowReader(
        store, table, block_size=B, shape_per_token=(L, K), dtype=np.uint8,
        output_pool=OutputPool(max_bytes=0),
    )  # fmt: skip
    outputs = reader.emit(step, plan)
    hits = [
        (i, int(plan.emit_starts[i]), int(plan.token_ends[i])) for i in plan.materialize.tolist()
    ]
    return outputs, hits, plan.rows_written


@pytest.mark.parametrize("seed", range(400))
def test_small_and_vector_commits_agree(seed):
    """Random steps of 1 to 32 requests, a third of them malformed."""
    rng = random.Random(seed)
    num_reqs, valid = rng.randrange(1, 33), rng.random() < 0.67
    results = {}
    for form in ("small", "vector"):
        table, step, sampled, rejected, placed = random_step(random.Random(seed), num_reqs, valid)
        arena = _with_slots(random.Random(seed), table, step, placed)
        before = _state(table, step.rows)
        log = []
        if form == "small":
            done = commit_small_step(
                step, table, placed, sampled, rejected, block_size=B, partial_first_ok=False,
                take_slots=_taker(log), arena_rows=arena,
            )  # fmt: skip
            if done is None:
                # Handed back untouched: no slot taken, no cursor moved.
                assert log == [] and _state(table, step.rows) == before
                results[form] = None
                continue
            outcome = (done.outputs, done.materialize, done.rows_written)
        else:
            try:
                outcome = _vector_commit(table, step, placed, sampled, rejected, arena, log)
            except AuxOutputProtocolError:
                results[form] = "error"
                continue
        outputs = {k: (v.token_start, v.rows.tolist()) for k, v in outcome[0].items()}
        results[form] = (outputs, outcome[1], outcome[2], _state(table, step.rows), log)
    small, vector = results["small"], results["vector"]
    if small is None:
        # Malformed, or returning more of the step's own rows than a small commit takes.
        assert (
            vector == "error"
            or sum(len(rows) for _, rows in vector[0].values()) > small_step.EMIT_ROWS_MAX
        )
    else:
        assert small == vector


def test_completing_names_the_rows_whose_capture_crossed_a_block_end():
    table, step, sampled, rejected, placed = random_step(random.Random(7), 12, True)
    arena = _with_slots(random.Random(7), table, step, placed)
    cursors_before = table.cursor[step.rows].copy()
    done = commit_small_step(
        step, table, placed, sampled, rejected, block_size=B, partial_first_ok=False,
        take_slots=_taker([]), arena_rows=arena,
    )  # fmt: skip
    assert done is not None
    starts = np.where(cursors_before < 0, step.token_starts, cursors_before)
    ends = table.cursor[step.rows]
    expected = [
        row
        for row, s, e in zip(step.rows.tolist(), starts.tolist(), ends.tolist())
        if e // B > s // B
    ]
    assert done.completing == expected
