"""Gather each request's accepted routed-experts rows and pack them into block-aligned slots.

One launch per engine step, after rejection sampling, with no host synchronization. Request
r's rows sit at token positions ``positions[qsl[r]] + i`` (the device's own positions, so a
request that reattached below the scheduler's view after a rejected speculative suffix is
placed correctly); the row of position ``p`` lands at ``dest[slot, p % B]`` with
``slot = slot_table[table_row[r], (p // B) % W]``, cast to ``dest``'s dtype, so every
complete hash block comes out whole and contiguous in its slot. The slot table is a ring
per request, with the window of blocks the request may write beside it; the host keeps both
on the device and updates only the rows of requests that enter a new block, so a decode
step needs no per-step table at all. ``dest`` is the pinned host
arena itself (the kernel's stores cross PCIe directly) or, where a GPU cannot write host
memory, device staging in step-row order that the host places with the same table.

Work split: one 1-D grid of max(cdiv(num_rows bound, BLOCK_ROWS), cdiv(R, BLOCK_REQS))
programs (host-known bounds, so a CUDA graph can be captured at the maximum sizes; rows past
``query_start_loc[R]`` are masked); every program does two independent jobs:
  * request tile ``pid``: validates ``BLOCK_REQS`` requests and writes their ``step_info``
    row (start, accepted, status), so the host never derives anything per row;
  * row tile ``pid``: ``BLOCK_ROWS`` consecutive capture rows, each mapped to its request by
    a vectorized binary search over ``query_start_loc`` (log2(R) steps), columns L*K padded
    to a power of two.
Failing closed needs a request's status before any of its rows is written, and a request's
rows may span many row tiles; programs of one launch cannot wait for each other, so every
row tile recomputes the status of the requests it touches (once per request: only the
request's first row in the tile scans its slot-table range, up to 512 columns per load).
The redundant reads hit L2 and grow as rows^2 / (BLOCK_ROWS * B): ~2 MB for one 8192-row
request at B=16, against ~16 MB of rows moved.

Naming: ``o_`` offsets, ``m_`` masks, ``p_`` pointers, ``b_`` loaded blocks; sizes in
lower case, compile-time block sizes in UPPER case.
"""

from __future__ import annotations

import importlib

import torch
import triton
import triton.language as tl

from r3capture.kernels._common import (
    STATUS_BAD_BLOCK,
    STATUS_BAD_REJECTED,
    STATUS_BAD_ROWS,
    STATUS_OK,
    GatherPackShape,
    check_static_args,
    check_step_args,
)
from r3capture.kernels._device import can_write_host_directly, kernel_address

# Row tiles of at most 8 rows x ~4096 elements keep every specialization at ~140-167
# registers with no spills on sm_80/sm_90 (ptxas -v; 16 or 32 rows spill for narrow rows).
# The slot-table scans use tiles of the same shape, so a long prefill chunk's range (513
# columns for 8192 rows at B=16) takes two dependent loads rather than a long loop of them.
_TILE_ELEMS = 4096
_MAX_BLOCK_ROWS = 8
_MAX_SCAN = 512
_NUM_WARPS = 4

# Kernels may only read globals that are constexpr.
_OK = tl.constexpr(STATUS_OK)
_BAD_REJECTED = tl.constexpr(STATUS_BAD_REJECTED)
_BAD_BLOCK = tl.constexpr(STATUS_BAD_BLOCK)
_BAD_ROWS = tl.constexpr(STATUS_BAD_ROWS)


@triton.jit
def _qsl_is_sane(qsl_ptr, num_reqs, SCAN: tl.constexpr):
    """True when qsl[0] >= 0 and qsl[0..num_reqs] never decreases.

    Rows are mapped to requests by a binary search that is only meaningful on a sorted
    query_start_loc; anything else fails every request of the step. Every program checks
    all of it (num_reqs / SCAN loads of an array that stays in L2).
    """
    num_bad = (tl.load(qsl_ptr).to(tl.int64) < 0).to(tl.int32)
    c0 = num_reqs * 0
    while c0 < num_reqs:  # not range(): see _any_bad_slot
        o_q = c0 + tl.arange(0, SCAN)
        m_q = o_q < num_reqs
        b_lo = tl.load(qsl_ptr + o_q, mask=m_q, other=0)
        b_hi = tl.load(qsl_ptr + o_q + 1, mask=m_q, other=0)
        num_bad += tl.sum((m_q & (b_hi < b_lo)).to(tl.int32), axis=0)
        c0 += SCAN
    return num_bad == 0


@triton.jit
def _request_fields(
    o_r,
    m_r,
    qsl_ptr,
    pos_ptr,
    table_row_ptr,
    window_ptr,
    rejected_ptr,
    qsl_sane,
    row_limit,
    num_table_rows,
    ring_width,
    stride_window_r,
    HAS_REJECTED: tl.constexpr,
    HASH_BLOCK: tl.constexpr,
):
    """Per-request values and every status check except the slot-table scan. [N] each."""
    q_begin = tl.load(qsl_ptr + o_r, mask=m_r, other=0).to(tl.int64)
    q_end = tl.load(qsl_ptr + o_r + 1, mask=m_r, other=0).to(tl.int64)
    num_sched = q_end - q_begin
    if HAS_REJECTED:
        rejected = tl.load(rejected_ptr + o_r, mask=m_r, other=0).to(tl.int64)
    else:
        rejected = tl.zeros_like(num_sched)
    accepted = num_sched - rejected
    bad_rows = ~qsl_sane | (q_end > row_limit)
    # The first row's device position is the request's start (async scheduling may place it
    # below the scheduler's view after a rejected speculative suffix).
    readable = m_r & ~bad_rows & (num_sched > 0)
    start = tl.load(pos_ptr + q_begin, mask=readable, other=-1).to(tl.int64)
    table_row = tl.load(table_row_ptr + o_r, mask=m_r, other=-1).to(tl.int64)
    row_ok = (table_row >= 0) & (table_row < num_table_rows)
    p_window = window_ptr + table_row * stride_window_r
    block_lo = tl.load(p_window, mask=m_r & row_ok, other=0).to(tl.int64)
    block_hi = tl.load(p_window + 1, mask=m_r & row_ok, other=-1).to(tl.int64)

    bad_rejected = (rejected < 0) | (rejected > num_sched)
    needs_blocks = m_r & ~bad_rows & ~bad_rejected & (accepted > 0)
    # Clamped so the divisions below never see a negative position (C and Python disagree).
    safe_start = tl.maximum(start, 0)
    first = safe_start // HASH_BLOCK
    last = (safe_start + accepted - 1) // HASH_BLOCK
    bad_range = (start < 0) | (first < block_lo) | (last > block_hi)
    bad_table = ~row_ok | (block_hi - block_lo >= ring_width)
    bad_block = needs_blocks & (bad_range | bad_table)
    status = tl.where(
        bad_rows,
        _BAD_ROWS,
        tl.where(bad_rejected, _BAD_REJECTED, tl.where(bad_block, _BAD_BLOCK, 0)),
    )
    num_cols = tl.where(needs_blocks & ~bad_block, last - first + 1, 0)
    return q_begin, q_end, start, table_row, accepted, status, first, num_cols


@triton.jit
def _any_bad_slot(
    table_row,
    first,
    num_cols,
    table_ptr,
    stride_table_r,
    ring_width,
    num_slots,
    SCAN: tl.constexpr,
):
    """[N] bool: the slot of some block first .. first+num_cols-1 (column block % ring_width
    of row table_row) lies outside [0, num_slots)."""
    bad = num_cols < 0
    max_cols = tl.max(num_cols, axis=0)
    # num_cols <= ring_width (the window fits the ring), so a column wraps at most once:
    # one compare instead of a 64-bit modulo per element of the [N, SCAN] tile.
    # Columns fit in int32 (ring_width is an int32 argument).
    first_col = (first % ring_width).to(tl.int32)
    p_row = table_ptr + table_row * stride_table_r
    c0 = max_cols * 0
    # A while loop: Triton 3.6's interpreter (with numpy >= 2.4) cannot use a runtime value
    # as a range() bound; compiled, it is the same short loop.
    while c0 < max_cols:
        o_c = c0.to(tl.int32) + tl.arange(0, SCAN)
        m_c = o_c[None, :] < num_cols[:, None]  # [N, SCAN]
        col = first_col[:, None] + o_c[None, :]
        col = tl.where(col >= ring_width, col - ring_width, col)
        p_slot = p_row[:, None] + col
        b_slot = tl.load(p_slot, mask=m_c, other=0)
        b_bad = m_c & ((b_slot < 0) | (b_slot >= num_slots))
        bad = bad | (tl.max(b_bad.to(tl.int32), axis=1) > 0)
        c0 += SCAN
    return bad


# Nothing that changes from step to step specializes the kernel (neither the sizes nor the
# alignment of the per-step pointers), so a launcher's variant depends only on its static
# arguments and the per-step dtypes: what lets ``GatherPackLaunch`` skip Triton's binding.
@triton.jit(
    do_not_specialize=[
        "num_reqs", "row_limit", "num_slots", "num_table_rows", "ring_width", "num_steps",
        "stride_table_r", "stride_window_r", "stride_info_r",
    ],
    do_not_specialize_on_alignment=["qsl_ptr", "pos_ptr", "rejected_ptr"],
)  # fmt: skip
def _gather_pack_kernel(
    # pointers
    capture_ptr,
    qsl_ptr,
    pos_ptr,
    table_row_ptr,
    table_ptr,
    window_ptr,
    rejected_ptr,
    dest_ptr,
    info_ptr,
    # sizes
    num_reqs,
    row_limit,
    num_slots,
    num_table_rows,
    ring_width,
    num_steps,
    # strides, in elements
    stride_table_r,
    stride_window_r,
    stride_dest,
    stride_info_r,
    # meta
    ROW_ELEMS: tl.constexpr,
    HASH_BLOCK: tl.constexpr,
    HAS_REJECTED: tl.constexpr,
    ROWS_LAYOUT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_REQS: tl.constexpr,
    SCAN_REQS: tl.constexpr,
    SCAN_ROWS: tl.constexpr,
):
    i_p = tl.program_id(0).to(tl.int64)
    qsl_sane = _qsl_is_sane(qsl_ptr, num_reqs, SCAN_REQS)

    # Job 1: step_info for requests [i_p * BLOCK_REQS, (i_p + 1) * BLOCK_REQS).
    if i_p * BLOCK_REQS < num_reqs:
        o_r = i_p * BLOCK_REQS + tl.arange(0, BLOCK_REQS)
        m_r = o_r < num_reqs
        _, _, start, table_row, accepted, status, first, num_cols = _request_fields(
            o_r, m_r, qsl_ptr, pos_ptr, table_row_ptr, window_ptr, rejected_ptr, qsl_sane,
            row_limit, num_table_rows, ring_width, stride_window_r, HAS_REJECTED, HASH_BLOCK,
        )  # fmt: skip
        bad_slot = _any_bad_slot(
            table_row, first, num_cols, table_ptr, stride_table_r, ring_width, num_slots,
            SCAN_REQS,
        )  # fmt: skip
        status = tl.where(bad_slot, _BAD_BLOCK, status)
        accepted = tl.where(status == _OK, accepted, -1)
        p_info = info_ptr + o_r * stride_info_r
        tl.store(p_info, start.to(tl.int32), mask=m_r)
        tl.store(p_info + 1, accepted.to(tl.int32), mask=m_r)
        tl.store(p_info + 2, status.to(tl.int32), mask=m_r)

    # Job 2: capture rows [i_p * BLOCK_ROWS, (i_p + 1) * BLOCK_ROWS) of the step.
    num_rows = tl.minimum(tl.load(qsl_ptr + num_reqs).to(tl.int64), row_limit)
    row_start = i_p * BLOCK_ROWS
    if qsl_sane & (row_start < num_rows):
        o_t = row_start + tl.arange(0, BLOCK_ROWS)
        m_t = o_t < num_rows
        # Largest r in [0, num_reqs) with qsl[r] <= t; invariant: answer in [lo, hi).
        lo = tl.zeros([BLOCK_ROWS], dtype=tl.int64)
        hi = tl.zeros([BLOCK_ROWS], dtype=tl.int64) + num_reqs
        step = num_steps * 0
        while step < num_steps:  # not range(): see _any_bad_slot
            mid = (lo + hi) // 2
            m_mid = m_t & (hi - lo > 1)
            b_mid = tl.load(qsl_ptr + mid, mask=m_mid, other=0).to(tl.int64)
            go_right = b_mid <= o_t
            lo = tl.where(m_mid & go_right, mid, lo)
            hi = tl.where(m_mid & ~go_right, mid, hi)
            step += 1
        o_r = lo
        q_begin, q_end, start, table_row, accepted, status, first, num_cols = (
            _request_fields(
                o_r, m_t, qsl_ptr, pos_ptr, table_row_ptr, window_ptr, rejected_ptr,
                qsl_sane, row_limit, num_table_rows, ring_width, stride_window_r, HAS_REJECTED,
                HASH_BLOCK,
            )
        )  # fmt: skip
        owned = m_t & (q_begin <= o_t) & (o_t < q_end)
        # The first row of each request inside this tile scans that request's slot range.
        leader = owned & ((o_t == q_begin) | (o_t == row_start))
        bad_slot = _any_bad_slot(
            table_row, first, tl.where(leader, num_cols, 0), table_ptr, stride_table_r,
            ring_width, num_slots, SCAN_ROWS,
        )  # fmt: skip
        same_req = (o_r[:, None] == o_r[None, :]) & (leader & bad_slot)[None, :]
        bad_slot = tl.max(same_req.to(tl.int32), axis=1) > 0  # [BLOCK_ROWS], from the leader

        i_row = o_t - q_begin
        write = owned & (status == _OK) & ~bad_slot & (i_row < accepted)
        pos = tl.where(write, start + i_row, 0)
        col = (pos // HASH_BLOCK) % ring_width
        b_slot = tl.load(table_ptr + table_row * stride_table_r + col, mask=write, other=0)
        b_slot = b_slot.to(tl.int64)
        # Already implied by status == OK; repeated per row so that no bug in the status
        # logic can ever turn into a store outside the arena.
        write = write & (b_slot >= 0) & (b_slot < num_slots)

        o_e = tl.arange(0, BLOCK_COLS)
        m_e = o_e < ROW_ELEMS
        m_tile = write[:, None] & m_e[None, :]  # [BLOCK_ROWS, BLOCK_COLS]
        p_src = capture_ptr + o_t[:, None] * ROW_ELEMS + o_e[None, :]
        b_rows = tl.load(p_src, mask=m_tile, other=0)
        if ROWS_LAYOUT:
            dst_row = o_t * stride_dest
        else:
            dst_row = b_slot * stride_dest + (pos % HASH_BLOCK) * ROW_ELEMS
        p_dst = dest_ptr + dst_row[:, None] + o_e[None, :]
        tl.store(p_dst, b_rows.to(dest_ptr.dtype.element_ty), mask=m_tile)


def _tile_config(row_elems: int) -> dict[str, int]:
    """Compile-time block sizes for rows of ``row_elems`` = L*K elements."""
    block_cols = triton.next_power_of_2(row_elems)
    block_rows = max(1, min(_MAX_BLOCK_ROWS, _TILE_ELEMS // block_cols))
    scan = min(_MAX_SCAN, _TILE_ELEMS // block_rows)
    # Request tiles mirror row tiles: same [N, SCAN] scan shape, same register budget.
    return {
        "BLOCK_ROWS": block_rows,
        "BLOCK_COLS": block_cols,
        "BLOCK_REQS": block_rows,
        "SCAN_REQS": scan,
        "SCAN_ROWS": scan,
    }


# The kernel arguments that change from step to step, in the order launch_checked passes them.
_STEP_ARGS = (
    "qsl_ptr", "pos_ptr", "rejected_ptr", "num_reqs", "row_limit", "num_steps", "HAS_REJECTED",
)  # fmt: skip


# Triton releases whose compiled-kernel launch interface (``CompiledKernel.run`` with
# ``packed_metadata`` and the two launch hooks) the direct launch is tested on: the pinned
# 3.7 and the GPU image's 3.6. Any other release launches through Triton's JIT.
DIRECT_LAUNCH_TRITON = ("3.6", "3.7")


def direct_launch_supported(version: str | None = None) -> bool:
    """Whether ``GatherPackLaunch`` may launch compiled variants itself on Triton ``version``
    (default: the installed one); elsewhere every launch goes through Triton's JIT."""
    version = triton.__version__ if version is None else version
    return ".".join(version.split(".")[:2]) in DIRECT_LAUNCH_TRITON


def _interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1, as Triton reads it)."""
    return bool(triton.knobs.runtime.interpret)


class GatherPackLaunch:
    """``gather_pack`` with its step-independent arguments validated once.

    The per-step hot path: the capture buffer, the table-row buffer (sized for the largest
    step), the slot table and block windows, ``dest`` and ``step_info`` are checked at
    construction; each call checks only what changes (``query_start_loc``, ``positions``,
    ``num_rejected``, the counts) and launches (on a GPU, after the first launch of each
    per-step dtype combination, the compiled variant directly, without Triton's binding).
    Same arguments, layouts and guarantees as ``gather_pack``.
    """

    def __init__(
        self,
        capture: torch.Tensor,
        table_row: torch.Tensor,
        slot_table: torch.Tensor,
        block_window: torch.Tensor,
        dest: torch.Tensor,
        step_info: torch.Tensor,
        *,
        hash_block: int | None = None,
        num_slots: int | None = None,
        impl: str = "auto",
    ) -> None:
        if impl not in ("auto", "triton", "reference"):
            raise ValueError(
                f"gather_pack: impl must be 'auto', 'triton' or 'reference'; got {impl!r}"
            )
        self._args = dict(
            capture=capture,
            table_row=table_row,
            slot_table=slot_table,
            block_window=block_window,
            dest=dest,
            step_info=step_info,
        )
        self._static = check_static_args(**self._args, hash_block=hash_block, num_slots=num_slots)
        self._use_triton = impl == "triton" or (
            impl == "auto" and (capture.is_cuda or _interpreting())
        )
        if not self._use_triton:
            # Imported here, not at the top: the kernel code never depends on its oracle. The
            # module, not the function, is kept, so a stand-in patched onto it still applies.
            self._reference = importlib.import_module("r3capture.kernels.reference")
        if self._use_triton:
            _check_triton_places(capture, dest, step_info)
            self._tiles = _tile_config(self._static.num_layers * self._static.top_k)
            self._kernel_args = dict(
                capture_ptr=capture,
                table_row_ptr=table_row,
                table_ptr=slot_table,
                window_ptr=block_window,
                dest_ptr=dest,
                info_ptr=step_info,
                num_slots=self._static.num_slots,
                num_table_rows=slot_table.shape[0],
                ring_width=slot_table.shape[1],
                stride_table_r=slot_table.stride(0),
                stride_window_r=block_window.stride(0),
                stride_dest=dest.stride(0),
                stride_info_r=step_info.stride(0),
                ROW_ELEMS=self._static.num_layers * self._static.top_k,
                HASH_BLOCK=self._static.hash_block,
                ROWS_LAYOUT=self._static.rows_layout,
                num_warps=_NUM_WARPS,
                **self._tiles,
            )
            # The kernel variant Triton's JIT picked for each per-step dtype combination
            # (query_start_loc, positions, num_rejected or None), launched directly after
            # its first launch; none under the interpreter, which compiles nothing, nor on a
            # Triton whose launch interface the direct launch was not tested on.
            self._variants: dict[tuple, object] | None = None
            if not _interpreting():
                self._device_index = capture.device.index
                active = triton.runtime.driver.active
                self._current_device = active.get_current_device
                self._current_stream = active.get_current_stream
            if not _interpreting() and direct_launch_supported():
                self._variants = {}
                names = _gather_pack_kernel.arg_names
                # The step-independent tensors go to compiled variants as kernel addresses,
                # resolved once: Triton's launcher would otherwise call data_ptr() and ask
                # the driver for each of them on every launch.
                addresses = {
                    name: kernel_address(value)
                    for name, value in self._kernel_args.items()
                    if isinstance(value, torch.Tensor)
                }
                self._positional = [
                    addresses.get(name, self._kernel_args.get(name)) for name in names
                ]
                self._step_slots = tuple(names.index(name) for name in _STEP_ARGS)

    @property
    def step_info(self) -> torch.Tensor:
        """The ``[>= R, 3]`` int32 tensor each launch writes ``(start, accepted, status)`` to."""
        return self._args["step_info"]

    def check_step(
        self,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        num_rejected: torch.Tensor | None = None,
        *,
        num_reqs: int | None = None,
        num_rows: int | None = None,
    ) -> GatherPackShape:
        """Validate one step's arguments (see ``__call__``) without launching; raises
        ``GatherPackArgumentError`` naming the argument."""
        return check_step_args(
            self._static,
            query_start_loc=query_start_loc,
            positions=positions,
            num_rejected=num_rejected,
            num_reqs=num_reqs,
            num_rows=num_rows,
        )

    def __call__(
        self,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        num_rejected: torch.Tensor | None = None,
        *,
        num_reqs: int | None = None,
        num_rows: int | None = None,
    ) -> None:
        """Launch for one step: ``query_start_loc`` [>= R+1], ``positions`` [>= num_rows],
        ``num_rejected`` [>= R] or None; ``num_reqs`` None means ``len(query_start_loc)-1``."""
        shape = self.check_step(
            query_start_loc, positions, num_rejected, num_reqs=num_reqs, num_rows=num_rows
        )
        self.launch_checked(shape, query_start_loc, positions, num_rejected)

    def launch_checked(
        self,
        shape: GatherPackShape,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        num_rejected: torch.Tensor | None,
    ) -> None:
        """Launch with arguments ``check_step`` returned ``shape`` for (no checks repeated)."""
        if not self._use_triton:
            args = dict(
                self._args,
                query_start_loc=query_start_loc,
                positions=positions,
                num_rejected=num_rejected,
            )
            self._reference.gather_pack_reference_checked(args, shape)
            return
        if shape.num_reqs == 0:
            return
        capture = self._args["capture"]
        tiles = self._tiles
        # Ceiling divisions in plain ints: triton.cdiv is a constexpr function, slow to call
        # on the host (bench.run triton_launch).
        grid = (
            max(
                -(-shape.row_limit // tiles["BLOCK_ROWS"]),
                -(-shape.num_reqs // tiles["BLOCK_REQS"]),
            ),
        )
        # Without num_rejected the pointer is never read (HAS_REJECTED is constexpr False);
        # any valid pointer keeps the signature, and so the compiled variants, the same.
        rejected = num_rejected if num_rejected is not None else self._args["table_row"]
        step_args = (
            query_start_loc,
            positions,
            rejected,
            shape.num_reqs,
            shape.row_limit,
            (shape.num_reqs - 1).bit_length(),
            num_rejected is not None,
        )
        if capture.is_cuda and self._current_device() != self._device_index:
            # Entering and leaving the device context is measurable host CPU per launch on a
            # GPU; vLLM's threads already run on the capture buffer's device.
            with torch.cuda.device(capture.device):
                self._launch_triton(grid, step_args)
        else:
            self._launch_triton(grid, step_args)

    def _launch_triton(self, grid: tuple[int], step_args: tuple) -> None:
        """Launch with ``step_args`` (``_STEP_ARGS``' values). The first launch of each
        per-step dtype combination goes through Triton's JIT, which binds and specializes
        every argument, compiles or finds the variant, and launches it; later ones launch
        that variant directly, with the same arguments (the step-independent tensors as
        their kernel addresses) on the current stream, skipping most of the JIT's host CPU
        per launch (``bench.run triton_launch``; the JIT's choice cannot differ, as nothing
        per-step specializes the kernel; a Triton knob that changes how it compiles, such as
        ``debug``, is read by each variant's first launch only)."""
        variants = self._variants
        key = None
        if variants is not None:
            query_start_loc, positions, rejected = step_args[:3]
            key = (query_start_loc.dtype, positions.dtype, rejected.dtype, step_args[-1])
            variant = variants.get(key)
            if variant is not None:
                args = self._positional.copy()
                for slot, value in zip(self._step_slots, step_args):
                    args[slot] = value
                _launch_variant(variant, grid[0], self._current_stream(self._device_index), args)
                return
        compiled = _gather_pack_kernel[grid](
            **self._kernel_args, **dict(zip(_STEP_ARGS, step_args))
        )
        if key is not None:
            variants[key] = compiled


def _hooked(hook: object) -> bool:
    """Whether a Triton launch hook (a ``HookChain``, or a callable or None in older Triton)
    has anything to call."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _launch_variant(variant: object, grid_0: int, stream: int, args: list) -> None:
    """Launch compiled ``variant`` on ``(grid_0, 1, 1)`` programs: what Triton's runner
    (``CompiledKernel.__getitem__``) does, minus the launch metadata and hook calls when no
    launch hook is set. The runner builds that metadata on every launch and its C launcher
    calls both hook chains, empty or not (measured on a GPU by ``bench.run gpu_parts``)."""
    runtime = triton.knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    metadata = None
    if _hooked(enter) or _hooked(leave):
        metadata = variant.launch_metadata((grid_0, 1, 1), stream, *args)
    else:
        enter = leave = None
    variant.run(
        grid_0, 1, 1, stream, variant.function, variant.packed_metadata, metadata, enter, leave,
        *args,
    )  # fmt: skip


def _check_triton_places(capture: torch.Tensor, dest: torch.Tensor, step_info: torch.Tensor):
    if not capture.is_cuda and not _interpreting():
        raise ValueError(
            "gather_pack: impl='triton' needs a CUDA capture or TRITON_INTERPRET=1 "
            f"(capture is on {capture.device}); use impl='reference' or 'auto'"
        )
    for name, t in (("dest", dest), ("step_info", step_info)):
        if (
            capture.is_cuda
            and t.device.type == "cpu"
            and not can_write_host_directly(capture.device)
        ):
            raise ValueError(
                f"gather_pack: {name} is pinned host memory, but kernels on {capture.device} "
                "cannot write host memory directly (no unified addressing); pass a device "
                "staging tensor and copy it to the host"
            )


def gather_pack(
    capture: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    table_row: torch.Tensor,
    slot_table: torch.Tensor,
    block_window: torch.Tensor,
    dest: torch.Tensor,
    step_info: torch.Tensor,
    num_rejected: torch.Tensor | None = None,
    *,
    num_reqs: int | None = None,
    num_rows: int | None = None,
    hash_block: int | None = None,
    num_slots: int | None = None,
    impl: str = "auto",
) -> None:
    """Write each request's accepted rows of one step block-aligned into store slots.

    Args:
        capture: [T, L, K] int32 (vLLM's capture buffer), uint8 or uint16; contiguous.
            Rows ``0 .. query_start_loc[R] - 1`` are the step's rows.
        query_start_loc: [>= R+1] int32/int64; request r owns rows ``qsl[r] .. qsl[r+1]-1``.
            Must start at >= 0 and never decrease; otherwise every request is BAD_ROWS.
        positions: [>= num_rows] int32/int64, the token position of each row (MRV2's
            ``input_batch.positions``); request r's rows sit at ``positions[qsl[r]] + i``.
        table_row: [>= R] int32/int64, the slot-table row of request r.
        slot_table: [N, W] int32/int64, a ring per row: the slot of hash block b of row n is
            ``slot_table[n, b % W]``. Slots must be distinct across the step.
        block_window: [N, 2] int32/int64, per row the hash blocks ``lo ..= hi`` its request
            may write (``hi - lo < W``); a row with ``hi < lo`` may write none.
        dest: where rows go, in one of two layouts (on capture's device, or pinned host
            memory when ``can_write_host_directly(capture.device)``):
            ``[S, B, L, K]`` uint8/uint16 slots (each slot contiguous, distinct slots never
            overlap): the row of position p goes to ``dest[slot, p % B]``;
            ``[>= num_rows, L, K]`` rows (device staging): row t goes to ``dest[t]``, and the
            caller places it with the same slot table.
        step_info: [>= R, 3] int32, out: ``(start or -1, accepted rows or -1, status)``.
        num_rejected: [>= R] int32/int64 on capture's device (rejected speculative rows at
            the end of each request's range), or None when nothing is rejected.
        num_reqs: R, requests to handle (default ``len(query_start_loc) - 1``); lets a
            CUDA-graph caller keep tensors sized for the maximum batch.
        num_rows: bound on the step's row count (default T); sizes the grid. Requests whose
            rows pass it get status BAD_ROWS, never a silent partial write.
        hash_block: B; required for the rows layout, else must match ``dest.shape[1]``.
        num_slots: S, the slots the table may name; required for the rows layout, else
            at most ``dest.shape[0]`` (default).
        impl: "auto" (Triton on CUDA or under TRITON_INTERPRET=1, else the torch reference),
            "triton" or "reference".

    For request r with ``n = qsl[r+1] - qsl[r]``, ``a = n - num_rejected[r]`` and start
    ``s = positions[qsl[r]]``, row i < a is ``capture[qsl[r] + i]`` cast (wrapping, as torch
    ``.to``) to ``dest.dtype`` and written for position ``p = s + i``. Nothing else in
    ``dest`` changes. A request with a nonzero status (see ``Status``) writes nothing: its
    rows are all written or none is. No allocation, no host synchronization on the Triton
    path; raises ValueError naming the argument for a malformed call.
    """
    launch = GatherPackLaunch(
        capture,
        table_row,
        slot_table,
        block_window,
        dest,
        step_info,
        hash_block=hash_block,
        num_slots=num_slots,
        impl=impl,
    )
    launch(query_start_loc, positions, num_rejected, num_reqs=num_reqs, num_rows=num_rows)
