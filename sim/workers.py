"""Worker connectors for the simulator, built without a model or a GPU.

``make_vllm_worker`` builds vLLM 0.33.0's own ``AuxOutputWorkerConnector`` the way its
``__init__`` would on the output rank, except that the router capturer is a stand-in whose
``device_buffer`` is a CPU int32 tensor and whose ``snapshot_routing_data(n)`` casts
``buffer[:n]`` to the output dtype (what vLLM's capturer does on the GPU).
``make_r3capture_worker`` builds ``r3capture.aux_output.worker.TritonAuxOutputWorker``.

Both come wrapped in a ``WorkerHandle``: the simulator writes each step's rows into
``handle.capture_buffer`` and calls ``begin_step`` / ``prepare_output`` / ``close``; the
pending objects it gets back are the workers' own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from r3capture.aux_output.sizing import WorkerSizing


class WorkerHandle:
    """A worker connector plus its capture buffer (int32 ``[T, L, K]``).

    ``prepare_output(batch, num_rejected)``: ``num_rejected`` (numpy int32 ``[R]``) is what
    rejection sampling produced on the device; it is handed to workers that take it.
    """

    def __init__(
        self,
        name: str,
        worker: Any,
        capture_buffer: torch.Tensor,
        prepare: Callable[[Any, np.ndarray], Any],
        active: Callable[[], int],
    ) -> None:
        self.name = name
        self.worker = worker
        self.capture_buffer = capture_buffer
        self._prepare = prepare
        self._active = active

    def begin_step(self, metadata: Any) -> None:
        self.worker.begin_step(metadata)

    def prepare_output(self, input_batch: Any, num_rejected: np.ndarray) -> Any:
        return self._prepare(input_batch, num_rejected)

    def num_active_requests(self) -> int:
        """Requests the worker still holds state for (0 after a clean drain)."""
        return self._active()

    def close(self) -> None:
        self.worker.close()


class _FakeCapturer:
    """Stands in for vLLM's RoutedExpertsCapturer on the CPU."""

    def __init__(self, sizes: WorkerSizing) -> None:
        self.shape_per_token = sizes.shape_per_token
        self.output_dtype_name = sizes.dtype.name
        self.output_dtype = getattr(torch, sizes.dtype.name)
        self.device_buffer = torch.zeros(
            (sizes.max_num_batched_tokens, *sizes.shape_per_token), dtype=torch.int32
        )

    def snapshot_routing_data(self, num_tokens: int) -> torch.Tensor:
        return self.device_buffer[:num_tokens].to(self.output_dtype)


def make_vllm_worker(sizes: WorkerSizing, *, is_output_rank: bool = True) -> WorkerHandle:
    """vLLM 0.33.0's AuxOutputWorkerConnector without a model: on the output rank (the
    first TP rank) with its store and staging buffer, else capture-only (no data plane)."""
    from threading import Lock

    from vllm.distributed.aux_output_connector.routed_experts import RoutedExpertsBuffer
    from vllm.distributed.aux_output_connector.store import (
        BackgroundBlockObjectStore,
        BlockObjectStore,
    )
    from vllm.distributed.aux_output_connector.worker import AuxOutputWorkerConnector

    capturer = _FakeCapturer(sizes)
    worker = object.__new__(AuxOutputWorkerConnector)
    worker._capturer = capturer
    worker._requests = {}
    worker._generation = 0
    worker._step_metadata = None
    worker._pending_outputs = []
    worker._lock = Lock()
    worker._max_concurrent_batches = sizes.max_concurrent_batches
    worker._store = None
    worker._buffer = None
    if is_output_rank:
        worker._store = BackgroundBlockObjectStore(
            BlockObjectStore(max_bytes=sizes.max_bytes, object_nbytes=sizes.block_nbytes),
            max_pending_batches=2 * sizes.max_num_seqs,
        )
        worker._buffer = RoutedExpertsBuffer(
            sizes.dtype,
            sizes.shape_per_token,
            sizes.hash_block_size,
            sizes.max_num_seqs,
            sizes.max_num_batched_tokens,
            sizes.max_concurrent_batches,
        )
    return WorkerHandle(
        "vllm",
        worker,
        capturer.device_buffer,
        lambda batch, _num_rejected: worker.prepare_output(batch),
        lambda: len(worker._requests),
    )


def make_r3capture_worker(
    sizes: WorkerSizing,
    *,
    kernel_impl: str = "reference",
    device: str = "cpu",
    destination: str | None = None,
    pass_num_rejected: bool = True,
    is_output_rank: bool = True,
    partial_first_ok: bool = False,
) -> WorkerHandle:
    """r3capture's TritonAuxOutputWorker. With ``pass_num_rejected`` the step's rejected
    counts reach ``prepare_output`` as a device tensor (the GPU handoff); without it the
    worker must drop rejected rows from the numpy counts of ``enqueue_cpu_copy``.
    ``partial_first_ok``: the worker under ``--aux-output-pd splice`` (a first capture may
    start inside a hash block)."""
    from r3capture.aux_output.worker import TritonAuxOutputWorker

    worker = TritonAuxOutputWorker(
        sizes,
        device=device,
        destination=destination,
        kernel_impl=kernel_impl,
        is_output_rank=is_output_rank,
        partial_first_ok=partial_first_ok,
    )
    buffer = worker.capture_buffer

    def prepare(batch: Any, num_rejected: np.ndarray) -> Any:
        if buffer.device.type != "cpu":
            batch.query_start_loc = batch.query_start_loc.to(buffer.device)
            batch.positions = batch.positions.to(buffer.device)
            batch.idx_mapping = batch.idx_mapping.to(buffer.device)
        if not pass_num_rejected:
            return worker.prepare_output(batch)
        rejected = torch.from_numpy(np.ascontiguousarray(num_rejected, np.int32)).to(buffer.device)
        return worker.prepare_output(batch, num_rejected=rejected)

    def active() -> int:
        for name in ("num_active_requests", "_requests"):
            value = getattr(worker, name, None)
            if callable(value):
                return int(value())
            if value is not None:
                return len(value)
        return -1

    suffix = "" if kernel_impl == "reference" else f"[{kernel_impl}]"
    return WorkerHandle(f"r3capture{suffix}", worker, buffer, prepare, active)


def r3capture_worker_factory(**options: Any) -> Callable[[WorkerSizing], WorkerHandle]:
    """``make_r3capture_worker`` with fixed options, for ``run_trace(worker_factory=...)``."""
    return lambda sizes: make_r3capture_worker(sizes, **options)


__all__ = [
    "WorkerHandle",
    "WorkerSizing",
    "make_r3capture_worker",
    "make_vllm_worker",
    "r3capture_worker_factory",
]
