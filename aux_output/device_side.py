"""The device half of the worker: the kernel's state, its one launch per step, copies back.

Per step, on the thread that launches the forward (no host synchronization, no allocation,
no upload):

1. one ``gather_alloc`` launch, validated once at construction (``GatherAllocLaunch``),
   reads the batch's own device ``query_start_loc``, ``positions`` and ``idx_mapping``,
   takes the slots its requests' new blocks need from the free-slot queue, and writes every
   accepted row: straight into the pinned store arena (``direct``), or into device staging
   in step-row order (``staging``). Its scalars are the launch serial and the queue's tail;
   only a step with requests new to their index also passes their flags (pinned memory the
   kernel reads, one buffer per step in flight);
2. ``direct``: the kernel also writes its ``step_info`` straight into pinned host memory,
   so nothing is copied back; ``staging``: on the copy stream, ``step_info`` and the step's
   rows are copied back into pinned host buffers. Either way one buffer per step in flight.

The kernel's state lives on the device for the worker's life: per request index a ring of
block-tagged slots and two records, the queue's two heads and the last launch's serial; the
queue itself is in pinned host memory, written by the host (``SlotQueue``). The same
operations run on a CPU device (there the "device" tensors are host tensors), so the data
flow the tests check is the one a GPU runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from r3capture.aux_output.errors import require
from r3capture.aux_output.sizing import row_nbytes
from r3capture.kernels import GatherAllocLaunch, can_write_host_directly
from r3capture.kernels._alloc_checks import (
    HEADS_LEN,
    AllocShape,
    AllocStatic,
    check_alloc_step_args,
)

TORCH_DTYPES = {np.dtype(np.uint8): torch.uint8, np.dtype(np.uint16): torch.uint16}


def pick_destination(requested: str, device: torch.device, depth: int = 1) -> str:
    """``direct`` (the kernel writes the pinned arena) or ``staging`` for ``requested``
    ``auto``/``direct``/``staging`` on ``device`` with ``depth`` steps in flight."""
    if requested not in ("auto", "direct", "staging"):
        raise ValueError(f"destination must be auto|direct|staging, got {requested!r}")
    if requested == "auto" and depth >= 3:
        # With three steps in flight a later launch can be scheduled over rows an earlier
        # step has yet to return; direct writes would have overwritten them in the store,
        # staging keeps each step's rows until its commit (step_commit.check_not_overwritten).
        return "staging"
    if device.type != "cuda":
        # Host and device memory are the same: the kernel writes the arena directly.
        return "staging" if requested == "staging" else "direct"
    direct_ok = can_write_host_directly(device)
    if requested == "direct" and not direct_ok:
        raise ValueError(f"{device} cannot write pinned host memory directly")
    if requested == "auto":
        return "direct" if direct_ok else "staging"
    return requested


@dataclass
class LaunchedStep:
    """What one launch left in flight: its buffer index and whether its results are being
    copied back (``DeviceSide.copy_back``; ``DeviceSide.host_results`` reads them)."""

    ring_index: int
    num_reqs: int
    num_rows: int
    copied: bool = False
    # Whether the host took account of the slots the launch took (``RequestBook``).
    accounted: bool = False


class DeviceSide:
    """The kernel's device state and buffers, and the per-step launch.

    Args:
        capture_buffer: the router hooks' int32 ``[max_num_batched_tokens, L, K]`` buffer.
        dtype: row dtype (uint8/uint16).
        block_size: hash block size ``B``.
        max_num_seqs: most requests per step, and request indices (Model Runner V2's).
        ring_width: ``D``, the device ring's width in blocks.
        queue_size: entries of the free-slot queue.
        depth: steps in flight (``max_concurrent_batches``).
        destination: ``direct`` or ``staging`` (see ``pick_destination``).
        kernel_impl: ``auto`` | ``triton`` | ``reference``.

    ``attach(arena_blocks)`` must be called before the first launch and whenever the store
    arena is replaced.
    """

    def __init__(
        self,
        *,
        capture_buffer: torch.Tensor,
        dtype: np.dtype,
        block_size: int,
        max_num_seqs: int,
        ring_width: int,
        queue_size: int,
        depth: int,
        destination: str,
        kernel_impl: str,
    ) -> None:
        self.capture_buffer = capture_buffer
        self.device = device = capture_buffer.device
        self.dtype = np.dtype(dtype)
        self.block_size = block_size
        self.destination = destination
        self._kernel_impl = kernel_impl
        self._depth = depth
        self._next = 0
        on_cuda = device.type == "cuda"
        if on_cuda and not can_write_host_directly(device):
            raise ValueError(
                f"{device} cannot map pinned host memory (unified addressing): the capture "
                "kernel reads its free-slot queue there"
            )
        self._ring = torch.full((max_num_seqs, ring_width), -1, dtype=torch.int64, device=device)
        self._records = torch.zeros((max_num_seqs, 2), dtype=torch.int64, device=device)
        self._heads = torch.zeros(HEADS_LEN, dtype=torch.int64, device=device)
        self._queue = torch.full((queue_size,), -1, dtype=torch.int32, pin_memory=on_cuda)
        self.queue_np = self._queue.numpy()
        self._fresh = [
            torch.zeros(max_num_seqs, dtype=torch.uint8, pin_memory=on_cuda) for _ in range(depth)
        ]
        self._fresh_np = [t.numpy() for t in self._fresh]
        self._info_host = [
            torch.zeros((max_num_seqs, 4), dtype=torch.int32, pin_memory=on_cuda)
            for _ in range(depth)
        ]
        # Direct writes put step_info where the host reads it, as they do the rows: one copy
        # launch less on the main thread.
        self._info_dev = (
            self._info_host
            if destination == "direct"
            else [
                torch.zeros((max_num_seqs, 4), dtype=torch.int32, device=device)
                for _ in range(depth)
            ]
        )
        self._info_np = [t.numpy() for t in self._info_host]
        self._staging_dev: list[torch.Tensor] = []
        self._staging_host: list[torch.Tensor] = []
        if destination == "staging":
            torch_dtype = TORCH_DTYPES[self.dtype]
            shape = tuple(capture_buffer.shape)
            for _ in range(depth):
                self._staging_dev.append(torch.empty(shape, dtype=torch_dtype, device=device))
                self._staging_host.append(torch.empty(shape, dtype=torch_dtype, pin_memory=on_cuda))
        self._launches: list[GatherAllocLaunch] = []
        # What crossed (or, on a CPU, would cross) from the device to the host, cumulative.
        self.transfer_stats = {"steps": 0, "rows": 0, "bytes": 0}
        self._row_nbytes = row_nbytes(tuple(capture_buffer.shape[1:]), self.dtype)

    def attach(self, arena_blocks: torch.Tensor) -> None:
        """(Re)build the launches for the store arena ``[slots, B, L, K]``: at start, and
        when the store grew (a new arena)."""
        staging = self.destination == "staging"
        self._launches = [
            GatherAllocLaunch(
                self.capture_buffer,
                self._ring,
                self._records,
                self._queue,
                self._heads,
                self._staging_dev[i] if staging else arena_blocks,
                self._info_dev[i],
                hash_block=self.block_size if staging else None,
                num_slots=arena_blocks.shape[0] if staging else None,
                impl=self._kernel_impl,
            )
            for i in range(self._depth)
        ]

    @property
    def device_bytes(self) -> int:
        """Bytes of the buffers this side keeps on the device (beyond vLLM's capture buffer
        and the store's host arena): the ring, the records and heads and, for ``staging``,
        each step's ``step_info`` and staging rows."""
        buffers = [self._ring, self._records, self._heads, *self._staging_dev]
        if self.destination == "staging":
            buffers += self._info_dev
        return sum(t.numel() * t.element_size() for t in buffers)

    def fresh_flags(self) -> np.ndarray:
        """The next launch's per-request flags (uint8 ``[max_num_seqs]``) to fill, for a step
        with requests new to their index; pass ``fresh=True`` to ``launch`` then."""
        return self._fresh_np[self._next]

    @property
    def static(self) -> AllocStatic:
        """The launches' validated step-independent arguments (the same for every one)."""
        return self._launches[self._next].static

    def check_step(
        self,
        query_start_loc: object,
        positions: object,
        request_index: object,
        num_rejected: object,
        *,
        num_reqs: int,
        num_rows: int,
        launch: int,
        queue_tail: int,
    ) -> AllocShape:
        """The kernel's checks of one step's device inputs (``KernelArgumentError`` names
        a bad one), made before anything changes; ``launch`` then repeats none of them."""
        return check_alloc_step_args(
            self.static, query_start_loc=query_start_loc,
            positions=positions, request_index=request_index, num_rejected=num_rejected,
            fresh=None, num_reqs=num_reqs, num_rows=num_rows, launch=launch,
            queue_tail=queue_tail,
        )  # fmt: skip

    def launch(
        self,
        shape: AllocShape | None,
        query_start_loc: torch.Tensor | None,
        positions: torch.Tensor | None,
        request_index: torch.Tensor | None,
        num_rejected: torch.Tensor | None,
        *,
        fresh: bool,
        num_rows: int,
    ) -> LaunchedStep:
        """Launch the kernel for one step whose inputs ``check_step`` returned ``shape`` for
        (None: a step without requests, which launches nothing); ``fresh``: the flags of
        ``fresh_flags()`` apply."""
        index = self._next
        self._next = (index + 1) % self._depth
        num_reqs = 0 if shape is None else shape.num_reqs
        if num_reqs:
            # Whole, not cut to the step: the kernel reads the first num_reqs flags, and a
            # slice would cost a tensor view on the steps that add requests.
            flags = self._fresh[index] if fresh else None
            self._launches[index].launch_checked(
                shape, query_start_loc, positions, request_index, num_rejected, flags
            )
        return LaunchedStep(index, num_reqs, num_rows)

    def copy_back(self, step: LaunchedStep) -> None:
        """Start the copies of ``step``'s results into pinned host memory (copy stream, on
        the main thread in Model Runner V2: only the copies happen here); ``direct``
        needs none, its kernel wrote them there."""
        if step.num_reqs == 0:
            return
        index = step.ring_index
        if self.destination == "staging":
            self._info_host[index].copy_(self._info_dev[index], non_blocking=True)
            if step.num_rows:
                rows = step.num_rows
                self._staging_host[index][:rows].copy_(
                    self._staging_dev[index][:rows], non_blocking=True
                )
        step.copied = True

    def host_results(self, step: LaunchedStep) -> tuple[np.ndarray, np.ndarray | None]:
        """Host views of what ``copy_back`` copied for a step with requests, valid once its
        event completes (output thread): ``step_info`` int32 ``[R, 4]`` and, for
        ``staging``, the step's rows ``[num_rows, L, K]`` (else None)."""
        # Never stale buffers in place of a copy: the commit checks the kernel's results.
        require(step.copied, "auxiliary output CPU copy was not enqueued")
        index = step.ring_index
        staged = None
        if self.destination == "staging" and step.num_rows:
            staged = self._staging_host[index][: step.num_rows].numpy()
        return self._info_np[index][: step.num_reqs], staged

    def results_after_failure(self, step: LaunchedStep) -> np.ndarray:
        """``step_info`` of a step that leaves flight without a commit (its copy may never
        have started): waits for the device, then reads it (copying it first for
        ``staging``). A failed step only; the main path never waits."""
        self.wait_idle()
        index = step.ring_index
        if self.destination == "staging":
            self._info_host[index].copy_(self._info_dev[index])
        return self._info_np[index][: step.num_reqs]

    def wait_idle(self) -> None:
        """Wait for device work that may still write the arena (before it is replaced)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def count_transfer(self, step: LaunchedStep, rows_written: int) -> None:
        """Add a processed step's copies back to ``transfer_stats``; ``rows_written``: the
        rows its kernel wrote (the sum of its checked ``step_info``)."""
        stats = self.transfer_stats
        stats["steps"] += 1
        # The staging copy moves every scheduled row; direct writes move exactly the rows
        # the kernel wrote.
        staged = step.copied and self.destination == "staging"
        rows = step.num_rows if staged else rows_written
        stats["rows"] += rows
        stats["bytes"] += rows * self._row_nbytes
