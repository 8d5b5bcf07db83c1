"""The device half of the worker: slot ring, per-step inputs, the one kernel launch, copies back.

Per step, on the thread that launches the forward (no host synchronization, no allocation):

1. only when something changed since the last step (the batch's requests, or a request
   entering a new hash block) the host packs the step's table rows and the changed entries of
   the slot ring into one pinned buffer (one per step in flight); one asynchronous copy moves
   its used part (rounded up to a power of two) to the device and one scatter applies the
   ring entries. A steady decode step of a small batch usually changes nothing and skips
   both, and so does a step without requests;
2. one ``gather_pack`` launch, validated once at construction (``GatherPackLaunch``), reads
   the batch's own device ``query_start_loc`` and ``positions`` and writes every accepted
   row: straight into the pinned store arena (``direct``), or into device staging in
   step-row order (``staging``);
3. ``direct``: the kernel also writes its ``step_info`` straight into pinned host memory,
   so nothing is copied back; ``staging``: on the copy stream, ``step_info`` and the step's
   rows are copied back into pinned host buffers. Either way one buffer per step in flight.

Every view of those buffers is made once, so a step costs a handful of tensor operations.
The same operations run on a CPU device (there the "device" tensors are host tensors), so
the data flow the tests check is the one a GPU runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from r3capture.aux_output.errors import require
from r3capture.kernels import GatherPackLaunch, GatherPackShape, can_write_host_directly

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


def device_upload(
    dst: torch.Tensor,
    src: torch.Tensor,
    ring_flat: torch.Tensor,
    index: torch.Tensor | None,
    values: torch.Tensor | None,
) -> None:
    """The device work of one upload: copy the packed host buffer ``src`` into ``dst`` and,
    when ring entries changed, scatter ``values`` (int32) into ``ring_flat`` at ``index``
    (int64, distinct), both on the device. Two asynchronous launches on a GPU; CPU tensor
    operations on a CPU device, where ``bench/stand_ins.py`` counts them as launches like
    the kernel."""
    dst.copy_(src, non_blocking=True)
    if index is not None:
        ring_flat.scatter_(0, index, values)


# Distinct update counts whose upload views are kept (each holds two tensor views of the
# upload buffer and no data of its own).
_MAX_CACHED_COUNTS = 256


@dataclass(frozen=True)
class _UpdateViews:
    """What one upload of a given number of ring entries writes and copies: the copied
    prefix of the device buffer and its per-step pinned sources, the host slices of the
    int64 indices (int32 pairs) and values, and their device views (None for no entries)."""

    dst: torch.Tensor
    sources: list[torch.Tensor]
    index_host: slice
    values_host: slice
    index_dev: torch.Tensor | None
    values_dev: torch.Tensor | None


@dataclass
class LaunchedStep:
    """What one launch left in flight: its buffer index and whether its results are being
    copied back (``DeviceSide.copy_back``; ``DeviceSide.host_results`` reads them)."""

    ring_index: int
    num_reqs: int
    num_rows: int
    copied: bool = False


class DeviceSide:
    """Device buffers and the per-step launch of the capture kernel.

    Args:
        capture_buffer: the router hooks' int32 ``[max_num_batched_tokens, L, K]`` buffer.
        dtype: row dtype (uint8/uint16).
        block_size: hash block size ``B``.
        max_num_seqs: most requests per step.
        max_updates: most ring entries one step can change.
        depth: steps in flight (``max_concurrent_batches``).
        destination: ``direct`` or ``staging`` (see ``pick_destination``).
        kernel_impl: ``auto`` | ``triton`` | ``reference``.

    ``attach(ring, arena_blocks)`` must be called before the first launch and whenever the
    request table or the store arena is replaced.
    """

    def __init__(
        self,
        *,
        capture_buffer: torch.Tensor,
        dtype: np.dtype,
        block_size: int,
        max_num_seqs: int,
        max_updates: int,
        depth: int,
        destination: str,
        kernel_impl: str,
    ) -> None:
        self.capture_buffer = capture_buffer
        self.device = capture_buffer.device
        self.dtype = np.dtype(dtype)
        self.block_size = block_size
        self.destination = destination
        self._kernel_impl = kernel_impl
        self._depth = depth
        self._max_seqs = max_num_seqs
        self._max_updates = max_updates
        self._next = 0
        on_cuda = self.device.type == "cuda"
        # int32 upload: the step's table rows [max_num_seqs], then (from an even offset)
        # the n changed ring entries' flat indices as int64 [n] (2n int32) and their values
        # [n], packed (n <= max_updates). int64 indices let one scatter_ apply them:
        # index_put_ with int32 ones cost 24 µs of host CPU a call on the H200 against
        # scatter_'s 8-12 (bench/results/gpu/run3_85cfc84/gpu_parts.json).
        self._index_at = max_num_seqs + (max_num_seqs & 1)
        size = self._index_at + 3 * max_updates
        self._upload_host = [
            torch.zeros(size, dtype=torch.int32, pin_memory=on_cuda) for _ in range(depth)
        ]
        self._upload_np = [t.numpy() for t in self._upload_host]
        self._upload_dev = torch.zeros(size, dtype=torch.int32, device=self.device)
        self._table_row_dev = self._upload_dev[:max_num_seqs]
        # An upload copies the shortest of these prefixes that holds its entries: powers of
        # two from the table rows' size up, then the whole buffer (sized for every request
        # taking slots at once: 160 KiB at 1,024 sequences, where a step uses a few KiB).
        # Entry i is the prefix of min(2 ** (first + i), size) entries, for uploads of n
        # entries with (n - 1).bit_length() == first + i, where first is that of
        # max_num_seqs (n is at least the table rows' max_num_seqs, so i >= 0).
        self._prefix_bits = (max_num_seqs - 1).bit_length()
        self._upload_prefixes = [
            (self._upload_dev[:length], [t[:length] for t in self._upload_host])
            for length in (
                min(1 << bits, size)
                for bits in range(self._prefix_bits, (size - 1).bit_length() + 1)
            )
        ]
        # The views one upload of n ring entries uses, made at the first upload of each n and
        # reused: decode and prefill steps repeat a few counts, and each tensor operation a
        # step makes costs the main thread far more than alone (its code is cold after the
        # forward; bench/RESULTS.md, "One set of upload views per count").
        self._update_views: dict[int, _UpdateViews] = {}
        self._uploaded_rows: np.ndarray | None = None
        self._info_host = [
            torch.zeros((max_num_seqs, 3), dtype=torch.int32, pin_memory=on_cuda)
            for _ in range(depth)
        ]
        # Direct writes put step_info where the host reads it, as they do the rows: one copy
        # launch less on the main thread (10-12 µs of host CPU a copy on the H200,
        # bench/RESULTS.md "On a GPU"); kernel_bench's pinned provider measured this layout.
        self._info_dev = (
            self._info_host
            if destination == "direct"
            else [
                torch.zeros((max_num_seqs, 3), dtype=torch.int32, device=self.device)
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
                self._staging_dev.append(torch.empty(shape, dtype=torch_dtype, device=self.device))
                self._staging_host.append(torch.empty(shape, dtype=torch_dtype, pin_memory=on_cuda))
        self._ring_flat: torch.Tensor | None = None
        self._launches: list[GatherPackLaunch] = []
        # What crossed (or, on a CPU, would cross) from the device to the host, cumulative.
        self.transfer_stats = {"steps": 0, "rows": 0, "bytes": 0}
        L, K = capture_buffer.shape[1:]
        self._row_nbytes = L * K * self.dtype.itemsize

    def attach(self, ring_host: np.ndarray, arena_blocks: torch.Tensor) -> None:
        """(Re)build the device ring from ``ring_host``, int32 ``[rows, D + 2]`` (slots, then
        each row's block window: ``RequestTable.device_ring()``), and the launches for the
        store arena ``[slots, B, L, K]``: at start, and when either is replaced (the request
        table or the store grew)."""
        ring = torch.from_numpy(ring_host).to(self.device, copy=True)
        width = ring.shape[1] - 2
        self._ring_flat = ring.view(-1)
        staging = self.destination == "staging"
        self._launches = [
            GatherPackLaunch(
                self.capture_buffer,
                self._table_row_dev,
                ring[:, :width],
                ring[:, width:],
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
        and the store's host arena): the slot ring with its windows, the upload buffer and, for
        ``staging``, each step's ``step_info`` and staging rows."""
        buffers = [self._upload_dev, *self._staging_dev]
        if self.destination == "staging":
            buffers += self._info_dev
        if self._ring_flat is not None:
            buffers.append(self._ring_flat)
        return sum(t.numel() * t.element_size() for t in buffers)

    def check_step(
        self,
        query_start_loc: object,
        positions: object,
        num_rejected: object,
        *,
        num_reqs: int,
        num_rows: int,
    ) -> GatherPackShape:
        """The kernel's checks of one step's device inputs (``GatherPackArgumentError`` names
        a bad one), made before anything changes; ``launch`` then repeats none of them."""
        return self._launches[self._next].check_step(
            query_start_loc, positions, num_rejected, num_reqs=num_reqs, num_rows=num_rows
        )

    def launch(
        self,
        *,
        table_row: np.ndarray,
        ring_updates: tuple[np.ndarray, np.ndarray] | None,
        shape: GatherPackShape | None,
        query_start_loc: torch.Tensor | None,
        positions: torch.Tensor | None,
        num_rejected: torch.Tensor | None,
        num_rows: int,
    ) -> LaunchedStep:
        """Bring the device's table rows and slot ring up to date, then launch the kernel.

        ``table_row`` [R] int64 (numpy); ``ring_updates``: (flat ring index, value) int64
        arrays, or None; ``shape``: what ``check_step`` returned for the batch's device
        ``query_start_loc``, ``positions`` and ``num_rejected`` (None for a step without
        requests).
        """
        num_reqs = len(table_row)
        index = self._next
        self._next = (index + 1) % self._depth
        # A step without requests launches nothing, so the device needs none of its rows.
        if ring_updates is not None or (num_reqs and table_row is not self._uploaded_rows):
            self._upload(index, table_row, ring_updates)
        step = LaunchedStep(index, num_reqs, num_rows)
        if num_reqs:
            self._launches[index].launch_checked(shape, query_start_loc, positions, num_rejected)
        return step

    def _upload(
        self,
        index: int,
        table_row: np.ndarray,
        ring_updates: tuple[np.ndarray, np.ndarray] | None,
    ) -> None:
        flat, values = ring_updates if ring_updates is not None else ((), ())
        num_updates = len(flat)
        views = self._update_views.get(num_updates)
        if views is None:
            views = self._views_for(num_updates)
        host = self._upload_np[index]
        host[: len(table_row)] = table_row
        if num_updates:
            host[views.index_host].view(np.int64)[:] = flat
            host[views.values_host] = values
        self._uploaded_rows = table_row
        device_upload(
            views.dst, views.sources[index], self._ring_flat, views.index_dev, views.values_dev
        )

    def _views_for(self, num_updates: int) -> _UpdateViews:
        """The views of an upload of ``num_updates`` ring entries (made once per count)."""
        if num_updates > self._max_updates:
            raise OverflowError(f"{num_updates} slot-ring updates exceed {self._max_updates}")
        at = self._index_at
        values_at = at + 2 * num_updates
        end = values_at + num_updates if num_updates else self._max_seqs
        dst, sources = self._upload_prefixes[(end - 1).bit_length() - self._prefix_bits]
        dev = self._upload_dev
        views = _UpdateViews(
            dst=dst,
            sources=sources,
            index_host=slice(at, values_at),
            values_host=slice(values_at, values_at + num_updates),
            index_dev=dev[at:values_at].view(torch.int64) if num_updates else None,
            values_dev=dev[values_at:end] if num_updates else None,
        )
        if len(self._update_views) >= _MAX_CACHED_COUNTS:
            self._update_views.clear()
        self._update_views[num_updates] = views
        return views

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
        event completes (output thread): ``step_info`` int32 ``[R, 3]`` and, for
        ``staging``, the step's rows ``[num_rows, L, K]`` (else None)."""
        # Never stale buffers in place of a copy: the commit checks the kernel's results.
        require(step.copied, "auxiliary output CPU copy was not enqueued")
        index = step.ring_index
        staged = None
        if self.destination == "staging" and step.num_rows:
            staged = self._staging_host[index][: step.num_rows].numpy()
        return self._info_np[index][: step.num_reqs], staged

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
