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

import numpy as np
import torch

from r3capture.aux_output import envs, small_step
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
from r3capture.aux_output.step_commit import (
    StepLayout,
    check_not_overwritten,
    commit_step,
    give_new_slots,
)
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
            self.store, capture_buffer, kernel_impl, self._key_work
        )
        return self.device_side

    # ------------------------------------------------------------------ begin_step
    def begin(
        self, metadata: AuxOutputConnectorMetadata, emit_starts: list[int] | np.ndarray
    ) -> None:
        """Apply a step's metadata (checked, with its emit starts: ``checked_emit_starts``).

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
        requests = metadata.requests
        if requests:
            ids = list(requests)
            rows = table.cached_rows(ids, "scheduled")
            if rows is None:  # other requests than last step's: maybe new ones
                rows = self._rows_adding(requests, ids)
            steps = self._steps
            if steps.has_deferred and steps.detach_resumed(requests, rows):
                rows = self._rows_adding(requests, ids)  # new rows for resumed requests
            # Only settled requests are checked: in-flight steps lag the scheduler's view.
            # The scheduler's requests are those of the last launch (the same rows, so the
            # same cached array) while it is in flight: every one of them is.
            if not (steps.layouts and rows is steps.layouts[-1].rows):
                if type(emit_starts) is list:
                    emit = table.emit
                    ahead = [
                        row
                        for start, row in zip(emit_starts, rows.tolist())
                        if start > emit.item(row)
                    ]
                else:
                    ahead = rows[emit_starts > table.emit[rows]]
                if len(ahead):
                    require(
                        steps.covers(np.asarray(ahead, np.int64)).all(),
                        "auxiliary output Scheduler emit cursor moved ahead",
                    )
        block_hashes = metadata.block_hashes
        finished = metadata.finished_requests
        if (
            reset_releases is None
            and not block_hashes
            and not finished
            and metadata.retained_block_hashes is None
            and metadata.released_block_hashes is None
        ):
            return  # no key work: most decode steps
        hash_rows = [table.index[request_id] for request_id in block_hashes] or None
        finishing = self._steps.finish(finished) if finished else []
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
        # StepLayout has no __eq__: membership is identity, as in StepsInFlight.settle.
        return layout in self._steps.layouts

    @property
    def queued_slots(self) -> int:
        """Unbound store slots that sit in the device's free-slot queue."""
        return self.launcher.queue.num_queued

    def is_tracked(self, request_id: str) -> bool:
        """Whether ``request_id`` has state here (as in vLLM: a finished request whose
        teardown waits for its steps in flight has, one whose teardown is recorded has not)."""
        return request_id in self.table.index and request_id not in self._key_work.tearing_down

    def _rows_adding(self, requests: dict[str, int], ids: list[str]) -> np.ndarray:
        """Table rows (int64 ``[R]``) of the scheduled requests (``ids``: their ids, in
        order); new ones are added with their emit start."""
        table = self.table
        index = table.index
        new = [request_id for request_id in ids if request_id not in index]
        if new:
            table.add_many(new, [requests[request_id] for request_id in new])
        return table.rows(ids, cache="scheduled")

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
        launched.accounted = True
        if (
            len(layout.rows) <= small_step.PER_REQUEST_MAX
            and staged_rows is None
            and len(self._steps) <= 2
        ):
            small = small_step.commit_small_step(
                layout,
                self.table,
                step_info,
                num_sampled,
                num_rejected,
                block_size=self._block_size,
                partial_first_ok=self._partial_first_ok,
                take_slots=self.launcher.queue.commit,
                arena_rows=self._reader.arena_rows(),
            )
            if small is not None:
                return self._finish_commit(
                    layout,
                    launched,
                    small.outputs,
                    small.completing,
                    small.materialize,
                    small.rows_written,
                )
        # Whatever the checks find, so that the host's account of the queue follows the
        # device's; after them, so that a request the kernel failed gets no slot.
        plan = None
        try:
            plan = commit_step(
                layout,
                self.table,
                num_sampled,
                num_rejected,
                step_info,
                self._block_size,
                self._partial_first_ok,
            )
        finally:
            self._take_new_slots(layout, step_info, placed_only=plan is None)
        if staged_rows is not None:
            self._reader.place_staged(layout, step_info, staged_rows)
        elif len(self._steps) > 2:  # depth >= 3: two or more later steps in flight
            check_not_overwritten(layout, plan, self._steps.layouts)
        # Copy emitted rows out before any slot can be bound (and later reused).
        outputs = self._reader.emit(layout, plan)
        materialize = [
            (i, int(plan.emit_starts[i]), int(plan.token_ends[i]))
            for i in plan.materialize.tolist()
        ]
        return self._finish_commit(layout, launched, outputs, None, materialize, plan.rows_written)

    def _finish_commit(
        self,
        layout: StepLayout,
        launched: LaunchedStep,
        outputs: dict[str, AuxRequestOutput],
        completing: list[int] | None,
        materialize: list[tuple[int, int, int]],
        rows_written: int,
    ) -> dict[str, AuxRequestOutput]:
        """The rest of a commit once the emitted rows are out: publish the step's complete
        keyed blocks (of the table rows ``completing``; None: any of the step's), read its
        prefix hits (``(index in the step, emit start, token end)``) from the store, count
        the transfer and refill the free-slot queue."""
        # Publish the whole step before materializing: a hit may need a block from it.
        publisher = self._publisher
        if completing is None:
            publisher.publish(layout.rows)
        elif completing:
            publisher.publish(completing)
        publisher.flush()
        for i, emit_start, token_end in materialize:
            request_id = layout.request_ids[i]
            rows = self._reader.materialize(request_id, layout.rows.item(i), emit_start, token_end)
            outputs[request_id] = AuxRequestOutput(emit_start, rows)
        if self.table.rings.num_partial:
            self._drop_partial_blocks(layout.rows)
        self.device_side.count_transfer(launched, rows_written)
        self.launcher.queue.refill()
        return outputs

    def _take_new_slots(
        self, layout: StepLayout, step_info: np.ndarray, placed_only: bool = False
    ) -> None:
        """The queue's slots the step's launch took go to its requests (``give_new_slots``);
        with ``placed_only`` (a step that failed), those of requests the kernel failed go
        back to the store."""
        slots = self.launcher.queue.commit(int(step_info[:, 3].sum()))
        if slots.size:
            unplaced = give_new_slots(
                self.table, layout.rows, step_info, slots, self._block_size,
                placed_only=placed_only, partial_first_ok=self._partial_first_ok,
            )  # fmt: skip
            if unplaced.size:
                self._publisher.free(unplaced)

    def _drop_partial_blocks(self, rows: np.ndarray) -> None:
        """P/D decoders: a partial first block whose rows were all returned leaves the ring
        (its slot back to the reserve), and the blocks it held back are published."""
        table = self.table
        done_to = np.minimum(table.cursor[rows], table.emit[rows])
        dropped, slots = table.rings.drop_partial_first(rows, done_to, self._block_size)
        if dropped.size:
            self._publisher.free(slots)
            self._publisher.publish(dropped)
            self._publisher.flush()

    def settle(self, layout: StepLayout, launched: LaunchedStep, *, teardown: bool) -> None:
        """The step is no longer in flight; with ``teardown``, requests that finished while
        it was tear down now (their keys released, their slots freed). A step that failed
        before its commit read its results still hands the requests its kernel placed the
        slots they took, and the store those of the requests it failed, so the host's
        account of the queue and of each request's ring keeps following the device's."""
        if launched.num_reqs and not launched.accounted:
            launched.accounted = True
            step_info = self.device_side.results_after_failure(launched)
            self._take_new_slots(layout, step_info, placed_only=True)
        request_ids, rows = self._steps.settle(layout, teardown=teardown)
        if request_ids:
            self._publisher.publish(finished=request_ids, finished_rows=rows)
            self._publisher.flush()

    def close(self) -> None:
        self.store.close()
