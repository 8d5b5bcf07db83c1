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
below is bound or belongs to a cached prefix). The kernel places each row at its true
position, read on the device from the batch's ``positions`` (under async scheduling a
request reattaches below the scheduler's optimistic start after a rejected speculative
suffix). Without 1-D ``positions`` (e.g. M-RoPE's ``[3, T]``) rows land at the scheduler's
start in per-step staging and the host moves a reattached request's rows before use.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import numpy as np
import torch

from r3capture.aux_output import envs
from r3capture.aux_output.errors import AuxOutputProtocolError, require
from r3capture.aux_output.output_pool import OutputPool
from r3capture.aux_output.request_table import NO_CURSOR, RequestTable
from r3capture.aux_output.sizing import WorkerSizing
from r3capture.aux_output.types import (
    AuxOutputConnectorMetadata,
    AuxRequestOutput,
    block_keys,
    block_keys_of_requests,
)
from r3capture.kernels import can_write_host_directly, gather_pack
from r3capture.store import BlockStore

logger = logging.getLogger(__name__)


def _equal_ints(a: np.ndarray, b: np.ndarray) -> bool:
    """``np.array_equal`` for integer arrays, by bytes when the dtypes match.

    The step path asks its yes/no questions of ``[R]`` arrays with this and
    ``np.count_nonzero``: ``np.array_equal`` and ``ndarray.any()/.min()`` go through
    Python-level wrappers and cost three to ten times as much at these sizes.
    """
    if a.dtype == b.dtype and a.shape == b.shape:
        return a.tobytes() == b.tobytes()
    return bool(np.array_equal(a, b))


_TORCH_DTYPES = {np.dtype(np.uint8): torch.uint8, np.dtype(np.uint16): torch.uint16}


class PendingStep:
    """One step's rows in flight between ``prepare_output`` and ``process_output``."""

    def __init__(
        self,
        worker: TritonAuxOutputWorker,
        request_ids: list[str],
        rows: np.ndarray,
        token_starts: np.ndarray,
        query_start_loc: np.ndarray,
        first_blocks: np.ndarray,
        slot_table: np.ndarray,
        step_info: torch.Tensor | None,
        staging: _StagingCopy | None,
        exact: bool,
        ring: int,
    ) -> None:
        self.worker = worker
        self.request_ids = request_ids
        self.rows = rows  # int64 [R]: request-table rows
        self.token_starts = token_starts  # int64 [R]
        self.query_start_loc = query_start_loc  # int64 [R + 1]
        self.num_tokens = np.diff(query_start_loc)  # int64 [R]: rows scheduled per request
        self.num_rows = int(query_start_loc[-1]) if len(query_start_loc) else 0
        self.first_blocks = first_blocks  # int64 [R]
        self.slot_table = slot_table  # int64 [R, M]: store slot of block first_blocks[r] + j
        self.step_info_device = step_info  # int32 [R, 3] written by the kernel
        self.step_info: np.ndarray | None = None
        self.staging = staging
        # Rows were written at their true positions (device positions were given).
        self.exact = exact
        # Which of the per-step buffers (step info, staging) this step uses.
        self.ring = ring
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
            self.step_info = self.worker._copy_to_host(info, self.ring)
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
    arena_table: np.ndarray  # int64 [R, M]: store slot of the same block
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
        output_pool_bytes: host bytes kept for recycling large output arrays once their
            consumers drop them; None reads R3CAPTURE_OUTPUT_POOL_BYTES, 0 turns it off.
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
    ) -> None:
        if not isinstance(sizing, WorkerSizing):
            raise TypeError(f"sizing must be a WorkerSizing, got {type(sizing).__name__}")
        dtype = sizing.dtype
        max_num_seqs = sizing.max_num_seqs
        max_num_batched_tokens = sizing.max_num_batched_tokens
        max_concurrent_batches = sizing.max_concurrent_batches
        max_bytes = sizing.max_bytes
        self.shape_per_token = sizing.shape_per_token
        self.dtype = dtype
        self.block_size = sizing.hash_block_size
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

        self._requests = RequestTable()
        # (table version, request ids, rows) of the last scheduled batch.
        self._scheduled_cache: tuple[int, list[str], np.ndarray] | None = None
        self._generation = 0
        self._step_metadata: AuxOutputConnectorMetadata | None = None
        self._pending: list[PendingStep] = []
        self._lock = threading.Lock()
        self._num_rejected_next: torch.Tensor | None = None
        self._store: BlockStore | None = None
        if not is_output_rank:
            return
        if output_pool_bytes is None:
            output_pool_bytes = envs.output_pool_bytes()
        self._output_pool = OutputPool(max_bytes=output_pool_bytes)

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
        self._staging_device_ring: list[torch.Tensor] = []
        self._staging_host_ring: list[torch.Tensor] = []
        # A step's table spans its rows' blocks plus, for requests with a step in flight,
        # the blocks a rejected suffix can leave between the cursor and the token start.
        self._staging_blocks = max_concurrent_batches * step_blocks + max_num_seqs
        self._step_count = 0
        # Reused per-step device inputs (no per-step allocation on the device).
        self._qsl_dev = torch.zeros(max_num_seqs + 1, dtype=torch.int64, device=self.device)
        self._start_dev = torch.zeros(max_num_seqs, dtype=torch.int64, device=self.device)
        self._first_dev = torch.zeros(max_num_seqs, dtype=torch.int64, device=self.device)
        # One step-info buffer per step in flight: a step's counts outlive the next launch.
        self._info_ring = [
            torch.zeros((max_num_seqs, 3), dtype=torch.int32, device=self.device)
            for _ in range(max_concurrent_batches)
        ]
        self._info_host_ring = (
            [
                torch.zeros((max_num_seqs, 3), dtype=torch.int32, pin_memory=True)
                for _ in range(max_concurrent_batches)
            ]
            if self.device.type == "cuda"
            else []
        )
        # Pinned host and device slot tables, reused every step.
        self._table_host: torch.Tensor | None = None
        self._table_dev: torch.Tensor | None = None
        self._max_num_seqs = max_num_seqs
        self._row_ids = np.arange(max_num_seqs, dtype=np.int64)
        # What crossed (or, on a CPU, would cross) from the device to the host, cumulative.
        self.transfer_stats = {"steps": 0, "rows": 0, "bytes": 0}

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

    def _staging_ring(self) -> list[torch.Tensor]:
        """One device staging buffer per step in flight, allocated on first use."""
        if not self._staging_device_ring:
            L, K = self.shape_per_token
            shape = (self._staging_blocks, self.block_size, L, K)
            torch_dtype = _TORCH_DTYPES[self.dtype]
            pin = self.device.type == "cuda"
            for _ in range(self._max_concurrent_batches):
                self._staging_device_ring.append(
                    torch.empty(shape, dtype=torch_dtype, device=self.device)
                )
                self._staging_host_ring.append(
                    torch.empty(shape, dtype=torch_dtype, pin_memory=pin)
                )
        return self._staging_device_ring

    def _wait_for_device_writes(self) -> None:
        # The store is about to copy its arena: kernels still writing the old one must finish.
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _copy_to_host(self, tensor: torch.Tensor, ring: int) -> np.ndarray:
        """Start the copy of a step's ``step_info`` into its pinned host buffer."""
        if tensor.device.type == "cpu":
            return tensor.numpy()
        host = self._info_host_ring[ring][: tensor.shape[0]]
        host.copy_(tensor, non_blocking=True)
        return host.numpy()

    def _device_table(self, table: np.ndarray) -> torch.Tensor:
        """``table`` on the device through buffers reused across steps (grown, rarely)."""
        if self.device.type == "cpu":
            return torch.from_numpy(table)
        if self._table_host is None or self._table_host.numel() < table.size:
            size = max(
                table.size, 2 * (0 if self._table_host is None else self._table_host.numel())
            )
            self._table_host = torch.empty(size, dtype=torch.int64, pin_memory=True)
            self._table_dev = torch.empty(size, dtype=torch.int64, device=self.device)
        host = self._table_host[: table.size].view(table.shape)
        host.numpy()[...] = table
        device = self._table_dev[: table.size].view(table.shape)
        device.copy_(host, non_blocking=True)
        return device

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
        if metadata.finished_requests:
            require(
                not metadata.requests.keys() & set(metadata.finished_requests),
                "auxiliary output request cannot run and finish in one step",
            )
        require(
            metadata.generation >= self._generation,
            "auxiliary output metadata generation moved backwards",
        )
        table = self._requests
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
                for row in table.index.values():
                    release_keys.extend(reversed(table.keys[row]))
                self._free(table.clear())
                self._generation = metadata.generation
            if metadata.requests:
                rows = self._scheduled_rows(metadata.requests)
                emit_starts = np.fromiter(metadata.requests.values(), np.int64, len(rows))
                ahead = emit_starts > table.emit[rows]
                if np.count_nonzero(ahead):
                    # Only settled requests count: in-flight steps lag the scheduler's view.
                    ahead &= table.pending[rows] == 0
                    require(not ahead.any(), "auxiliary output Scheduler emit cursor moved ahead")
            updated: list[int] = []
            if metadata.block_hashes:
                index, own_keys = table.index, table.keys
                keys, counts = block_keys_of_requests(metadata.block_hashes, self._generation)
                end = 0
                for request_id, count in zip(metadata.block_hashes, counts):
                    row = index[request_id]
                    own_keys[row] += keys[end : end + count]
                    end += count
                    updated.append(row)
                retain_keys += keys
            table.keys_added(updated)
            finished_now: list[str] = []
            for request_id in metadata.finished_requests:
                row = table.index[request_id]
                table.finished[row] = True
                if table.pending[row]:
                    continue
                finished_now.append(request_id)
                release_keys.extend(reversed(table.keys[row]))
            if updated or retain_keys or release_keys:
                self._publish(np.asarray(updated, np.int64), retain_keys, release_keys)
            if finished_now:
                self._teardown(finished_now)

    def _scheduled_rows(self, requests: dict[str, int]) -> np.ndarray:
        """Table rows (int64 ``[R]``) of the step's scheduled requests; new ones are added
        with their emit start. A steady decode batch repeats the last step's ids in order,
        which a list comparison in C recognises."""
        table = self._requests
        ids = list(requests)
        cached = self._scheduled_cache
        if cached is not None and cached[0] == table.version and cached[1] == ids:
            return cached[2]
        found = list(map(table.index.get, ids, repeat(-1)))
        if -1 in found:
            for at in [i for i, row in enumerate(found) if row < 0]:
                found[at] = table.add(ids[at], requests[ids[at]])
        rows = np.array(found, np.int64)
        self._scheduled_cache = (table.version, ids, rows)
        return rows

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
            rows = self._requests.rows(request_ids)
            positions = self._row_positions(input_batch, num_rows)
            first_blocks, table = self._plan_slots(rows, qsl, token_starts, positions is not None)
            step_info, staging = self._launch(
                num_reqs, qsl, token_starts, positions, first_blocks, table, num_rejected
            )
            pending = PendingStep(
                self,
                request_ids,
                rows,
                token_starts,
                qsl,
                first_blocks,
                table,
                step_info,
                staging,
                exact=positions is not None,
                ring=(self._step_count - 1) % self._max_concurrent_batches,
            )
            self._pending.append(pending)
            self._requests.pending[rows] += 1
        return pending

    def process_output(self, pending: PendingStep) -> dict[str, AuxRequestOutput]:
        """Consume one step after its copy event: outputs per request, blocks published.

        Teardown that ``begin_step`` deferred for requests in this step happens here.
        """
        table = self._requests
        with self._lock:
            try:
                outputs = self._commit(pending)
            finally:
                self._pending.remove(pending)
                rows = pending.rows
                table.pending[rows] -= 1
                finished = table.finished[rows]
                teardown: list[str] = []
                release_keys: list[str] = []
                if np.count_nonzero(finished):
                    done = np.flatnonzero((table.pending[rows] == 0) & finished).tolist()
                    teardown = [pending.request_ids[i] for i in done]
                    for i in done:
                        release_keys.extend(reversed(table.keys[int(rows[i])]))
            if teardown:
                self._publish(np.empty(0, np.int64), (), release_keys)
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
    def _row_positions(self, input_batch: Any, num_rows: int) -> torch.Tensor | None:
        """The batch's device ``positions [>= num_rows]`` (int64), or None without them."""
        positions = getattr(input_batch, "positions", None)
        if not isinstance(positions, torch.Tensor) or positions.dim() != 1:
            return None
        if positions.shape[0] < num_rows:
            raise ValueError(
                f"input_batch.positions has {positions.shape[0]} rows, the step has {num_rows}"
            )
        if positions.device != self.device or positions.dtype != torch.int64:
            positions = positions.to(self.device, torch.int64)
        return positions

    def _plan_slots(
        self, rows: np.ndarray, qsl: np.ndarray, token_starts: np.ndarray, exact: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """Give every request slots for the blocks its rows can land in.

        With ``exact`` (the device knows each row's true position) a request whose earlier
        step is still in flight may start below the scheduler's ``token_start`` (a rejected
        speculative suffix); its table then reaches down to the lowest possible start.
        Returns ``first_block [R]`` (int64) and ``slot_table [R, M]`` (int64, -1 = unmapped).
        """
        B = self.block_size
        table = self._requests
        if exact:
            cursor = table.cursor[rows]
            settled = np.where(cursor != NO_CURSOR, np.minimum(token_starts, cursor), token_starts)
            in_flight = np.minimum(token_starts, table.low[rows])
            low = np.where(table.pending[rows] > 0, in_flight, settled)
            table.low[rows] = low
        else:
            low = token_starts
        firsts = low // B
        lasts = (token_starts + np.diff(qsl) - 1) // B
        fresh = (table.cursor[rows] == NO_CURSOR) & (table.num_slots[rows] == 0)
        table.base[rows[fresh]] = firsts[fresh]
        need = lasts + 1 - table.base[rows] - table.num_slots[rows]
        grow = np.flatnonzero(need > 0)
        if grow.size:
            fresh_slots = self._store.allocate(int(need[grow].sum())).tolist()
            taken = 0
            for i in grow.tolist():
                count = int(need[i])
                table.extend_slots(int(rows[i]), fresh_slots[taken : taken + count])
                taken += count
        num_reqs = len(rows)
        width = int((lasts - firsts).max()) + 1 if num_reqs else 1
        slot_table = np.full((num_reqs, max(width, 1)), -1, dtype=np.int64)
        bases = table.base[rows]
        # Decode-like requests write only into their last unbound block: no list work.
        single = (lasts == firsts) & (lasts == bases + table.num_slots[rows] - 1)
        slot_table[single, 0] = table.tail[rows[single]]
        # Blocks below base are bound; a start there is an error process_output names.
        lows = np.maximum(firsts, bases)
        for i in np.flatnonzero(~single & (lasts >= lows)).tolist():
            row, lo, base, first = int(rows[i]), int(lows[i]), int(bases[i]), int(firsts[i])
            mapped = table.slots[row][lo - base : int(lasts[i]) + 1 - base]
            slot_table[i, lo - first : lo - first + len(mapped)] = mapped
        return firsts, slot_table

    def _launch(
        self,
        num_reqs: int,
        qsl: np.ndarray,
        token_starts: np.ndarray,
        positions: torch.Tensor | None,
        first_blocks: np.ndarray,
        table: np.ndarray,
        num_rejected: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, _StagingCopy | None]:
        if num_reqs == 0:
            return None, None
        qsl_dev = self._qsl_dev[: num_reqs + 1]
        qsl_dev.copy_(torch.from_numpy(qsl), non_blocking=True)
        if positions is not None:
            torch.index_select(positions, 0, qsl_dev[:-1], out=self._start_dev[:num_reqs])
        else:
            self._start_dev[:num_reqs].copy_(torch.from_numpy(token_starts), non_blocking=True)
        self._first_dev[:num_reqs].copy_(torch.from_numpy(first_blocks), non_blocking=True)
        staging = None
        # Without device positions rows land at the scheduler's start and a reattached
        # request's rows move on the host: the next step's kernel must not write the arena
        # before that happens, so such steps go through staging.
        if self._destination == "staging" or positions is None:
            ring = self._step_count % len(self._staging_ring())
            mapped = table >= 0
            num_blocks = int(mapped.sum())
            staging_table = np.full(table.shape, -1, dtype=np.int32)
            staging_table[mapped] = np.arange(num_blocks, dtype=np.int32)
            device_ring, host_ring = self._staging_ring(), self._staging_host_ring
            dest = device_ring[ring][:num_blocks]
            staging = _StagingCopy(
                device=dest,
                host=host_ring[ring][:num_blocks],
                first_blocks=first_blocks,
                staging_table=staging_table,
                arena_table=table,
            )
            kernel_table = staging_table
        else:
            dest = self._arena_rows_view()
            kernel_table = table
        slot_table = self._device_table(kernel_table)
        step_info = self._info_ring[self._step_count % len(self._info_ring)][:num_reqs]
        self._step_count += 1
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
            num_rows=int(qsl[-1]),
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

    def _gather_rows(self, index: np.ndarray) -> np.ndarray:
        """``[n, L, K]`` array of arena rows ``index`` (int64 ``[n]``) in memory it owns."""
        L, K = self.shape_per_token
        arena = self._store.arena_np
        rows = arena.reshape(arena.shape[0] * self.block_size, -1)
        if len(index) * rows.shape[1] < self._output_pool.min_nbytes:
            # Small: numpy's take has the lower fixed cost, and malloc serves mapped memory.
            return np.take(rows, index, axis=0).view(self.dtype).reshape(len(index), L, K)
        out = self._output_pool.empty((len(index), L, K), self.dtype)
        # torch copies each row with one memcpy; np.take(out=) goes element by element.
        torch.index_select(
            torch.from_numpy(rows),
            0,
            torch.from_numpy(index),
            out=torch.from_numpy(out.reshape(len(index), -1).view(np.uint8)),
        )
        return out

    def _commit(self, pending: PendingStep) -> dict[str, AuxRequestOutput]:
        B = self.block_size
        table = self._requests
        num_sampled, num_rejected = pending.num_sampled, pending.num_rejected
        require(
            num_sampled is not None and num_rejected is not None,
            "auxiliary output CPU copy was not enqueued",
        )
        rows = pending.rows
        num_reqs = len(rows)
        if num_reqs == 0:
            return {}
        if pending.staging is not None:
            self._unstage(pending)
        num_tokens = pending.num_tokens
        rejected = np.asarray(num_rejected[:num_reqs])
        sampled = np.asarray(num_sampled[:num_reqs])
        starts = pending.token_starts
        no_rejections = np.count_nonzero(rejected) == 0
        if not no_rejections:
            rejected = rejected.astype(np.int64, copy=False)
        accepted = num_tokens if no_rejections else num_tokens - rejected
        cursor = table.cursor[rows]
        if (
            _equal_ints(cursor, starts)
            and np.count_nonzero(num_tokens > 0) == num_reqs
            and (no_rejections or (rejected.min() >= 0 and accepted.min() >= 0))
        ):
            # Every request continues exactly at its cursor: no check below can fail.
            capture_starts = starts
        else:
            capture_starts = self._check_capture(pending, cursor, rejected, accepted)
        self._check_kernel(pending, capture_starts if pending.exact else starts, accepted)
        self._count_transfer(pending, pending.num_rows if no_rejections else None)
        if pending.exact:
            moved = np.empty(0, np.int64)
        else:
            moved = np.flatnonzero((accepted > 0) & (capture_starts != starts))
        rows_np = self._arena_rows_np() if moved.size else None
        for i in moved.tolist():
            # Rows were placed at the scheduler's optimistic start; they belong at the cursor.
            row, count = int(rows[i]), int(accepted[i])
            source = table.slot_rows(row, int(starts[i]), int(starts[i]) + count, B)
            target = table.slot_rows(row, int(capture_starts[i]), int(capture_starts[i]) + count, B)
            rows_np[target] = rows_np[source]
        token_ends = capture_starts + accepted
        emit_starts = table.emit[rows]
        table.cursor[rows] = token_ends
        # With nothing rejected at the scheduler's starts, the scheduled ends are the new cursors.
        settled = no_rejections and capture_starts is starts
        table.scheduled[rows] = token_ends if settled else starts + num_tokens
        if np.count_nonzero(sampled > 0) == num_reqs and _equal_ints(emit_starts, capture_starts):
            # Decode-like steps: every request emits exactly the rows it captured.
            table.emit[rows] = token_ends
            if no_rejections and moved.size == 0 and pending.num_rows == num_reqs:
                # Plain decode: one row per request, at its capture start (which is the
                # scheduler's start unless the request reattached after a rejection).
                outputs = self._emit_single_rows(pending, capture_starts)
                self._publish(rows, (), (), cursor=token_ends)
                return outputs
            direct = np.arange(num_reqs)
            materialize = direct[:0]
        else:
            emits = (sampled > 0) & (emit_starts <= token_ends)
            direct = (emits & (emit_starts >= capture_starts)).nonzero()[0]
            materialize = (emits & (emit_starts < capture_starts)).nonzero()[0]
            table.emit[rows[direct]] = token_ends[direct]

        # Copy emitted rows out before any slot can be bound (and later reused).
        outputs = self._emit(pending, direct, emit_starts, token_ends, moved)
        # Publish the whole step before materializing: a hit may need a block from it.
        self._publish(rows, (), (), cursor=token_ends)
        for i in materialize.tolist():
            row, emit_start, token_end = int(rows[i]), int(emit_starts[i]), int(token_ends[i])
            request_id = pending.request_ids[i]
            outputs[request_id] = AuxRequestOutput(
                emit_start, self._materialize(request_id, row, emit_start, token_end)
            )
            table.emit[row] = token_end
        return outputs

    def _check_capture(
        self, pending: PendingStep, cursor: np.ndarray, rejected: np.ndarray, accepted: np.ndarray
    ) -> np.ndarray:
        """Check a step the way vLLM's connector does; return each request's capture start.

        A request whose scheduler start lies past its cursor reattaches at the cursor (its
        optimistically scheduled suffix was rejected); the first request that fails a check,
        in vLLM's order of checks, names the error.
        """
        B = self.block_size
        num_tokens, starts = pending.num_tokens, pending.token_starts
        had_cursor = cursor != NO_CURSOR
        cursor = np.where(had_cursor, cursor, starts)
        reattach = starts > cursor
        capture_starts = np.where(reattach, cursor, starts)
        self._check_step(
            pending.request_ids,
            (
                (num_tokens <= 0, "auxiliary output request token count must be positive"),
                (
                    (rejected < 0) | (rejected > num_tokens),
                    "auxiliary output rejected-token count is invalid",
                ),
                (starts < cursor, "auxiliary output capture moved backwards"),
                (
                    reattach & (cursor >= self._requests.scheduled[pending.rows]),
                    "auxiliary output capture has an unbacked token gap",
                ),
                (
                    ~had_cursor & (accepted > 0) & (capture_starts % B != 0),
                    "auxiliary output capture is not contiguous: a request's first rows "
                    "must start on a hash-block boundary",
                ),
            ),
        )
        return capture_starts

    @staticmethod
    def _check_step(request_ids: Sequence[str], checks) -> None:
        masks = [mask for mask, _ in checks]
        if not np.logical_or.reduce(masks, axis=None):
            return
        failed = [mask for mask in masks if mask.any()]
        first = min(int(np.argmax(mask)) for mask in failed)
        for mask, message in checks:
            if mask[first]:
                raise AuxOutputProtocolError(f"{message}: request={request_ids[first]}")

    def _count_transfer(self, pending: PendingStep, num_written: int | None) -> None:
        """Add the step's device-to-host traffic to ``transfer_stats``; ``num_written`` is
        the kernel's total when already known (no rejections: every scheduled row)."""
        stats = self.transfer_stats
        stats["steps"] += 1
        if pending.staging is not None:
            # The staging copy moves whole slots.
            host = pending.staging.host
            stats["rows"] += host.shape[0] * host.shape[1]
            stats["bytes"] += host.numel() * host.element_size()
        elif pending.step_info is not None:
            # Direct writes: exactly the rows the kernel wrote (statuses already checked OK).
            # It writes at least the accepted rows and at most the scheduled ones, so with
            # nothing rejected the count is the step's row total.
            rows = int(pending.step_info[:, 1].sum()) if num_written is None else num_written
            L, K = self.shape_per_token
            stats["rows"] += rows
            stats["bytes"] += rows * L * K * self.dtype.itemsize

    def _check_kernel(
        self, pending: PendingStep, expected_starts: np.ndarray, accepted: np.ndarray
    ) -> None:
        info = pending.step_info
        if info is None:
            return
        bad = (info[:, 2] != 0) | (info[:, 0] != expected_starts) | (info[:, 1] < accepted)
        if np.count_nonzero(bad):
            i = int(np.argmax(bad))
            start, written, status = (int(x) for x in info[i])
            raise AuxOutputProtocolError(
                "auxiliary output rows were not placed by the capture kernel: "
                f"request={pending.request_ids[i]}, status={status}, start={start} "
                f"(expected {int(expected_starts[i])}), rows written={written} of "
                f"{int(accepted[i])} accepted; the device and host rejected counts must agree"
            )

    def _emit_single_rows(
        self, pending: PendingStep, starts: np.ndarray
    ) -> dict[str, AuxRequestOutput]:
        """Each request's one row at position ``starts[r]`` (int64 ``[R]``), in one gather."""
        num_reqs = len(starts)
        emitted = self._gather_rows(self._one_row_index(pending, None, starts))
        views = list(emitted.reshape(num_reqs, 1, *emitted.shape[1:]))
        return dict(zip(pending.request_ids, map(AuxRequestOutput, starts.tolist(), views)))

    def _one_row_index(
        self, pending: PendingStep, requests: np.ndarray | None, positions: np.ndarray
    ) -> np.ndarray:
        """Arena row (int64 ``[n]``) of position ``positions[j]`` of step request
        ``requests[j]``; ``requests=None`` means every request of the step, in order."""
        B = self.block_size
        if requests is None:
            requests, first_blocks = self._row_ids[: len(positions)], pending.first_blocks
        else:
            first_blocks = pending.first_blocks[requests]
        column = positions // B - first_blocks
        return pending.slot_table[requests, column] * B + positions % B

    def _emit(
        self,
        pending: PendingStep,
        direct: np.ndarray,
        emit_starts: np.ndarray,
        token_ends: np.ndarray,
        moved: np.ndarray,
    ) -> dict[str, AuxRequestOutput]:
        """Rows ``emit_start .. token_end`` of each ``direct`` request, in one gather."""
        if direct.size == 0:
            return {}
        B = self.block_size
        if len(direct) == len(emit_starts):
            starts, counts = emit_starts, token_ends - emit_starts
        else:
            starts = emit_starts[direct]
            counts = token_ends[direct] - starts
        uniform = counts.min() == counts.max()
        if moved.size == 0 and uniform and counts[0] == 1:
            # Decode steps: one row per request, no per-row expansion needed.
            index = self._one_row_index(pending, direct, starts)
            offsets = None
        else:
            offsets = np.zeros(len(direct) + 1, np.int64)
            np.cumsum(counts, out=offsets[1:])
            owner = np.repeat(direct, counts)
            position = np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1], counts)
            position += emit_starts[owner]
            column = position // B - pending.first_blocks[owner]
            # Rows of a moved request may lie below its step's table: look those up by request.
            unmoved = ~np.isin(owner, moved) if moved.size else slice(None)
            index = np.empty(len(owner), np.int64)
            index[unmoved] = (
                pending.slot_table[owner[unmoved], column[unmoved]] * B + position[unmoved] % B
            )
            for j in np.flatnonzero(np.isin(direct, moved)).tolist() if moved.size else ():
                i = int(direct[j])
                index[offsets[j] : offsets[j + 1]] = self._requests.slot_rows(
                    int(pending.rows[i]), int(starts[j]), int(token_ends[i]), B
                )
        # One gather: the outputs own their memory, whatever happens to the slots later.
        emitted = self._gather_rows(index)
        ids = pending.request_ids
        names = ids if len(direct) == len(ids) else [ids[i] for i in direct.tolist()]
        if uniform:
            # Every request emits the same number of rows: split with one reshape.
            views = list(emitted.reshape(len(direct), int(counts[0]), *emitted.shape[1:]))
        else:
            views = [emitted[a:b] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
        return dict(zip(names, map(AuxRequestOutput, starts.tolist(), views)))

    def _materialize(
        self, request_id: str, row: int, emit_start: int, token_end: int
    ) -> np.ndarray:
        """Rows ``emit_start .. token_end``: stored blocks, then the open block's rows.

        A missing stored block raises ``BlockObjectStoreError`` (fail closed).
        """
        B = self.block_size
        keys = self._requests.keys[row]
        stored_end = min(token_end // B, len(keys)) * B
        out = self._output_pool.empty((token_end - emit_start, *self.shape_per_token), self.dtype)
        read_from = emit_start
        if emit_start < stored_end:
            # A live request's keys were retained when its hashes arrived and are released
            # only at its teardown, so every key read here is referenced.
            slots = self._store.lookup_slots(keys[emit_start // B : stored_end // B], held=True)
            if emit_start % B == 0:
                # Whole blocks: one gather of block-sized rows straight into the output.
                blocks = out[: stored_end - emit_start].reshape(len(slots), -1).view(np.uint8)
                self._store.gather_into(slots, blocks)
            else:
                first = emit_start // B * B
                positions = np.arange(emit_start - first, stored_end - first, dtype=np.int64)
                out[: stored_end - emit_start] = self._arena_rows_np()[
                    slots[positions // B] * B + positions % B
                ]
            read_from = stored_end
        if read_from < token_end or read_from == emit_start:
            # Only the open (incomplete) block is readable outside the store, as in vLLM.
            open_start = token_end // B * B
            if token_end % B == 0 or read_from < open_start or read_from >= token_end:
                raise AuxOutputProtocolError(
                    "auxiliary output range is unavailable: "
                    f"request={request_id}, range=[{read_from}, {token_end}), "
                    f"available=[{open_start}, {token_end if token_end % B else open_start})"
                )
            index = self._requests.slot_rows(row, read_from, token_end, B)
            out[read_from - emit_start :] = self._arena_rows_np()[index]
        return out

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
        position = info[request, 0].astype(np.int64) + offset
        column = position // B - staging.first_blocks[request]
        within = position % B
        source = staging.staging_table[request, column].astype(np.int64) * B + within
        target = staging.arena_table[request, column].astype(np.int64) * B + within
        host_rows = staging.host.numpy().reshape(-1, L, K)
        self._arena_rows_np()[target] = host_rows[source]

    # ------------------------------------------------------------------ publication
    def _publish(
        self,
        rows: np.ndarray,
        retain_keys: Sequence[str],
        release_keys: Sequence[str],
        cursor: np.ndarray | None = None,
    ) -> None:
        """Bind every complete, keyed, unbound block of ``rows`` in one store call.

        ``cursor`` (int64 ``[len(rows)]``), when the caller has it, is ``table.cursor[rows]``.
        """
        table = self._requests
        keys: list[str] = []
        slots: list[int] = []
        if rows.size:
            if cursor is None:
                cursor = table.cursor[rows]
            bases = table.base[rows]
            # A request without a cursor (NO_CURSOR = -1) gets min(.., -1) - base < 0: none.
            ready = np.minimum(table.num_keys[rows], cursor // self.block_size) - bases
            chosen = (ready > 0).nonzero()[0]
            if chosen.size:
                rows, bases, ready = rows[chosen], bases[chosen], ready[chosen]
                own_keys, own_slots = table.keys, table.slots
                for row, base, count in zip(rows.tolist(), bases.tolist(), ready.tolist()):
                    keys += own_keys[row][base : base + count]
                    own = own_slots[row]
                    slots += own[:count]
                    del own[:count]
                table.handed_over(rows, ready)
        if keys or retain_keys or release_keys:
            self._store.bind(
                keys,
                np.asarray(slots, dtype=np.int64),
                retain_keys=retain_keys,
                release_keys=release_keys,
            )

    def _free(self, slots: list[int]) -> None:
        if slots:
            self._store.free(np.asarray(slots, dtype=np.int64))

    def _teardown(self, request_ids: Iterable[str]) -> None:
        slots: list[int] = []
        for request_id in request_ids:
            slots.extend(self._requests.remove(request_id))
        self._free(slots)
