"""Record the worker-connector calls of a simulator run, to replay them without the simulator.

``record_trace`` runs a trace through the simulator with a worker handle wrapped in a
``RecordingHandle``, which logs every call the engine makes, in the engine's order:

* ``begin_step(metadata)``: the metadata in plain form (``plain_metadata``);
* the rows the engine wrote into the capture buffer for the step (int32 ``[T, L, K]``,
  kept in the model's id dtype, which holds them exactly);
* ``prepare_output(input_batch, num_rejected)``: ``req_ids``, ``query_start_loc_np``,
  ``num_computed_tokens_np``, the request indices (``idx_mapping_np``, which the device
  ``idx_mapping`` holds too), the device ``positions`` and the step's rejected counts;
* ``enqueue_cpu_copy(num_sampled, num_rejected)``: the arrays' final contents (the engine
  fills them in only before ``process_output``, as vLLM's asynchronous copies do);
* ``process_output()`` of which step.

A ``Recording`` is independent of the worker that was recorded: any worker connector can be
driven through the same calls (``bench/host_step_replay.py``), and must produce the same
``digests`` (one per processed step: every request's token_start, dtype, shape and bytes)
and the same error (``error``: step, call, exception type), if any.

``save``/``load`` keep a recording in a directory: ``events.pkl`` (calls, digests, sizing)
and ``rows.bin`` (every step's rows, concatenated, read back memory-mapped).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from sim.engine import r3capture_scheduler, replay_scheduler, run_trace, vllm_scheduler
from sim.trace import Trace
from sim.workers import WorkerHandle, WorkerSizing, make_vllm_worker

BEGIN = "begin_step"
PREPARE = "prepare_output"
ENQUEUE = "enqueue_cpu_copy"
PROCESS = "process_output"

# A metadata object with its hashes as (bytes, item size) pairs; see ``plain_metadata``.
PlainMetadata = tuple


def _packed(hashes: Any) -> tuple[bytes, int] | None:
    return None if hashes is None else (bytes(hashes.data), int(hashes.item_size))


def plain_metadata(meta: Any) -> PlainMetadata | None:
    """``AuxOutputConnectorMetadata`` (any implementation) as plain, picklable values:
    ``(generation, ((req_id, emit_start), ...), ((req_id, (data, item_size)), ...),
    finished_requests, retained, released)``, dict orders kept."""
    if meta is None:
        return None
    return (
        int(meta.generation),
        tuple((req_id, int(start)) for req_id, start in meta.requests.items()),
        tuple((req_id, _packed(h)) for req_id, h in meta.block_hashes.items()),
        tuple(meta.finished_requests),
        _packed(meta.retained_block_hashes),
        _packed(meta.released_block_hashes),
    )


def vllm_metadata_types() -> tuple[type, type]:
    """vLLM 0.33.0's (AuxOutputConnectorMetadata, PackedBlockHashes): what its scheduler
    hands every worker connector, so what a replay should hand them too."""
    from vllm.distributed.aux_output_connector.connector import (
        AuxOutputConnectorMetadata,
        PackedBlockHashes,
    )

    return AuxOutputConnectorMetadata, PackedBlockHashes


def build_metadata(plain: PlainMetadata | None, types: tuple[type, type]) -> Any:
    """The metadata object of ``plain`` made of ``types`` = (metadata class, packed class)."""
    if plain is None:
        return None
    meta_cls, packed_cls = types
    generation, requests, hashes, finished, retained, released = plain

    def packed(value: tuple[bytes, int] | None) -> Any:
        return None if value is None else packed_cls(value[0], value[1])

    return meta_cls(
        generation,
        dict(requests),
        {req_id: packed(h) for req_id, h in hashes},
        tuple(finished),
        packed(retained),
        packed(released),
    )


def digest_outputs(outputs: dict[str, Any]) -> str:
    """One step's outputs as a hex digest: per request (sorted by id) the id, token_start,
    dtype, shape and row bytes."""
    h = hashlib.blake2b(digest_size=16)
    for req_id in sorted(outputs):
        item = outputs[req_id]
        rows = np.ascontiguousarray(item.rows)
        h.update(f"{req_id}|{int(item.token_start)}|{rows.dtype.str}|{rows.shape}|".encode())
        if rows.size:
            h.update(memoryview(rows).cast("B"))
    return h.hexdigest()


@dataclass
class PrepareCall:
    """``prepare_output``'s inputs. ``rows_offset``/``num_rows``: where the rows the engine
    wrote into the capture buffer for this step lie in ``Recording.rows`` (padding rows
    included, ``num_rows == query_start_loc[-1]``)."""

    req_ids: list[str]
    query_start_loc: np.ndarray  # int32 [R + 1] (+1 with CUDA-graph padding)
    num_computed: np.ndarray  # int32 [R]
    positions: np.ndarray  # int64 [num_rows]
    num_rejected: np.ndarray  # int32 [R]: the device counts rejection sampling produced
    # int64 [R]: each request's persistent index (Model Runner V2's idx_mapping), below
    # max_num_seqs; an index can pass to a new request while its old owner's step is in flight
    idx_mapping: np.ndarray
    rows_offset: int
    num_rows: int
    returned: bool = True  # the worker returned a pending step (False: None)


@dataclass
class EnqueueCall:
    """``enqueue_cpu_copy``'s arrays as they read once the copies completed."""

    num_sampled: np.ndarray | None = None  # int32 [R]
    num_rejected: np.ndarray | None = None  # int32 [R]


@dataclass
class Recording:
    """Every worker-connector call of one simulator run.

    ``events``: ``(BEGIN, step, PlainMetadata)``, ``(PREPARE, step, PrepareCall)``,
    ``(ENQUEUE, step, EnqueueCall)``, ``(PROCESS, step)`` in call order; ``step`` counts
    ``begin_step`` calls (one per engine step, with or without a forward). ``digests``:
    ``(step, digest_outputs(...))`` per ``process_output``; ``error``: ``(step, call,
    exception type name)`` of the first failing call, else None. ``rows``: int ``[N, L, K]``.
    """

    name: str
    sizing: WorkerSizing
    events: list[tuple]
    rows: np.ndarray
    digests: list[tuple[int, str]] = field(default_factory=list)
    error: tuple[int, str, str] | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def num_steps(self) -> int:
        return sum(1 for event in self.events if event[0] == BEGIN)

    def save(self, directory: Path) -> None:
        """Write ``events.pkl`` and, unless already streamed there, ``rows.bin``."""
        directory.mkdir(parents=True, exist_ok=True)
        rows_path = directory / "rows.bin"
        streamed = isinstance(self.rows, np.memmap) and self.rows.filename is not None
        if not streamed or Path(self.rows.filename).resolve() != rows_path.resolve():
            np.ascontiguousarray(self.rows).tofile(rows_path)
        sizing = self.sizing
        state = {
            "name": self.name,
            # Plain fields, so a recording outlives a move of the sizing class.
            "sizing": {
                "shape_per_token": tuple(sizing.shape_per_token),
                "dtype": np.dtype(sizing.dtype).str,
                "hash_block_size": sizing.hash_block_size,
                "max_num_seqs": sizing.max_num_seqs,
                "max_num_batched_tokens": sizing.max_num_batched_tokens,
                "max_concurrent_batches": sizing.max_concurrent_batches,
                "max_bytes": sizing.max_bytes,
            },
            "events": self.events,
            "digests": self.digests,
            "error": self.error,
            "info": self.info,
            "rows": (self.rows.dtype.str, tuple(self.rows.shape)),
        }
        with open(directory / "events.pkl", "wb") as f:
            pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)

    @classmethod
    def load(cls, directory: Path) -> Recording:
        with open(directory / "events.pkl", "rb") as f:
            state = pickle.load(f)
        dtype, shape = state.pop("rows")
        state["sizing"] = WorkerSizing(**state["sizing"])
        if shape[0]:
            rows = np.memmap(directory / "rows.bin", dtype=np.dtype(dtype), mode="r", shape=shape)
        else:
            rows = np.empty(shape, np.dtype(dtype))
        return cls(rows=rows, **state)


class _RowSink:
    """Collects the step rows: in memory, or appended to a file as they come."""

    def __init__(self, dtype: np.dtype, shape_per_token: tuple[int, int], file: BinaryIO | None):
        self.dtype = dtype
        self.shape_per_token = shape_per_token
        self.file = file
        self.chunks: list[np.ndarray] = []
        self.count = 0

    def add(self, rows: np.ndarray) -> int:
        narrow = rows.astype(self.dtype)
        if not np.array_equal(narrow, rows):
            raise ValueError(f"capture rows do not fit {self.dtype}: cannot record them")
        offset = self.count
        if self.file is not None:
            narrow.tofile(self.file)
        else:
            self.chunks.append(narrow)
        self.count += len(narrow)
        return offset

    def finish(self, path: Path | None) -> np.ndarray:
        shape = (self.count, *self.shape_per_token)
        if self.file is not None:
            self.file.flush()
            if not self.count:
                return np.empty(shape, self.dtype)
            return np.memmap(path, dtype=self.dtype, mode="r", shape=shape)
        if not self.chunks:
            return np.empty(shape, self.dtype)
        return np.concatenate(self.chunks)


class _RecordingPending:
    def __init__(self, owner: RecordingHandle, step: int, pending: Any) -> None:
        self._owner = owner
        self._step = step
        self._pending = pending
        self._enqueued = EnqueueCall()
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None

    def enqueue_cpu_copy(self, num_sampled: np.ndarray, num_rejected: np.ndarray) -> None:
        # Contents are read at process_output: the engine fills the arrays in late.
        self._arrays = (num_sampled, num_rejected)
        self._owner._log(ENQUEUE, self._step, self._enqueued)
        self._owner._call(
            self._step,
            ENQUEUE,
            self._pending.enqueue_cpu_copy,
            num_sampled=num_sampled,
            num_rejected=num_rejected,
        )

    def process_output(self) -> dict[str, Any]:
        if self._arrays is not None:
            sampled, rejected = self._arrays
            self._enqueued.num_sampled = np.array(sampled, np.int32)
            self._enqueued.num_rejected = np.array(rejected, np.int32)
        self._owner._log(PROCESS, self._step)
        outputs = self._owner._call(self._step, PROCESS, self._pending.process_output)
        self._owner.digests.append((self._step, digest_outputs(outputs)))
        return outputs


class RecordingHandle:
    """A ``WorkerHandle`` look-alike that logs every call into ``events`` and forwards it."""

    def __init__(self, inner: WorkerHandle, sizing: WorkerSizing, sink: _RowSink) -> None:
        self.inner = inner
        self.name = inner.name
        self.worker = inner.worker
        self.capture_buffer = inner.capture_buffer
        self.sizing = sizing
        self.events: list[tuple] = []
        self.digests: list[tuple[int, str]] = []
        self.error: tuple[int, str, str] | None = None
        self._sink = sink
        self._step = -1

    def _log(self, kind: str, step: int, *payload: Any) -> None:
        self.events.append((kind, step, *payload))

    def _call(self, step: int, kind: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except Exception as exc:
            if self.error is None:
                self.error = (step, kind, type(exc).__name__)
            raise

    def begin_step(self, metadata: Any) -> None:
        self._step += 1
        self._log(BEGIN, self._step, plain_metadata(metadata))
        self._call(self._step, BEGIN, self.inner.begin_step, metadata)

    def prepare_output(self, input_batch: Any, num_rejected: np.ndarray) -> Any:
        step = self._step
        qsl = np.array(input_batch.query_start_loc_np, np.int32)
        num_rows = int(qsl[-1])
        offset = self._sink.add(self.capture_buffer[:num_rows].numpy())
        call = PrepareCall(
            req_ids=list(input_batch.req_ids),
            query_start_loc=qsl,
            num_computed=np.array(input_batch.num_computed_tokens_np, np.int32),
            positions=input_batch.positions.numpy().astype(np.int64),
            num_rejected=np.array(num_rejected, np.int32),
            idx_mapping=np.array(input_batch.idx_mapping_np, np.int64),
            rows_offset=offset,
            num_rows=num_rows,
        )
        self._log(PREPARE, step, call)
        pending = self._call(step, PREPARE, self.inner.prepare_output, input_batch, num_rejected)
        if pending is None:
            call.returned = False
            return None
        return _RecordingPending(self, step, pending)

    def num_active_requests(self) -> int:
        return self.inner.num_active_requests()

    def close(self) -> None:
        self.inner.close()


def record_trace(
    trace: Trace,
    directory: Path | None = None,
    *,
    worker_factory: Callable[[WorkerSizing], WorkerHandle] = make_vllm_worker,
    scheduler: str = "vllm",
    check: bool = True,
) -> Recording:
    """Run ``trace`` through the simulator (vLLM 0.33.0's scheduler connector by default,
    ``scheduler="r3capture"`` for the simulator's own) and record the worker calls. A trace
    whose requests may opt out of routed experts (``Trace.opted_out``) runs with that
    connector wrapped as r3capture wraps vLLM's (``replay_scheduler``), so the recording
    holds the emit starts that worker gets. With ``directory`` the rows stream to
    ``directory/rows.bin`` and the recording is saved there. ``check``: verify the run
    against the routing oracle (when it ran to the end)."""
    schedulers = {"vllm": vllm_scheduler, "r3capture": r3capture_scheduler}
    scheduler_factory = schedulers[scheduler]
    if trace.opted_out():
        scheduler_factory = replay_scheduler(trace.config.replay_default, scheduler_factory)
    handles: list[RecordingHandle] = []
    rows_path = None if directory is None else directory / "rows.bin"
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
    file = None if rows_path is None else open(rows_path, "wb")  # noqa: SIM115
    try:

        def factory(sizing: WorkerSizing) -> RecordingHandle:
            sink = _RowSink(trace.model.dtype, sizing.shape_per_token, file)
            handles.append(RecordingHandle(worker_factory(sizing), sizing, sink))
            return handles[-1]

        result = run_trace(
            trace,
            factory,
            scheduler_factory=scheduler_factory,
            catch_errors=True,
            check=check,
        )
        (handle,) = handles
        rows = handle._sink.finish(rows_path)
    finally:
        if file is not None:
            file.close()
    stats = result.stats
    recording = Recording(
        name=trace.name,
        sizing=handle.sizing,
        events=handle.events,
        rows=rows,
        digests=handle.digests,
        error=handle.error,
        info={
            "scheduler": scheduler,
            "worker": handle.name,
            "steps": stats.steps,
            "forward_steps": stats.forward_steps,
            "rows_scheduled": stats.rows_scheduled,
            "rows_accepted": stats.rows_accepted,
            "prefix_hit_tokens": stats.prefix_hit_tokens,
            "preemptions": stats.preemptions,
            "resets": stats.resets,
            "drafts": stats.drafts,
            "rejected_drafts": stats.rejected_drafts,
            "requests": len(trace.requests),
            "opted_out": len(trace.opted_out()),
            "emitted_rows": stats.emitted_rows,
        },
    )
    if result.error is not None and recording.error is None:
        # The engine itself failed (not a worker call): no replay can reproduce that.
        recording.info["engine_error"] = f"{result.error.kind}: {result.error.exc}"
    if directory is not None:
        recording.save(directory)
    return recording


__all__ = [
    "BEGIN",
    "ENQUEUE",
    "PREPARE",
    "PROCESS",
    "EnqueueCall",
    "PrepareCall",
    "Recording",
    "RecordingHandle",
    "build_metadata",
    "digest_outputs",
    "plain_metadata",
    "record_trace",
    "vllm_metadata_types",
]
