"""Which requests of a step need new store slots before the launch, and taking them.

A request's slots cover its hash blocks up to ``RequestTable.end``. A step whose scheduled
rows reach past that block takes slots for the blocks it needs plus ``LOOKAHEAD_TOKENS`` more,
so most decode and speculative steps need none and change no ring entry. Slots come from the
store's producer reserve. When it runs short, the teardown recorded for the output thread
is applied first (it frees the finished requests' slots); the reserve grows rather than
fails only when requests outside the step (preempted ones) still hold more than it was
sized for.

Steps of up to ``PER_REQUEST_MAX`` requests are tested over Python ints, larger ones with
vector operations. Whenever at most ``FEW_GROWING`` requests grow (a prefill chunk, a new
prefix hit, the few requests of a large decode step that reach their lookahead's end), the
table takes their slots request by request; more use the table's vector pass. Each
mechanism's measured win is in ``bench/RESULTS.md`` (fast paths).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from r3capture.aux_output import step_commit
from r3capture.aux_output.request_table import RequestTable
from r3capture.aux_output.step_commit import StepLayout
from r3capture.store import BlockStore

# How far past its scheduled rows a request's slots reach when it takes new ones.
LOOKAHEAD_TOKENS = 256
# Most draft tokens a step's device positions may sit below the scheduler's start: a request
# reattaches at its cursor after the previous step rejected that many (the device ring's
# window has room for it).
REATTACH_TOKENS = 256
# Steps where at most this many requests grow take their slots request by request (a
# prefill chunk, a new prefix hit, a batch admitted together): ~4 numpy calls each against
# ~30 for the vector pass, which in the replay wins at 27 growing requests and more
# (bench/RESULTS.md, fast paths).
FEW_GROWING = 16


def lookahead_blocks(block_size: int) -> int:
    """``LOOKAHEAD_TOKENS`` in hash blocks of ``block_size`` tokens (rounded up)."""
    return -(-LOOKAHEAD_TOKENS // block_size)


def ring_widths(max_num_batched_tokens: int, block_size: int, depth: int) -> tuple[int, int]:
    """``(W, D)``: the host ring's width (most unbound blocks one request can hold) and the
    device ring's (most blocks one step of a request can write), in hash blocks.

    A request's unbound blocks span the steps in flight plus the one being prepared, each up
    to a full step of blocks, the blocks waiting for their keys, and the lookahead. The
    kernel needs only one step's: its rows from the first block (up to ``REATTACH_TOKENS``
    below the scheduler's start) to the lookahead past the last.
    """
    step_blocks = -(-max_num_batched_tokens // block_size) + 1
    lookahead = lookahead_blocks(block_size)
    reattach = -(-REATTACH_TOKENS // block_size)
    width = (depth + 1) * step_blocks + 1 + lookahead
    return width, min(width, step_blocks + 1 + lookahead + reattach)


class _SlotsFreed(Exception):
    """Raised by ``_allocate`` (before any change) after recorded teardown freed slots."""


class SlotPlanner:
    """Slot taking for the launches of one request table and store (main thread).

    ``apply_teardown()`` applies teardown that is recorded but not yet applied and returns
    whether there was any: the reserve grows only when that frees too few slots.
    """

    def __init__(
        self,
        table: RequestTable,
        store: BlockStore,
        block_size: int,
        apply_teardown: Callable[[], bool],
    ) -> None:
        self._table = table
        self._store = store
        self._block_size = block_size
        self._apply_teardown = apply_teardown
        self.lookahead_blocks = lookahead_blocks(block_size)

    def take_slots(self, layout: StepLayout) -> tuple[np.ndarray, np.ndarray] | None:
        """New slots for the step's requests whose scheduled rows reach past their last block
        with a slot (and ``LOOKAHEAD_TOKENS`` beyond); returns the ring entries that changed
        (``RequestTable.take_slots``), or None when none did."""
        try:
            return self._take_slots(layout)
        except _SlotsFreed:
            return self._take_slots(layout)

    def _take_slots(self, layout: StepLayout) -> tuple[np.ndarray, np.ndarray] | None:
        B = self._block_size
        rows, starts, qsl = layout.rows, layout.token_starts, layout.query_start_loc
        if len(rows) <= step_commit.PER_REQUEST_MAX:
            # A few requests: Python ints beat numpy's per-call cost (as in the commit).
            ends = self._table.end[rows].tolist()
            bounds = qsl.tolist()
            grow_rows, firsts, lasts = [], [], []
            for i, (row, start) in enumerate(zip(rows.tolist(), starts.tolist())):
                last = (start + bounds[i + 1] - bounds[i] - 1) // B
                if last >= ends[i]:
                    grow_rows.append(row)
                    firsts.append(start // B)
                    lasts.append(last + self.lookahead_blocks)
            if not grow_rows:
                return None
            if len(grow_rows) <= FEW_GROWING:
                return self._table.take_slots_per_request(grow_rows, firsts, lasts, self._allocate)
            grow_rows, firsts, lasts = (np.array(x, np.int64) for x in (grow_rows, firsts, lasts))
        else:
            lasts = starts + qsl[1:]
            lasts -= qsl[:-1]
            lasts -= 1
            lasts //= B
            grow = (lasts >= self._table.end[rows]).nonzero()[0]
            if not grow.size:
                return None
            grow_rows, firsts, lasts = rows[grow], starts[grow] // B, lasts[grow]
            lasts += self.lookahead_blocks
            if len(grow) <= FEW_GROWING:
                return self._table.take_slots_per_request(
                    grow_rows.tolist(), firsts.tolist(), lasts.tolist(), self._allocate
                )
        return self._table.take_slots(grow_rows, firsts, lasts, self._allocate)

    def _allocate(self, n: int) -> np.ndarray:
        """``n`` unbound slots (int64). ``max_num_seqs`` bounds the requests of a step, not
        those holding slots: preempted requests keep their open block and lookahead while
        others run, so when the reserve runs short it grows (at least doubles) rather than
        failing the launch."""
        store = self._store
        short = store.num_unbound + n - store.reserve_slots
        if short > 0:
            if self._apply_teardown():
                # Both slot-taking mechanisms call this before changing anything: plan again.
                raise _SlotsFreed
            store.grow_reserve(max(short, store.reserve_slots))
        return store.allocate(n)
