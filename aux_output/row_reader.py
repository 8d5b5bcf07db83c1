"""Reading rows back out of the store arena into arrays the outputs own.

Three readers of the arena:

* ``emit``: each emitting request's new rows (they lie in its unbound blocks, found through
  the slot ring), copied with one gather into one array and handed out as per-request views;
* ``materialize``: a prefix-cache hit's rows from before its capture start: whole stored
  blocks looked up by key (one gather), then the request's open block;
* ``place_staged``: in the device-staging destination, the host copy of a step's rows is
  scattered into the ring's slots before anything reads them.

Outputs never alias the arena: slots are reused once a block is evicted.
"""

from __future__ import annotations

import itertools

import numpy as np

from r3capture.aux_output.errors import AuxOutputProtocolError
from r3capture.aux_output.output_pool import OutputPool
from r3capture.aux_output.request_table import RequestTable
from r3capture.aux_output.sizing import row_nbytes
from r3capture.aux_output.step_commit import CommitPlan, StepLayout
from r3capture.aux_output.types import AuxRequestOutput
from r3capture.store import BlockStore
from r3capture.store.arena import take_rows


class RowReader:
    """Copies rows ``[L, K]`` of ``dtype`` between the store arena and outputs."""

    def __init__(
        self,
        store: BlockStore,
        table: RequestTable,
        *,
        block_size: int,
        shape_per_token: tuple[int, int],
        dtype: np.dtype,
        output_pool: OutputPool,
    ) -> None:
        self._store = store
        self._table = table
        self._block_size = block_size
        self._shape = shape_per_token
        self._dtype = np.dtype(dtype)
        self._row_nbytes = row_nbytes(shape_per_token, dtype)
        self._pool = output_pool
        self._arena: np.ndarray | None = None
        self._arena_view: np.ndarray | None = None

    def emit(self, layout: StepLayout, plan: CommitPlan) -> dict[str, AuxRequestOutput]:
        """Rows ``emit_start .. token_end`` of every ``plan.direct`` request, in one gather."""
        direct = plan.direct
        if direct.size == 0:
            return {}
        index, counts, starts = self._emitted_rows(layout.rows, plan)
        emitted = self._gather(index)
        ids = layout.request_ids
        names = ids if len(direct) == len(ids) else [ids[i] for i in direct.tolist()]
        ends = list(itertools.accumulate(counts))
        views = [emitted[end - count : end] for end, count in zip(ends, counts)]
        return dict(zip(names, map(AuxRequestOutput, starts, views)))

    def _emitted_rows(
        self, rows: np.ndarray, plan: CommitPlan
    ) -> tuple[np.ndarray, list[int], list[int]]:
        """Arena rows (int64) of the ``plan.direct`` requests' emitted rows, their counts and
        emit starts."""
        direct = plan.direct
        rows = rows[direct]
        starts = plan.emit_starts[direct]
        counts = plan.token_ends[direct] - starts
        if np.count_nonzero(counts != 1) == 0:
            # One row per request (decode): the expansion below is the identity.
            row_of, positions = rows, starts
        else:
            first = np.cumsum(counts) - counts
            row_of = np.repeat(rows, counts)
            positions = np.arange(int(counts.sum()), dtype=np.int64)
            positions += np.repeat(starts - first, counts)
        index = self._table.rings.arena_rows(row_of, positions, self._block_size)
        return index, counts.tolist(), starts.tolist()

    def materialize(self, request_id: str, row: int, emit_start: int, token_end: int) -> np.ndarray:
        """Rows ``emit_start .. token_end`` of a request whose capture started later: stored
        blocks, then the open block's rows. A missing stored block raises
        ``BlockObjectStoreError`` (fail closed)."""
        B = self._block_size
        table = self._table
        partial_start = table.rings.partial_start(row)
        if partial_start is not None:
            return self._read_unbound(request_id, row, partial_start, emit_start, token_end)
        stored_end = min(token_end // B, int(table.num_keys[row])) * B
        out = self._pool.empty((token_end - emit_start, *self._shape), self._dtype)
        read_from = emit_start
        if emit_start < stored_end:
            # A live request's keys were retained when its hashes arrived and are released
            # only at its teardown, so every key read here is referenced.
            keys = table.keys_of(row, emit_start // B, stored_end // B)
            slots = self._store.lookup_slots(keys, held=True)
            first = emit_start // B * B
            if emit_start == first:
                # Whole blocks: one gather of block-sized rows straight into the output.
                blocks = out[: stored_end - emit_start].reshape(len(slots), -1).view(np.uint8)
                self._store.gather_into(slots, blocks)
            else:
                positions = np.arange(emit_start - first, stored_end - first, dtype=np.int64)
                arena = self.arena_rows()
                out[: stored_end - emit_start] = arena[slots[positions // B] * B + positions % B]
            read_from = stored_end
        if read_from < token_end or read_from == emit_start:
            # Only the open (incomplete) block is readable outside the store, as in vLLM,
            # whose buffer holds none for a request whose rows end on a block boundary.
            open_start = token_end // B * B
            if token_end == open_start:
                raise AuxOutputProtocolError(
                    f"auxiliary output buffer is missing request {request_id}"
                )
            if read_from < open_start or read_from >= token_end:
                raise AuxOutputProtocolError(
                    "auxiliary output range is unavailable: "
                    f"request={request_id}, range=[{read_from}, {token_end}), "
                    f"available=[{open_start}, {token_end})"
                )
            positions = np.arange(read_from, token_end, dtype=np.int64)
            index = table.rings.arena_rows(np.full(len(positions), row), positions, B)
            out[read_from - emit_start :] = self.arena_rows()[index]
        return out

    def _read_unbound(
        self, request_id: str, row: int, first: int, emit_start: int, token_end: int
    ) -> np.ndarray:
        """Rows ``emit_start .. token_end`` of a request whose partial first block (its
        capture began at ``first``, inside a block) is still held: nothing of it is
        published yet, so every row it captured is in its unbound blocks. Rows before
        ``first`` were never captured here: fail closed."""
        if emit_start < first:
            raise AuxOutputProtocolError(
                f"auxiliary output rows [{emit_start}, {first}) of request {request_id} were "
                "not computed here: its first capture began at the KV it received"
            )
        positions = np.arange(emit_start, token_end, dtype=np.int64)
        index = self._table.rings.arena_rows(
            np.full(len(positions), row), positions, self._block_size
        )
        out = self._pool.empty((len(positions), *self._shape), self._dtype)
        out[...] = self.arena_rows()[index]
        return out

    def place_staged(self, layout: StepLayout, step_info: np.ndarray, staged: np.ndarray) -> None:
        """Scatter the rows the kernel wrote into device staging (now ``staged``, the host
        copy ``[num_rows, L, K]`` in step-row order) into the ring's slots."""
        ok = step_info[:, 2] == 0
        counts = np.where(ok, np.maximum(step_info[:, 1], 0), 0).astype(np.int64)
        total = int(counts.sum())
        if total == 0:
            return
        first = np.cumsum(counts) - counts
        offset = np.arange(total, dtype=np.int64) - np.repeat(first, counts)
        source = np.repeat(layout.query_start_loc[:-1], counts) + offset
        positions = np.repeat(step_info[:, 0].astype(np.int64), counts) + offset
        row_of = np.repeat(layout.rows, counts)
        target = self._table.rings.arena_rows(row_of, positions, self._block_size)
        self.arena_rows()[target] = staged.reshape(-1, *self._shape)[source]

    def arena_rows(self) -> np.ndarray:
        """The arena as ``[slots * B, L, K]`` rows of the output dtype (a view)."""
        arena = self._store.arena_np
        if arena is not self._arena:  # the store grew: a new arena
            self._arena = arena
            self._arena_view = arena.view(self._dtype).reshape(-1, *self._shape)
        return self._arena_view

    def _gather(self, index: np.ndarray) -> np.ndarray:
        """``[n, L, K]`` array of arena rows ``index`` (int64 ``[n]``) in memory it owns."""
        arena = self._store.arena_np
        rows = arena.reshape(-1, self._row_nbytes)
        if len(index) * self._row_nbytes < self._pool.min_nbytes:
            # Second form, kept: numpy's take has the lower fixed cost for a few rows (a
            # seventh of process_output at one request, host_ab); malloc serves mapped memory.
            taken = np.take(rows, index, axis=0)
            return taken.view(self._dtype).reshape(len(index), *self._shape)
        out = self._pool.empty((len(index), *self._shape), self._dtype)
        take_rows(rows, index, out.reshape(len(index), -1).view(np.uint8))
        return out
