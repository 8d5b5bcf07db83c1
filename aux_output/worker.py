"""r3capture's worker connector: vLLM 0.33.0's worker protocol on a block-aligned data path.

Per step (same call order as vLLM's ``AuxOutputWorkerConnector``):

1. ``begin_step(metadata)`` turns new block hashes into store keys, pins and unpins keys,
   binds complete blocks whose key just arrived, and tears down finished requests.
2. ``prepare_output(input_batch)`` gives every scheduled request store slots for the hash
   blocks its rows can fall into and launches one gather-pack kernel: each request's
   accepted rows are cast to uint8/uint16 and written straight into those slots, so a
   complete block is already whole where the store keeps it.
3. ``PendingStep.enqueue_cpu_copy`` (copy stream) records the host-side counts and, in the
   device-staging mode, starts the one asynchronous copy of the step's staging.
4. ``PendingStep.process_output()`` (output thread, after the step's event) advances the
   request cursors, copies each request's newly emitted rows into one per-step array,
   binds complete keyed blocks to their keys (no payload copy), and materializes
   prefix-cache hits with one gather per request.

Outputs (``AuxRequestOutput`` per request per step) and protocol errors are those of vLLM
0.33.0's connector; ``tests/aux_output/test_differential.py`` checks this on generated traces.

Slots: a request owns the store slots of its *unbound* blocks, a contiguous range of block
indices starting at ``base_block`` (blocks are completed and keyed in order, so everything
below is bound or belongs to a cached prefix). Rows are placed at the scheduler's token
start; when async scheduling reattaches a request after a rejected speculative suffix,
the host moves the few affected rows down to the capture cursor before using them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from r3capture.aux_output import envs
from r3capture.aux_output.errors import AuxOutputProtocolError, require
from r3capture.aux_output.types import AuxOutputConnectorMetadata, AuxRequestOutput, block_keys
from r3capture.kernels import can_write_host_directly, gather_pack
from r3capture.store import BlockStore

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {np.dtype(np.uint8): torch.uint8, np.dtype(np.uint16): torch.uint16}


@dataclass
class _Request:
    keys: list[str] = field(default_factory=list)
    # Store slots of unbound blocks base_block, base_block + 1, ...
    slots: list[int] = field(default_factory=list)
    base_block: int = 0
    capture_cursor: int | None = None
    scheduled_cursor: int = 0
    emit_cursor: int = 0
    pending_outputs: int = 0
    finished: bool = False


class PendingStep:
    """One step's rows in flight between ``prepare_output`` and ``process_output``."""

    def __init__(
        self,
        worker: TritonAuxOutputWorker,
        request_ids: list[str],
        token_starts: np.ndarray,
        query_start_loc: np.ndarray,
        step_info: torch.Tensor | None,
        staging: _StagingCopy | None,
    ) -> None:
        self.worker = worker
        self.request_ids = request_ids
        self.token_starts = token_starts  # int64 [R]
        self.query_start_loc = query_start_loc  # int64 [R + 1]
        self.step_info_device = step_info  # int32 [R, 3] written by the kernel
        self.step_info: np.ndarray | None = None
        self.staging = staging
        self.num_sampled: np.ndarray | None = None
        self.num_rejected: np.ndarray | None = None

    def enqueue_cpu_copy(self, num_sampled: np.ndarray, num_rejected: np.ndarray) -> None:
        """Record the host counts and start this step's device-to-host copies.

        Call on the output copy stream; the arrays become valid once its event completes.
        """
        self.num_sampled = num_sampled
        self.num_rejected = num_rejected
        info = self.step_info_device
        if info is not None:
            self.step_info = self.worker._copy_to_host(info)
        if self.staging is not None:
            self.staging.start()

    def process_output(self) -> dict[str, AuxRequestOutput]:
        return self.worker.process_output(self)


@dataclass
class _StagingCopy:
    """Device staging of one step and its pinned host copy (device-staging destination)."""

    device: torch.Tensor  # [num_blocks, B, L, K]
    host: torch.Tensor  # [num_blocks, B, L, K], pinned when CUDA is present
    first_blocks: np.ndarray  # int64 [R]
    staging_table: np.ndarray  # int32 [R, M]: staging slot of block first_blocks[r] + j
    arena_table: np.ndarray  # int32 [R, M]: store slot of the same block
    started: bool = False

    def start(self) -> None:
        self.host.copy_(self.device, non_blocking=True)
        self.started = True


class TritonAuxOutputWorker:
    """Worker connector for routed-experts capture on r3capture's data path.

    Args:
        shape_per_token: ``(L, K)``: hidden layers (dense ones stay 0) and top-k.
        dtype: ``uint8`` (<= 256 experts) or ``uint16``.
        hash_block_size: tokens per hash block ``B`` (one store object per block).
        max_num_seqs, max_num_batched_tokens, max_concurrent_batches: scheduler limits;
            they size the slot reserve for blocks still being filled.
        max_bytes: store capacity for published blocks (grows when all are referenced).
        device: where the capture buffer lives.
        capture_buffer: the router hooks' int32 buffer ``[max_num_batched_tokens, L, K]``;
            allocated (zeros) when not given.
        is_output_rank: only the first TP rank owns the data plane.
        destination: ``direct`` | ``staging`` | ``auto``/None (env R3CAPTURE_DESTINATION).
        kernel_impl: ``triton`` | ``reference`` | ``auto``/None (env R3CAPTURE_KERNEL_IMPL).
    """

    def __init__(
        self,
        *,
        shape_per_token: tuple[int, int],
        dtype: np.dtype | str,
        hash_block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_concurrent_batches: int,
        max_bytes: int,
        device: str | torch.device = "cpu",
        capture_buffer: torch.Tensor | None = None,
        is_output_rank: bool = True,
        destination: str | None = None,
        kernel_impl: str | None = None,
    ) -> None:
        dtype = np.dtype(dtype)
        if dtype not in _TORCH_DTYPES:
            raise ValueError(f"dtype must be uint8 or uint16, got {dtype}")
        if len(shape_per_token) != 2 or min(shape_per_token) <= 0:
            raise ValueError(f"shape_per_token must be (L, K) > 0, got {shape_per_token}")
        for name, value in (
            ("hash_block_size", hash_block_size),
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_concurrent_batches", max_concurrent_batches),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self.shape_per_token = tuple(int(x) for x in shape_per_token)
        self.dtype = dtype
        self.block_size = int(hash_block_size)
        self.device = torch.device(device)
        self._max_concurrent_batches = max_concurrent_batches
        self._kernel_impl = kernel_impl or envs.kernel_impl()
        L, K = self.shape_per_token
        if capture_buffer is None:
            capture_buffer = torch.zeros(
                (max_num_batched_tokens, L, K), dtype=torch.int32, device=self.device
            )
        elif tuple(capture_buffer.shape[1:]) != self.shape_per_token:
            raise ValueError(
                f"capture_buffer must be [T, {L}, {K}], got {tuple(capture_buffer.shape)}"
            )
        self.capture_buffer = capture_buffer

        self._requests: dict[str, _Request] = {}
        self._generation = 0
        self._step_metadata: AuxOutputConnectorMetadata | None = None
        self._pending: list[PendingStep] = []
        self._lock = threading.Lock()
        self._num_rejected_next: torch.Tensor | None = None
        self._store: BlockStore | None = None
        if not is_output_rank:
            return

        block_nbytes = self.block_size * L * K * dtype.itemsize
        # Blocks a step can touch, plus each request's open block, for every step in
        # flight: the same bound as vLLM's staging buffer.
        step_blocks = -(-max_num_batched_tokens // self.block_size) + max_num_seqs
        reserve = max_concurrent_batches * step_blocks + max_num_seqs
        self._destination = self._pick_destination(destination or envs.destination())
        self._store = BlockStore(
            max_bytes=max_bytes,
            object_nbytes=block_nbytes,
            reserve_slots=reserve,
            pin_memory=self._destination == "direct" and self.device.type == "cuda",
            on_grow=self._wait_for_device_writes,
        )
        self._staging_ring: list[torch.Tensor] = []
        self._staging_host_ring: list[torch.Tensor] = []
        if self._destination == "staging":
            pin = self.device.type == "cuda"
            for _ in range(max_concurrent_batches):
                shape = (step_blocks, self.block_size, L, K)
                torch_dtype = _TORCH_DTYPES[dtype]
                self._staging_ring.append(torch.empty(shape, dtype=torch_dtype, device=self.device))
                self._staging_host_ring.append(
                    torch.empty(shape, dtype=torch_dtype, pin_memory=pin)
                )
        self._step_count = 0
        # Reused per-step device inputs (no per-step allocation on the device).
        self._qsl_dev = torch.zeros(max_num_seqs + 1, dtype=torch.int64, device=self.device)
        self._start_dev = torch.zeros(max_num_seqs, dtype=torch.int64, device=self.device)
        self._first_dev = torch.zeros(max_num_seqs, dtype=torch.int64, device=self.device)
        self._info_dev = torch.zeros((max_num_seqs, 3), dtype=torch.int32, device=self.device)
        self._max_num_seqs = max_num_seqs

    # ------------------------------------------------------------------ setup helpers
    def _pick_destination(self, requested: str) -> str:
        if requested not in ("auto", "direct", "staging"):
            raise ValueError(f"destination must be auto|direct|staging, got {requested!r}")
        if self.device.type != "cuda":
            # Host and device memory are the same: the kernel writes the arena directly.
            return "staging" if requested == "staging" else "direct"
        direct_ok = can_write_host_directly(self.device)
        if requested == "direct" and not direct_ok:
            raise ValueError(f"{self.device} cannot write pinned host memory directly")
        if requested == "auto":
            return "direct" if direct_ok else "staging"
        return requested

    def _wait_for_device_writes(self) -> None:
        # The store is about to copy its arena: kernels still writing the old one must finish.
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _copy_to_host(self, tensor: torch.Tensor) -> np.ndarray:
        if tensor.device.type == "cpu":
            return tensor.numpy()
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return host.numpy()

    @property
    def store(self) -> BlockStore | None:
        return self._store

    def set_step_num_rejected(self, num_rejected: torch.Tensor | None) -> None:
        """Hand the next ``prepare_output`` the step's device rejected counts ``[R]``."""
        self._num_rejected_next = num_rejected

    # ------------------------------------------------------------------ protocol
    def begin_step(self, metadata: AuxOutputConnectorMetadata | None) -> None:
        """Apply one scheduler step's hash updates, pins and terminal events."""
        self._step_metadata = metadata
        if self._store is None or metadata is None:
            return
        require(
            not metadata.requests.keys() & set(metadata.finished_requests),
            "auxiliary output request cannot run and finish in one step",
        )
        require(
            metadata.generation >= self._generation,
            "auxiliary output metadata generation moved backwards",
        )
        with self._lock:
            # Pins named by the scheduler belong to the namespace it had before any bump.
            retain_keys = block_keys(metadata.retained_block_hashes, self._generation)
            release_keys = block_keys(metadata.released_block_hashes, self._generation)
            if metadata.generation > self._generation:
                # The scheduler resets the prefix cache only with no model output in flight.
                require(
                    not self._pending,
                    "auxiliary output generation changed with output in flight",
                )
                for state in self._requests.values():
                    release_keys.extend(reversed(state.keys))
                    self._free_slots(state)
                self._requests.clear()
                self._generation = metadata.generation
            for request_id, emit_start in metadata.requests.items():
                state = self._requests.get(request_id)
                if state is None:
                    state = self._requests[request_id] = _Request(emit_cursor=emit_start)
                elif state.pending_outputs == 0:
                    # Only settled requests: in-flight steps lag the scheduler's view.
                    require(
                        emit_start <= state.emit_cursor,
                        "auxiliary output Scheduler emit cursor moved ahead",
                    )
            updated: list[_Request] = []
            for request_id, hashes in metadata.block_hashes.items():
                state = self._requests[request_id]
                keys = block_keys(hashes, self._generation)
                state.keys.extend(keys)
                retain_keys.extend(keys)
                updated.append(state)
            finished_now: list[str] = []
            for request_id in metadata.finished_requests:
                state = self._requests[request_id]
                state.finished = True
                if state.pending_outputs:
                    continue
                finished_now.append(request_id)
                release_keys.extend(reversed(state.keys))
            self._publish(updated, retain_keys, release_keys)
            self._teardown(finished_now)

    def prepare_output(
        self, input_batch: Any, num_rejected: torch.Tensor | None = None
    ) -> PendingStep | None:
        """Place this step's accepted rows into store slots with one kernel launch.

        ``input_batch`` provides ``req_ids``, ``query_start_loc_np`` (``[>= R+1]``) and
        ``num_computed_tokens_np`` (``[>= R]``); ``num_rejected`` (device ``[R]``) lets the
        kernel skip rejected rows so they never reach the host.
        """
        if num_rejected is None:
            num_rejected = self._num_rejected_next
        self._num_rejected_next = None
        if self._store is None or self._step_metadata is None:
            return None
        request_ids = list(input_batch.req_ids)
        num_reqs = len(request_ids)
        qsl = np.asarray(input_batch.query_start_loc_np[: num_reqs + 1], dtype=np.int64)
        token_starts = np.asarray(input_batch.num_computed_tokens_np[:num_reqs], dtype=np.int64)
        num_rows = int(qsl[-1]) if num_reqs else 0
        if num_reqs > self._max_num_seqs:
            raise ValueError(f"{num_reqs} requests in one step exceed max_num_seqs")
        if num_rows > self.capture_buffer.shape[0]:
            raise ValueError(
                f"{num_rows} rows exceed the capture buffer's {self.capture_buffer.shape[0]}"
            )
        with self._lock:
            require(
                len(self._pending) < self._max_concurrent_batches,
                "auxiliary output step outputs are not consumed in order",
            )
            first_blocks, table = self._plan_slots(request_ids, qsl, token_starts)
            step_info, staging = self._launch(
                num_reqs, num_rows, qsl, token_starts, first_blocks, table, num_rejected
            )
            pending = PendingStep(self, request_ids, token_starts, qsl, step_info, staging)
            self._pending.append(pending)
            for request_id in request_ids:
                self._requests[request_id].pending_outputs += 1
        return pending

    def process_output(self, pending: PendingStep) -> dict[str, AuxRequestOutput]:
        """Consume one step after its copy event: outputs per request, blocks published.

        Teardown that ``begin_step`` deferred for requests in this step happens here.
        """
        with self._lock:
            teardown: list[str] = []
            release_keys: list[str] = []
            try:
                outputs = self._commit(pending)
            finally:
                self._pending.remove(pending)
                for request_id in pending.request_ids:
                    state = self._requests[request_id]
                    state.pending_outputs -= 1
                    if state.pending_outputs == 0 and state.finished:
                        teardown.append(request_id)
                        release_keys.extend(reversed(state.keys))
            if teardown:
                self._publish([], (), release_keys)
                self._teardown(teardown)
            return outputs

    def close(self) -> None:
        with self._lock:
            self._pending.clear()
            if self._store is not None:
                try:
                    self._store.close()
                finally:
                    self._store = None

    # ------------------------------------------------------------------ prepare internals
    def _plan_slots(
        self, request_ids: Sequence[str], qsl: np.ndarray, token_starts: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Give every request slots for blocks ``token_start // B .. (token_end - 1) // B``.

        Returns ``first_block [R]`` and ``slot_table [R, M]`` (int32, -1 = unmapped).
        """
        B = self.block_size
        num_reqs = len(request_ids)
        firsts = token_starts // B
        lasts = (token_starts + np.diff(qsl) - 1) // B
        states = [self._requests[request_id] for request_id in request_ids]
        needed = 0
        for state, first, last in zip(states, firsts.tolist(), lasts.tolist()):
            if not state.slots and state.capture_cursor is None:
                state.base_block = first
            needed += max(0, last + 1 - state.base_block - len(state.slots))
        fresh = self._store.allocate(needed).tolist() if needed else []
        width = int((lasts - firsts).max()) + 1 if num_reqs else 0
        table = np.full((num_reqs, max(width, 1)), -1, dtype=np.int32)
        taken = 0
        for row, (state, first, last) in enumerate(zip(states, firsts.tolist(), lasts.tolist())):
            grow = last + 1 - state.base_block - len(state.slots)
            if grow > 0:
                state.slots.extend(fresh[taken : taken + grow])
                taken += grow
            # Blocks below base_block are bound; a start there is an error process_output names.
            lo = max(first, state.base_block)
            if last >= lo:
                mapped = state.slots[lo - state.base_block : last + 1 - state.base_block]
                table[row, lo - first : lo - first + len(mapped)] = mapped
        return firsts, table

    def _launch(
        self,
        num_reqs: int,
        num_rows: int,
        qsl: np.ndarray,
        token_starts: np.ndarray,
        first_blocks: np.ndarray,
        table: np.ndarray,
        num_rejected: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, _StagingCopy | None]:
        if num_reqs == 0:
            return None, None
        device = self.device
        self._qsl_dev[: num_reqs + 1].copy_(torch.from_numpy(qsl), non_blocking=True)
        self._start_dev[:num_reqs].copy_(torch.from_numpy(token_starts), non_blocking=True)
        self._first_dev[:num_reqs].copy_(torch.from_numpy(first_blocks), non_blocking=True)
        staging = None
        if self._destination == "staging":
            ring = self._step_count % len(self._staging_ring)
            mapped = table >= 0
            num_blocks = int(mapped.sum())
            staging_table = np.full(table.shape, -1, dtype=np.int32)
            staging_table[mapped] = np.arange(num_blocks, dtype=np.int32)
            dest = self._staging_ring[ring][:num_blocks]
            staging = _StagingCopy(
                device=dest,
                host=self._staging_host_ring[ring][:num_blocks],
                first_blocks=first_blocks,
                staging_table=staging_table,
                arena_table=table,
            )
            table = staging_table
        else:
            dest = self._arena_rows_view()
        self._step_count += 1
        slot_table = torch.from_numpy(table).to(device, non_blocking=True)
        step_info = self._info_dev[:num_reqs]
        gather_pack(
            self.capture_buffer,
            self._qsl_dev[: num_reqs + 1],
            self._start_dev[:num_reqs],
            self._first_dev[:num_reqs],
            slot_table,
            dest,
            step_info,
            num_rejected[:num_reqs] if num_rejected is not None else None,
            num_reqs=num_reqs,
            impl=self._kernel_impl,
        )
        return step_info, staging

    def _arena_rows_view(self) -> torch.Tensor:
        """The store arena as ``[slots, B, L, K]`` of the output dtype (a view, no copy)."""
        arena = self._store.arena
        L, K = self.shape_per_token
        return arena.view(_TORCH_DTYPES[self.dtype]).view(arena.shape[0], self.block_size, L, K)

    # ------------------------------------------------------------------ process internals
    def _arena_rows_np(self) -> np.ndarray:
        """The store arena as ``[slots * B, L, K]`` numpy rows of the output dtype."""
        L, K = self.shape_per_token
        return self._store.arena_np.view(self.dtype).reshape(-1, L, K)

    def _row_index(self, state: _Request, start: int, end: int) -> np.ndarray:
        """Arena row indices of token positions ``start .. end`` of an unbound range."""
        B = self.block_size
        positions = np.arange(start, end, dtype=np.int64)
        slots = np.asarray(state.slots, dtype=np.int64)[positions // B - state.base_block]
        return slots * B + positions % B

    def _commit(self, pending: PendingStep) -> dict[str, AuxRequestOutput]:
        B = self.block_size
        num_sampled, num_rejected = pending.num_sampled, pending.num_rejected
        require(
            num_sampled is not None and num_rejected is not None,
            "auxiliary output CPU copy was not enqueued",
        )
        if pending.staging is not None:
            self._unstage(pending)
        info = pending.step_info
        rows_np = self._arena_rows_np()
        qsl = pending.query_start_loc
        emit_plan: list[tuple[str, int, int, _Request]] = []
        materialize: list[tuple[str, int, int]] = []
        touched: list[_Request] = []
        for index, request_id in enumerate(pending.request_ids):
            start, end = int(qsl[index]), int(qsl[index + 1])
            num_tokens = end - start
            require(num_tokens > 0, "auxiliary output request token count must be positive")
            state = self._requests[request_id]
            rejected = int(num_rejected[index])
            require(
                0 <= rejected <= num_tokens, "auxiliary output rejected-token count is invalid"
            )
            accepted = num_tokens - rejected
            token_start = int(pending.token_starts[index])
            capture_start = token_start
            cursor = state.capture_cursor
            if cursor is None:
                cursor = capture_start
            require(capture_start >= cursor, "auxiliary output capture moved backwards")
            if capture_start > cursor:
                # Reattach after an optimistically scheduled suffix was rejected.
                require(
                    cursor < state.scheduled_cursor,
                    "auxiliary output capture has an unbacked token gap",
                )
                capture_start = cursor
            if state.capture_cursor is None and accepted and capture_start % B:
                raise AuxOutputProtocolError(
                    "auxiliary output capture is not contiguous: "
                    f"request={request_id}, expected={capture_start // B * B}, "
                    f"actual={capture_start}"
                )
            self._check_kernel(request_id, info, index, token_start, num_tokens, accepted)
            if accepted and capture_start != token_start:
                self._relocate(state, token_start, capture_start, accepted, rows_np)
            emit_start = state.emit_cursor
            token_end = capture_start + accepted
            state.capture_cursor = token_end
            state.scheduled_cursor = token_start + num_tokens
            touched.append(state)
            if num_sampled[index] > 0 and emit_start <= token_end:
                if emit_start >= capture_start:
                    emit_plan.append((request_id, emit_start, token_end, state))
                    state.emit_cursor = token_end
                else:
                    materialize.append((request_id, emit_start, token_end))

        # Copy emitted rows out before any slot can be bound (and later reused).
        outputs = self._emit(emit_plan, rows_np)
        # Publish the whole step before materializing: a hit may need a block from it.
        self._publish(touched, (), ())
        for request_id, emit_start, token_end in materialize:
            state = self._requests[request_id]
            outputs[request_id] = AuxRequestOutput(
                emit_start, self._materialize(request_id, state, emit_start, token_end)
            )
            state.emit_cursor = token_end
        return outputs

    def _check_kernel(
        self,
        request_id: str,
        info: np.ndarray | None,
        index: int,
        token_start: int,
        num_tokens: int,
        accepted: int,
    ) -> None:
        if info is None:
            return
        start, written, status = (int(x) for x in info[index])
        if status != 0 or start != token_start or written < accepted:
            raise AuxOutputProtocolError(
                "auxiliary output rows were not placed by the capture kernel: "
                f"request={request_id}, status={status}, start={start} (expected "
                f"{token_start}), rows written={written} of {accepted} accepted "
                f"({num_tokens} scheduled); the device rejected counts and the host's "
                "must agree"
            )

    def _relocate(
        self, state: _Request, written_at: int, capture_start: int, count: int, rows_np: np.ndarray
    ) -> None:
        # Rows were placed at the scheduler's optimistic start; they belong at the cursor.
        source = self._row_index(state, written_at, written_at + count)
        target = self._row_index(state, capture_start, capture_start + count)
        rows_np[target] = rows_np[source]

    def _emit(
        self, plan: list[tuple[str, int, int, _Request]], rows_np: np.ndarray
    ) -> dict[str, AuxRequestOutput]:
        if not plan:
            return {}
        B = self.block_size
        counts = [end - start for _, start, end, _ in plan]
        index = np.empty(sum(counts), dtype=np.int64)
        at = 0
        for (_, start, end, state), count in zip(plan, counts):
            if count == 1:
                index[at] = state.slots[start // B - state.base_block] * B + start % B
            elif count:
                index[at : at + count] = self._row_index(state, start, end)
            at += count
        # One gather: the outputs own their memory, whatever happens to the slots later.
        emitted = rows_np[index]
        outputs: dict[str, AuxRequestOutput] = {}
        at = 0
        for (request_id, start, _, _), count in zip(plan, counts):
            outputs[request_id] = AuxRequestOutput(start, emitted[at : at + count])
            at += count
        return outputs

    def _materialize(
        self, request_id: str, state: _Request, emit_start: int, token_end: int
    ) -> np.ndarray:
        """Rows ``emit_start .. token_end``: stored blocks, then the open block's rows."""
        B = self.block_size
        L, K = self.shape_per_token
        stored_end = min(token_end // B, len(state.keys)) * B
        parts = []
        read_from = emit_start
        if emit_start < stored_end:
            keys = state.keys[emit_start // B : stored_end // B]
            blocks = self._store.get_array(keys).view(self.dtype).reshape(-1, L, K)
            local = emit_start % B
            parts.append(blocks[local : local + stored_end - emit_start])
            read_from = stored_end
        if read_from < token_end or not parts:
            # Only the open (incomplete) block is readable outside the store, as in vLLM.
            open_start = token_end // B * B
            if token_end % B == 0 or read_from < open_start or read_from >= token_end:
                raise AuxOutputProtocolError(
                    "auxiliary output range is unavailable: "
                    f"request={request_id}, range=[{read_from}, {token_end}), "
                    f"available=[{open_start}, {token_end if token_end % B else open_start})"
                )
            parts.append(self._arena_rows_np()[self._row_index(state, read_from, token_end)])
        return parts[0].copy() if len(parts) == 1 else np.concatenate(parts)

    def _unstage(self, pending: PendingStep) -> None:
        # Device-staging mode: scatter the rows the kernel wrote, now in the host copy of
        # the staging, into their store slots. The direct mode needs none of this.
        staging = pending.staging
        require(staging.started, "auxiliary output CPU copy was not enqueued")
        info = pending.step_info
        written = np.where(info[:, 2] == 0, np.maximum(info[:, 1], 0), 0).astype(np.int64)
        total = int(written.sum())
        if total == 0:
            return
        B = self.block_size
        L, K = self.shape_per_token
        request = np.repeat(np.arange(len(written)), written)
        offset = np.arange(total) - np.repeat(np.cumsum(written) - written, written)
        position = pending.token_starts[request] + offset
        column = position // B - staging.first_blocks[request]
        within = position % B
        source = staging.staging_table[request, column].astype(np.int64) * B + within
        target = staging.arena_table[request, column].astype(np.int64) * B + within
        host_rows = staging.host.numpy().reshape(-1, L, K)
        self._arena_rows_np()[target] = host_rows[source]

    # ------------------------------------------------------------------ publication
    def _publish(
        self, states: Iterable[_Request], retain_keys: Sequence[str], release_keys: Sequence[str]
    ) -> None:
        """Bind every complete, keyed, unbound block of ``states`` in one store call."""
        B = self.block_size
        keys: list[str] = []
        slots: list[int] = []
        for state in states:
            cursor = state.capture_cursor
            if cursor is None:
                continue
            ready_end = min(len(state.keys), cursor // B)
            count = ready_end - state.base_block
            if count <= 0:
                continue
            keys.extend(state.keys[state.base_block : ready_end])
            slots.extend(state.slots[:count])
            del state.slots[:count]
            state.base_block = ready_end
        if keys or retain_keys or release_keys:
            self._store.bind(
                keys,
                np.asarray(slots, dtype=np.int64),
                retain_keys=retain_keys,
                release_keys=release_keys,
            )

    def _free_slots(self, state: _Request) -> None:
        if state.slots:
            self._store.free(np.asarray(state.slots, dtype=np.int64))
            state.slots = []

    def _teardown(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._free_slots(self._requests.pop(request_id))
