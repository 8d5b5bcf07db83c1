"""Request and block bookkeeping of the worker's data plane (numpy and the store; no locks).

``RequestBook`` applies the scheduler's metadata (rows for new requests; the step's key
work of new block hashes, pins and teardown is recorded for the output thread,
``key_work.py``), launches each step through its ``StepLauncher`` (``step_launcher.py``:
the kernel takes the slots its requests' new blocks need from the free-slot queue), and
commits processed steps (the slots
each request took, recorded key work, checks, cursors, emitted rows, publication,
prefix-cache hits, deferred teardown, the queue's refill).
The worker serializes every call under its lock, in vLLM's call order; store calls are
queued and applied in order by ``process_output`` (``Publisher``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from r3capture.aux_output import envs, step_commit
from r3capture.aux_output.call_checks import checked_batch_arrays
from r3capture.aux_output.device_side import DeviceSide, LaunchedStep
from r3capture.aux_output.errors import require
from r3capture.aux_output.key_work import KeyWorkQueue
from r3capture.aux_output.output_pool import OutputPool
from r3capture.aux_output.publisher import Publisher
from r3capture.aux_output.request_table import RequestTable
from r3capture.aux_output.row_reader import RowReader
from r3capture.aux_output.sizing import (
    WorkerSizing,
    require_int,
    reserve_slots,
    ring_widths,
)
from r3capture.aux_output.step_commit import StepLayout, check_not_overwritten, commit_step
from r3capture.aux_output.step_launcher import StepLauncher
from r3capture.aux_output.steps_in_flight import StepsInFlight
from r3capture.aux_output.types import AuxOutputConnectorMetadata, AuxRequestOutput
from r3capture.store import BlockStore


class RequestBook:
    """The output rank's request table, store and step bookkeeping."""

    def __init__(
        self,
        sizing: WorkerSizing,
        *,
        device: torch.device,
        destination: str,
        output_pool_bytes: int | None,
        wait_for_device_writes: Callable[[], None],
        partial_first_ok: bool = False,
    ) -> None:
        self.sizing = sizing
        # A request's first capture may start inside a hash block (P/D decoders).
        self._partial_first_ok = partial_first_ok
        B = self._block_size = sizing.hash_block_size
        self.destination = destination
        depth = sizing.max_concurrent_batches
        ring_width, device_width = ring_widths(sizing.max_num_batched_tokens, B, depth)
        self.table = RequestTable(ring_width, capacity=sizing.max_num_seqs + 1)
        self.generation = 0
        # Steps launched and not yet settled, oldest first; finished requests whose teardown
        # waits for them.
        self._steps = StepsInFlight(self.table)
        self.launcher = StepLauncher(
            sizing,
            self.table,
            self._steps,
            destination=destination,
            device_width=device_width,
            wait_for_device_writes=wait_for_device_writes,
        )
        self.device_side: DeviceSide | None = None
        self.store = BlockStore(
            max_bytes=sizing.max_bytes,
            object_nbytes=sizing.block_nbytes,
            reserve_slots=reserve_slots(sizing),
            # The kernel writes the arena through unified addressing: it must be pinned.
            pin_memory=destination == "direct" and device.type == "cuda",
            on_grow=self.launcher.store_grows,
        )
        if output_pool_bytes is None:
            output_pool_bytes = envs.output_pool_bytes()
        output_pool_bytes = require_int("output_pool_bytes", output_pool_bytes, minimum=0)
        self._publisher = Publisher(self.store, self.table, B)
        self._key_work = KeyWorkQueue(self.table, self._publisher)
        self._reader = RowReader(
            self.store,
            self.table,
            block_size=B,
            shape_per_token=sizing.shape_per_token,
            dtype=sizing.dtype,
            output_pool=OutputPool(max_bytes=output_pool_bytes),
        )

    def make_device_side(self, capture_buffer: torch.Tensor, kernel_impl: str) -> DeviceSide:
        """The device half, sized from this book; its ``launcher`` launches through it."""
        self.device_side = self.launcher.make_device_side(
            self.store, capture_buffer, kernel_impl, self._key_work.apply_teardown
        )
        return self.device_side

    # ------------------------------------------------------------------ begin_step
    def begin(self, metadata: AuxOutputConnectorMetadata, emit_starts: np.ndarray) -> None:
        """Apply a step's metadata (checked, with its emit starts as int64 ``[R]``).

        What the next launch needs happens now: rows for new requests, the emit-cursor check,
        a prefix-cache reset. The step's key work (new block hashes become store keys, the
        scheduler's pins, the teardown of finished requests with no step in flight, their
        store call) is only recorded, and applied by the next ``commit`` on the output
        thread, or first thing when a later reset needs every key.
        """
        table = self.table
        key_work = self._key_work
        tearing_down = key_work.tearing_down
        if tearing_down and not tearing_down.isdisjoint(metadata.requests):
            key_work.apply_all()  # a finished request's id returns as a new request
        # Pins named by the scheduler belong to the namespace it had before any bump.
        pin_generation = self.generation
        reset_releases = None
        if metadata.generation > self.generation:
            key_work.apply_all()
            reset_releases = table.release_order(table.live_rows().tolist())
            self._publisher.free(table.clear())
            self.generation = metadata.generation
        if metadata.requests:
            rows = self._rows_adding(metadata.requests)
            if self._steps.detach_resumed(metadata.requests, rows):
                rows = self._rows_adding(metadata.requests)  # new rows for resumed requests
            ahead = emit_starts > table.emit[rows]
            if np.count_nonzero(ahead):
                # Only settled requests count: in-flight steps lag the scheduler's view.
                ahead &= ~np.isin(rows, self._steps.rows())
                require(not ahead.any(), "auxiliary output Scheduler emit cursor moved ahead")
        hash_rows = None
        if metadata.block_hashes:
            hash_rows = [table.index[request_id] for request_id in metadata.block_hashes]
        finishing = []
        if metadata.finished_requests:
            finishing = self._steps.finish(metadata.finished_requests)
        key_work.add_step(
            metadata,
            pin_generation=pin_generation,
            hash_rows=hash_rows,
            generation=self.generation,
            finishing=finishing,
            reset_releases=reset_releases,
        )

    @property
    def num_in_flight(self) -> int:
        """Steps launched and not yet settled."""
        return len(self._steps)

    def is_in_flight(self, layout: StepLayout) -> bool:
        """Whether ``layout``'s step was launched and has not settled."""
        return any(step is layout for step in self._steps.layouts)

    @property
    def queued_slots(self) -> int:
        """Unbound store slots that sit in the device's free-slot queue."""
        return self.launcher.queue.num_queued

    def is_tracked(self, request_id: str) -> bool:
        """Whether ``request_id`` has state here (as in vLLM: a finished request whose
        teardown waits for its steps in flight has, one whose teardown is recorded has not)."""
        return request_id in self.table.index and request_id not in self._key_work.tearing_down

    def _rows_adding(self, requests: dict[str, int]) -> np.ndarray:
        """Table rows (int64 ``[R]``) of the scheduled requests; new ones are added with
        their emit start."""
        table = self.table
        ids = list(requests)
        try:
            return table.rows(ids, cache="scheduled")
        except KeyError:
            index = table.index
            new = [request_id for request_id in ids if request_id not in index]
            table.add_many(new, [requests[request_id] for request_id in new])
            return table.rows(ids, cache="scheduled")

    # ------------------------------------------------------------------ prepare_output
    def layout_of(self, input_batch: Any) -> StepLayout:
        """The step's request ids, table rows, scheduler starts and query_start_loc."""
        request_ids, starts, qsl, num_rows = checked_batch_arrays(
            input_batch, self.sizing.max_num_seqs, self.sizing.max_num_batched_tokens
        )
        tearing_down = self._key_work.tearing_down
        if tearing_down and not tearing_down.isdisjoint(request_ids):
            self._key_work.apply_all()  # the batch names a request that is gone: KeyError
        rows = self.table.rows(request_ids, cache="batch", reuse="scheduled")
        if rows is not self._checked_rows:
            if len(set(request_ids)) != len(request_ids):
                raise ValueError(f"input_batch.req_ids names a request twice: {request_ids}")
            self._checked_rows = rows
        return StepLayout(request_ids, rows, starts, qsl, num_rows)

    _checked_rows: np.ndarray | None = None

    # ------------------------------------------------------------------ process_output
    def commit(
        self,
        layout: StepLayout,
        launched: LaunchedStep,
        num_sampled: np.ndarray,
        num_rejected: np.ndarray,
    ) -> dict[str, AuxRequestOutput]:
        """Check the step, return its outputs, publish its blocks, read prefix hits."""
        self._key_work.apply_all()
        if not len(layout.rows):
            self._publisher.flush()
            self.device_side.count_transfer(launched, 0)
            return {}
        step_info, staged_rows = self.device_side.host_results(launched)
        # First, so that the host's account of the queue follows the device's whatever the
        # checks find.
        self._take_new_slots(layout, launched, step_info)
        plan = commit_step(
            layout,
            self.table,
            num_sampled,
            num_rejected,
            step_info,
            self._block_size,
            self._partial_first_ok,
        )
        if staged_rows is not None:
            self._reader.place_staged(layout, step_info, staged_rows)
        elif len(self._steps) > 2:  # depth >= 3: two or more later steps in flight
            check_not_overwritten(layout, plan, self._steps.layouts)
        # Copy emitted rows out before any slot can be bound (and later reused).
        outputs = self._reader.emit(layout, plan)
        # Publish the whole step before materializing: a hit may need a block from it.
        if plan.completing is None:
            self._publisher.publish(layout.rows)
        elif len(plan.completing):
            self._publisher.publish(layout.rows[plan.completing])
        self._publisher.flush()
        for i in plan.materialize.tolist():
            request_id = layout.request_ids[i]
            emit_start, token_end = int(plan.emit_starts[i]), int(plan.token_ends[i])
            rows = self._reader.materialize(request_id, int(layout.rows[i]), emit_start, token_end)
            outputs[request_id] = AuxRequestOutput(emit_start, rows)
        if self.table.num_partial:
            self._drop_partial_blocks(layout.rows)
        self.device_side.count_transfer(launched, plan.rows_written)
        self.launcher.queue.refill()
        return outputs

    def _take_new_slots(
        self, layout: StepLayout, launched: LaunchedStep, step_info: np.ndarray
    ) -> None:
        """Give the step's requests the slots their launch took from the queue (its
        ``step_info[:, 3]``, in batch order): each request's new blocks start at its ring's
        end, or at its first captured block."""
        launched.accounted = True
        taken = step_info[:, 3]
        if len(taken) <= step_commit.PER_REQUEST_MAX:  # the small steps the commit loops over
            self._take_new_slots_per_request(layout, taken.tolist(), step_info)
            return
        slots = self.launcher.queue.commit(int(taken.sum()))
        if not slots.size:
            return
        grew = taken.nonzero()[0]
        rows = layout.rows[grew]
        ends = self.table.end[rows]
        starts = step_info[grew, 0].astype(np.int64)
        firsts = np.where(ends == 0, starts // self._block_size, ends)
        self.table.extend(rows, firsts, taken[grew].astype(np.int64), slots)
        if self._partial_first_ok:
            partial = ((ends == 0) & (starts % self._block_size != 0)).nonzero()[0]
            if partial.size:
                self.table.mark_partial_first(rows[partial], starts[partial])

    # Second form, for the small steps (step_commit.PER_REQUEST_MAX): a loop over the requests
    # that took slots cuts the output thread's total by a sixth at 1-8 decoding requests
    # (host_ab).
    def _take_new_slots_per_request(
        self, layout: StepLayout, taken: list[int], step_info: np.ndarray
    ) -> None:
        slots = self.launcher.queue.commit(sum(taken))
        if not slots.size:
            return
        table, block_size, offset = self.table, self._block_size, 0
        for i, count in enumerate(taken):
            if not count:
                continue
            row, start = layout.rows.item(i), step_info.item(i, 0)
            end = table.end.item(row)
            table.extend_row(row, end or start // block_size, slots[offset : offset + count])
            offset += count
            if not end and self._partial_first_ok and start % block_size:
                table.mark_partial_first(np.array([row]), np.array([start]))

    def _drop_partial_blocks(self, rows: np.ndarray) -> None:
        """P/D decoders: a partial first block whose rows were all returned leaves the ring
        (its slot back to the reserve), and the blocks it held back are published."""
        dropped, slots = self.table.drop_partial_first(rows, self._block_size)
        if dropped.size:
            self._publisher.free(slots)
            self._publisher.publish(dropped)
            self._publisher.flush()

    def settle(self, layout: StepLayout, launched: LaunchedStep, *, teardown: bool) -> None:
        """The step is no longer in flight; with ``teardown``, requests that finished while
        it was tear down now (their keys released, their slots freed). A step that failed
        before its commit read its results still hands its requests the slots it took, so
        the host's account of the queue keeps following the device's."""
        if launched.num_reqs and not launched.accounted:
            step_info = self.device_side.results_after_failure(launched)
            self._take_new_slots(layout, launched, step_info)
        request_ids, rows = self._steps.settle(layout, teardown=teardown)
        if request_ids:
            self._publisher.publish(finished=request_ids, finished_rows=rows)
            self._publisher.flush()

    def close(self) -> None:
        self.store.close()
