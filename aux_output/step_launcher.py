"""The main thread's half of the data plane: the device side, the free-slot queue and the launch.

``StepLauncher`` builds the ``DeviceSide`` (device buffers, the kernel's launcher) and the
host side of the free-slot queue (``slot_queue.py``), keeps the kernel's destination on the
store's current arena, and launches each step: the batch's layout (its host arrays checked,
its requests' table rows), the checks of its device inputs, the queue's reservation (one
integer comparison unless it must refill), the flags of requests new to their index, and
one kernel launch. No per-request work and no upload (``docs/device_slots.md``).
``RequestBook`` owns it and reads the kernel's results through its ``device_side`` and
``queue`` on the output thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from r3capture.aux_output.call_checks import checked_batch_arrays, input_batch_error
from r3capture.aux_output.device_side import TORCH_DTYPES, DeviceSide, LaunchedStep
from r3capture.aux_output.errors import AuxOutputProtocolError
from r3capture.aux_output.key_work import KeyWorkQueue
from r3capture.aux_output.request_table import RequestTable
from r3capture.aux_output.sizing import WorkerSizing, queue_size, queue_stock
from r3capture.aux_output.slot_queue import SlotQueue
from r3capture.aux_output.step_commit import StepLayout
from r3capture.aux_output.steps_in_flight import StepsInFlight
from r3capture.kernels import KernelArgumentError
from r3capture.kernels._alloc_checks import (
    LAUNCH_LIMIT,
    check_alloc_step_args,
    new_alloc_shape,
    step_tensors_pass,
)
from r3capture.store import BlockStore


class StepLauncher:
    """Launches steps of ``table``'s requests into ``store``'s arena, recording each launched
    step in ``steps``.

    Args:
        device_width: the device ring's width in hash blocks (``sizing.ring_widths``).
        wait_for_device_writes: blocks until kernels writing the arena have finished.
    """

    def __init__(
        self,
        sizing: WorkerSizing,
        table: RequestTable,
        steps: StepsInFlight,
        *,
        destination: str,
        device_width: int,
        wait_for_device_writes: Callable[[], None],
    ) -> None:
        self._sizing = sizing
        self._depth = sizing.max_concurrent_batches
        self._block_size = sizing.hash_block_size
        self._table = table
        self._steps = steps
        self._destination = destination
        self._device_width = device_width
        self._wait_for_device_writes = wait_for_device_writes
        self._store: BlockStore | None = None
        self.device_side: DeviceSide | None = None
        self.queue: SlotQueue | None = None
        # Launches so far: the kernel's serial for the next is one more.
        self._launches = 0
        self._key_work: KeyWorkQueue | None = None
        # The rows of the last batch checked for repeated ids (the same array while the
        # batch's requests stay the same).
        self._checked_rows = None
        # Set when the store arena is replaced: the device side must attach again before
        # the next launch.
        self._detached = True

    def make_device_side(
        self,
        store: BlockStore,
        capture_buffer: torch.Tensor,
        kernel_impl: str,
        key_work: KeyWorkQueue,
    ) -> DeviceSide:
        """Build the device side and the queue's host side over ``store``; ``key_work``'s
        recorded teardown frees slots of finished requests when a refill runs short, and
        applies before a batch that names a request it tears down."""
        sizing = self._sizing
        self._store = store
        self._key_work = key_work
        self.device_side = DeviceSide(
            capture_buffer=capture_buffer,
            dtype=sizing.dtype,
            block_size=self._block_size,
            max_num_seqs=sizing.max_num_seqs,
            ring_width=self._device_width,
            queue_size=queue_size(sizing),
            depth=sizing.max_concurrent_batches,
            destination=self._destination,
            kernel_impl=kernel_impl,
        )
        self.queue = SlotQueue(
            self.device_side.queue_np, store, queue_stock(sizing), key_work.apply_teardown
        )
        self.queue.refill()
        # Attached now rather than at the first launch: building the launches is one-time
        # work that would otherwise land on the first step's main thread.
        self._attach()
        return self.device_side

    def store_grows(self) -> None:
        """The store is about to replace its arena: kernels writing the old one must finish,
        and the next launch attaches to the new one."""
        self._detached = True
        self._wait_for_device_writes()

    def layout_of(self, input_batch: Any) -> StepLayout:
        """The step's request ids, table rows, scheduler starts and query_start_loc, from
        ``input_batch``'s host arrays (checked: ``checked_batch_arrays``)."""
        sizing = self._sizing
        request_ids, starts, qsl, num_rows = checked_batch_arrays(
            input_batch, sizing.max_num_seqs, sizing.max_num_batched_tokens
        )
        tearing_down = self._key_work.tearing_down
        if tearing_down and not tearing_down.isdisjoint(request_ids):
            self._key_work.apply_all()  # the batch names a request that is gone: KeyError
        rows = self._table.rows(request_ids, cache="batch", reuse="scheduled")
        if rows is not self._checked_rows:
            if len(set(request_ids)) != len(request_ids):
                raise ValueError(f"input_batch.req_ids names a request twice: {request_ids}")
            self._checked_rows = rows
        return StepLayout(request_ids, rows, starts, qsl, num_rows)

    def launch(
        self, layout: StepLayout, input_batch: Any, num_rejected: torch.Tensor | None
    ) -> LaunchedStep:
        """Check that a step may launch (fewer than ``max_concurrent_batches`` in flight) and
        the batch's device inputs (``query_start_loc`` ``[>= R+1]``, ``positions``
        ``[>= num_rows]``, ``idx_mapping`` ``[>= R]``, 1-D, on the device), then launch the
        kernel. A refused step or input changes nothing."""
        layouts = self._steps.layouts
        if len(layouts) >= self._depth:
            raise AuxOutputProtocolError("auxiliary output step outputs are not consumed in order")
        num_rows = layout.num_rows
        num_reqs = len(layout.rows)
        side = self.device_side
        if not num_reqs:
            launched = side.launch(None, None, None, None, None, fresh=False, num_rows=num_rows)
            layouts.append(layout)
            return launched
        query_start_loc = getattr(input_batch, "query_start_loc", None)
        positions = getattr(input_batch, "positions", None)
        request_index = getattr(input_batch, "idx_mapping", None)
        queue = self.queue
        launch = self._launches + 1
        # The counts are ints checked_batch_arrays kept within the sizing, which the static
        # bounds cover (_attach): the tensors are left to check. A launch failing that is
        # judged in full, which names the fault.
        if launch >= LAUNCH_LIMIT or not step_tensors_pass(
            self._static.device_index,
            query_start_loc,
            positions,
            request_index,
            num_rejected,
            num_reqs,
            num_rows,
        ):
            try:
                check_alloc_step_args(
                    self._static,
                    query_start_loc=query_start_loc,
                    positions=positions,
                    request_index=request_index,
                    num_rejected=num_rejected,
                    fresh=None,
                    num_reqs=num_reqs,
                    num_rows=num_rows,
                    launch=launch,
                    queue_tail=queue.tail,
                )
            except KernelArgumentError as exc:
                raise input_batch_error(exc) from None
        # Most blocks the launch can open: each request's rows and a partial first block.
        tail = queue.reserve(num_rows // self._block_size + num_reqs)
        if self._detached:
            self._attach()  # refilling grew the store: a new arena
        shape = new_alloc_shape((num_reqs, num_rows, launch, tail))
        table = self._table
        fresh = bool(table.unlaunched) and table.take_fresh(layout.rows, side.fresh_flags())
        launched = side.launch(
            shape,
            query_start_loc,
            positions,
            request_index,
            num_rejected,
            fresh=fresh,
            num_rows=num_rows,
        )
        self._launches = launch
        layouts.append(layout)
        return launched

    def _attach(self) -> None:
        """Make the kernel's destination the store's current arena."""
        self.device_side.attach(self._arena_blocks())
        static = self.device_side.static
        sizing = self._sizing
        # What lets launch() skip checking its counts: the batch's (checked_batch_arrays)
        # never pass the sizing's limits, which these bounds must cover.
        most_rows = sizing.max_num_batched_tokens
        if (
            static.max_requests < sizing.max_num_seqs
            or static.capture_rows < most_rows
            or (static.rows_layout and static.dest_rows < most_rows)
        ):
            raise ValueError(
                f"the capture kernel's buffers ({static.max_requests} requests, "
                f"{static.capture_rows} capture rows, {static.dest_rows} destination rows) "
                f"must cover max_num_seqs ({sizing.max_num_seqs}) and "
                f"max_num_batched_tokens ({most_rows})"
            )
        self._static = static
        self._detached = False

    def _arena_blocks(self) -> torch.Tensor:
        """The store arena as ``[slots, B, L, K]`` of the row dtype (a view, no copy)."""
        rows = self._store.arena.view(TORCH_DTYPES[self._sizing.dtype])
        return rows.view(rows.shape[0], self._block_size, *self._sizing.shape_per_token)
