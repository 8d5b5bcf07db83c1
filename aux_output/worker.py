"""r3capture's worker connector: vLLM 0.33.0's worker protocol on a block-aligned data path.

Per step (same call order and threads as vLLM's ``AuxOutputWorkerConnector``):

1. ``begin_step(metadata)`` (main thread): the metadata is checked, new requests get table
   rows; the step's key work (new block hashes, the scheduler's pins, the teardown of
   finished requests with no step in flight, their store call) is recorded for the output
   thread (``RequestBook.begin``, ``key_work.py``).
2. ``prepare_output(input_batch)`` (main thread): the batch's host arrays and device inputs
   are checked and one kernel launch writes every accepted row into its slot, taking the
   slots of new blocks itself from the free-slot queue (``StepLauncher.layout_of`` and
   ``launch``, ``DeviceSide.launch``); no per-request work and no upload.
3. ``PendingStep.enqueue_cpu_copy`` (copy stream): the host counts are recorded and the
   kernel's per-request results (and, in the staging destination, the step's rows) are
   copied back; nothing else, as it runs on the main thread too.
4. ``PendingStep.process_output()`` (output thread, after the step's event): the host counts
   are checked, the recorded key work is applied, the commit checks the step as vLLM does
   and moves the cursors, emitted rows are copied out with one gather, complete keyed
   blocks are bound (no payload copy), prefix-cache hits are read back from the store, the
   transfer is counted, and deferred teardown happens (``RequestBook.commit``).

Outputs (``AuxRequestOutput`` per request per step) and protocol errors are those of vLLM
0.33.0's connector; ``tests/aux_output/test_differential.py`` checks this on generated traces.
Every rank builds the whole object; only the first TP rank has a data plane
(``has_data_plane``), the others capture and return None from ``prepare_output``.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from r3capture.aux_output import envs
from r3capture.aux_output.call_checks import check_host_counts, checked_emit_starts
from r3capture.aux_output.device_side import (
    TORCH_DTYPES,
    DeviceSide,
    LaunchedStep,
    pick_destination,
)
from r3capture.aux_output.errors import require
from r3capture.aux_output.request_book import RequestBook
from r3capture.aux_output.sizing import WorkerSizing
from r3capture.aux_output.step_commit import StepLayout
from r3capture.aux_output.types import AuxOutputConnectorMetadata, AuxRequestOutput


class PendingStep:
    """One step's rows in flight between ``prepare_output`` and ``process_output``."""

    def __init__(
        self, worker: TritonAuxOutputWorker, layout: StepLayout, launched: LaunchedStep
    ) -> None:
        self.layout = layout
        self.launched = launched
        self.num_sampled: Any = None
        self.num_rejected: Any = None
        self.enqueued = False
        self._worker = worker

    def enqueue_cpu_copy(self, num_sampled: np.ndarray, num_rejected: np.ndarray) -> None:
        """Record the host counts and start this step's device-to-host copies.

        Call on the output copy stream; the arrays become valid once its event completes,
        and ``process_output``, the first to read them, checks them (on the output thread).
        """
        self.num_sampled = num_sampled
        self.num_rejected = num_rejected
        self.enqueued = True
        self._worker.device_side.copy_back(self.launched)

    def process_output(self) -> dict[str, AuxRequestOutput]:
        return self._worker.process_output(self)


class TritonAuxOutputWorker:
    """Worker connector for routed-experts capture on r3capture's data path.

    Args:
        sizing: shapes and scheduler limits (``WorkerSizing``).
        device: where the capture buffer lives.
        capture_buffer: the router hooks' int32 buffer ``[max_num_batched_tokens, L, K]``,
            contiguous, on ``device``; allocated (zeros) when not given.
        is_output_rank: only the first TP rank owns the data plane.
        destination: ``direct`` | ``staging`` | ``auto``/None (env R3CAPTURE_DESTINATION;
            ``auto`` is ``staging`` at depth >= 3, ``pick_destination``).
        kernel_impl: ``triton`` | ``reference`` | ``auto``/None (env R3CAPTURE_KERNEL_IMPL).
        output_pool_bytes: host bytes kept for recycling large output arrays once their
            consumers drop them; None reads R3CAPTURE_OUTPUT_POOL_BYTES, 0 turns it off.
        partial_first_ok: a request's first capture may start inside a hash block (P/D
            decoders under ``--aux-output-pd splice``, whose prompt KV came from a prefiller
            that trimmed the prompt); that block is never published. vLLM refuses such a
            capture, and so does the worker without it.
    """

    def __init__(
        self,
        sizing: WorkerSizing,
        *,
        device: str | torch.device = "cpu",
        capture_buffer: torch.Tensor | None = None,
        is_output_rank: bool = True,
        destination: str | None = None,
        kernel_impl: str | None = None,
        output_pool_bytes: int | None = None,
        partial_first_ok: bool = False,
    ) -> None:
        if not isinstance(sizing, WorkerSizing):
            raise TypeError(f"sizing must be a WorkerSizing, got {type(sizing).__name__}")
        self.sizing = sizing
        self.device = torch.device(device)
        self.capture_buffer = _checked_capture_buffer(capture_buffer, sizing, self.device)
        kernel_impl = envs.kernel_impl() if kernel_impl is None else kernel_impl
        if kernel_impl not in ("auto", "triton", "reference"):
            raise ValueError(f"kernel_impl must be auto|triton|reference, got {kernel_impl!r}")
        self._lock = threading.Lock()
        self._step_metadata: AuxOutputConnectorMetadata | None = None
        self._num_rejected_next: torch.Tensor | None = None
        self._book: RequestBook | None = None
        self.device_side: DeviceSide | None = None
        # Set by the factory under pipeline parallelism (``pipeline.PipelineRelay``).
        self.pipeline_relay = None
        if is_output_rank:
            self._book = RequestBook(
                sizing,
                device=self.device,
                destination=pick_destination(
                    envs.destination() if destination is None else destination,
                    self.device,
                    sizing.max_concurrent_batches,
                ),
                output_pool_bytes=output_pool_bytes,
                wait_for_device_writes=self._wait_for_device_writes,
                partial_first_ok=partial_first_ok,
            )
            self.device_side = self._book.make_device_side(self.capture_buffer, kernel_impl)

    @property
    def has_data_plane(self) -> bool:
        """True on the output rank (the first TP rank)."""
        return self._book is not None

    @property
    def store(self):
        return None if self._book is None else self._book.store

    @property
    def transfer_stats(self) -> dict[str, int]:
        """Rows and bytes that crossed (on a CPU: would cross) to the host, cumulative."""
        return {} if self.device_side is None else self.device_side.transfer_stats

    def num_active_requests(self) -> int:
        return 0 if self._book is None else len(self._book.table)

    def set_step_num_rejected(self, num_rejected: torch.Tensor | None) -> None:
        """Hand the next ``prepare_output`` the step's device rejected counts ``[R]``."""
        self._num_rejected_next = num_rejected

    # ------------------------------------------------------------------ protocol
    def begin_step(self, metadata: AuxOutputConnectorMetadata | None) -> None:
        """Apply one scheduler step's hash updates, pins and terminal events."""
        book = self._book
        if book is None or metadata is None:
            self._step_metadata = metadata
            return
        with self._lock:
            # Under the lock: the output thread's teardown edits the request table.
            emit_starts = checked_emit_starts(metadata, book.is_tracked, book.generation)
            self._step_metadata = metadata
            if metadata.finished_requests:
                require(
                    not metadata.requests.keys() & set(metadata.finished_requests),
                    "auxiliary output request cannot run and finish in one step",
                )
            generation = metadata.generation
            if generation != book.generation:
                require(
                    generation > book.generation,
                    "auxiliary output metadata generation moved backwards",
                )
                # The scheduler resets the prefix cache only with no model output in flight.
                require(
                    not book.num_in_flight,
                    "auxiliary output generation changed with output in flight",
                )
            book.begin(metadata, emit_starts)

    def prepare_output(
        self, input_batch: Any, num_rejected: torch.Tensor | None = None
    ) -> PendingStep | None:
        """Place this step's accepted rows into store slots with one kernel launch.

        ``input_batch`` provides ``req_ids``, ``query_start_loc_np`` (``[>= R+1]``),
        ``num_computed_tokens_np`` (``[>= R]``) and, on the device, ``query_start_loc``,
        ``positions`` (1-D token positions, ``[>= num_rows]``) and ``idx_mapping`` (each
        request's persistent index, ``[>= R]``, below ``max_num_seqs``), as Model Runner V2's
        ``InputBatch`` does; ``num_rejected`` (device ``[R]``) lets the kernel skip rejected
        rows so they never reach the host. A batch whose ``num_draft_tokens`` is 0 rejects
        nothing, so its counts are left unread: the kernel keeps every scheduled row, as it
        does for any step launched without them.
        """
        if num_rejected is None:
            num_rejected = self._num_rejected_next
        self._num_rejected_next = None
        drafts = getattr(input_batch, "num_draft_tokens", None)
        if type(drafts) is int and drafts == 0:
            num_rejected = None  # one device tensor fewer to check and for the kernel to read
        if self._book is None or self._step_metadata is None:
            return None
        with self._lock:
            launcher = self._book.launcher
            layout = launcher.layout_of(input_batch)
            launched = launcher.launch(layout, input_batch, num_rejected)
        return PendingStep(self, layout, launched)

    def process_output(self, pending: PendingStep) -> dict[str, AuxRequestOutput]:
        """Consume one step after its copy event: outputs per request, blocks published.

        Teardown that ``begin_step`` deferred for requests in this step happens here.
        """
        with self._lock:
            require(
                self._book.is_in_flight(pending.layout),
                "auxiliary output step was already processed",
            )
            committed = False
            try:
                require(pending.enqueued, "auxiliary output CPU copy was not enqueued")
                num_reqs = len(pending.layout.rows)
                check_host_counts("num_sampled", pending.num_sampled, num_reqs)
                check_host_counts("num_rejected", pending.num_rejected, num_reqs)
                outputs = self._book.commit(
                    pending.layout, pending.launched, pending.num_sampled, pending.num_rejected
                )
                committed = True
            finally:
                # As in vLLM: a step that failed still leaves flight; teardown waits.
                self._book.settle(pending.layout, pending.launched, teardown=committed)
            return outputs

    def close(self) -> None:
        with self._lock:
            if self._book is not None:
                self._book.close()

    def _wait_for_device_writes(self) -> None:
        if self.device_side is not None:
            self.device_side.wait_idle()


def _checked_capture_buffer(
    buffer: torch.Tensor | None, sizing: WorkerSizing, device: torch.device
) -> torch.Tensor:
    """The capture buffer, allocated when None; any other value must fit the sizing."""
    L, K = sizing.shape_per_token
    shape = (sizing.max_num_batched_tokens, L, K)
    if buffer is None:
        return torch.zeros(shape, dtype=torch.int32, device=device)
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"capture_buffer must be a torch.Tensor, got {type(buffer).__name__}")
    problems = []
    if buffer.dtype not in (torch.int32, *TORCH_DTYPES.values()):
        problems.append(f"dtype {buffer.dtype} (int32, uint8 or uint16)")
    if buffer.dim() != 3 or tuple(buffer.shape[1:]) != (L, K) or buffer.shape[0] < shape[0]:
        problems.append(f"shape {tuple(buffer.shape)} (at least {list(shape)})")
    if buffer.device != device:
        problems.append(f"device {buffer.device} ({device})")
    if not buffer.is_contiguous():
        problems.append("a non-contiguous layout")
    if problems:
        raise ValueError(f"capture_buffer has {', '.join(problems)}")
    return buffer
