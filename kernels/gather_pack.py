"""Gather each request's accepted routed-experts rows and pack them into block-aligned slots.

One launch per engine step, after rejection sampling, with no host synchronization. The
row of token position ``p`` of request ``r`` lands at ``dest[slot_table[r, p // B -
first_block[r]], p % B]``, cast to ``dest``'s dtype, so every complete hash block comes out
whole and contiguous in its slot. ``dest`` is either pinned host memory (the kernel's stores
cross PCIe directly) or device staging of the same layout (the caller then copies the slots
it needs).

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

import os

import torch
import triton
import triton.language as tl

from r3capture.kernels._common import (
    STATUS_BAD_BLOCK,
    STATUS_BAD_REJECTED,
    STATUS_BAD_ROWS,
    STATUS_OK,
    check_gather_pack_args,
)
from r3capture.kernels._device import can_write_host_directly

# Row tiles of at most 8 rows x ~4096 elements keep every specialization at ~113-153
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
def _request_fields(
    o_r,
    m_r,
    qsl_ptr,
    start_ptr,
    first_block_ptr,
    rejected_ptr,
    row_limit,
    table_width,
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
    start = tl.load(start_ptr + o_r, mask=m_r, other=0).to(tl.int64)
    first_block = tl.load(first_block_ptr + o_r, mask=m_r, other=0).to(tl.int64)
    accepted = num_sched - rejected

    bad_rows = (q_begin < 0) | (q_end < q_begin) | (q_end > row_limit)
    bad_rejected = (rejected < 0) | (rejected > num_sched)
    needs_blocks = m_r & ~bad_rows & ~bad_rejected & (accepted > 0)
    # Clamped so the divisions below never see a negative position (C and Python disagree).
    safe_start = tl.maximum(start, 0)
    col_lo = safe_start // HASH_BLOCK - first_block
    col_hi = (safe_start + accepted - 1) // HASH_BLOCK - first_block
    bad_range = needs_blocks & ((start < 0) | (col_lo < 0) | (col_hi >= table_width))
    status = tl.where(
        bad_rows,
        _BAD_ROWS,
        tl.where(bad_rejected, _BAD_REJECTED, tl.where(bad_range, _BAD_BLOCK, 0)),
    )
    num_cols = tl.where(needs_blocks & ~bad_range, col_hi - col_lo + 1, 0)
    return q_begin, q_end, start, first_block, accepted, status, col_lo, num_cols


@triton.jit
def _any_bad_slot(
    o_r,
    col_lo,
    num_cols,
    table_ptr,
    stride_table_r,
    num_slots,
    SCAN: tl.constexpr,
):
    """[N] bool: some slot_table[r, col_lo .. col_lo+num_cols) lies outside [0, num_slots)."""
    bad = num_cols < 0
    max_cols = tl.max(num_cols, axis=0)
    c0 = max_cols * 0
    # A while loop: Triton 3.6's interpreter (with numpy >= 2.4) cannot use a runtime value
    # as a range() bound; compiled, it is the same short loop.
    while c0 < max_cols:
        o_c = c0 + tl.arange(0, SCAN)
        m_c = o_c[None, :] < num_cols[:, None]  # [N, SCAN]
        p_slot = table_ptr + o_r[:, None] * stride_table_r + (col_lo[:, None] + o_c[None, :])
        b_slot = tl.load(p_slot, mask=m_c, other=0).to(tl.int64)
        b_bad = m_c & ((b_slot < 0) | (b_slot >= num_slots))
        bad = bad | (tl.max(b_bad.to(tl.int32), axis=1) > 0)
        c0 += SCAN
    return bad


@triton.jit(
    do_not_specialize=[
        "num_reqs", "row_limit", "num_slots", "table_width", "num_steps", "stride_table_r",
        "stride_info_r",
    ]
)  # fmt: skip
def _gather_pack_kernel(
    # pointers
    capture_ptr,
    qsl_ptr,
    start_ptr,
    first_block_ptr,
    table_ptr,
    rejected_ptr,
    dest_ptr,
    info_ptr,
    # sizes
    num_reqs,
    row_limit,
    num_slots,
    table_width,
    num_steps,
    # strides, in elements
    stride_table_r,
    stride_dest_s,
    stride_info_r,
    # meta
    ROW_ELEMS: tl.constexpr,
    HASH_BLOCK: tl.constexpr,
    HAS_REJECTED: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_REQS: tl.constexpr,
    SCAN_REQS: tl.constexpr,
    SCAN_ROWS: tl.constexpr,
):
    i_p = tl.program_id(0).to(tl.int64)

    # Job 1: step_info for requests [i_p * BLOCK_REQS, (i_p + 1) * BLOCK_REQS).
    if i_p * BLOCK_REQS < num_reqs:
        o_r = i_p * BLOCK_REQS + tl.arange(0, BLOCK_REQS)
        m_r = o_r < num_reqs
        _, _, start, _, accepted, status, col_lo, num_cols = _request_fields(
            o_r, m_r, qsl_ptr, start_ptr, first_block_ptr, rejected_ptr, row_limit,
            table_width, HAS_REJECTED, HASH_BLOCK,
        )  # fmt: skip
        bad_slot = _any_bad_slot(
            o_r, col_lo, num_cols, table_ptr, stride_table_r, num_slots, SCAN_REQS
        )
        status = tl.where(bad_slot, _BAD_BLOCK, status)
        accepted = tl.where(status == _OK, accepted, -1)
        p_info = info_ptr + o_r * stride_info_r
        tl.store(p_info, start.to(tl.int32), mask=m_r)
        tl.store(p_info + 1, accepted.to(tl.int32), mask=m_r)
        tl.store(p_info + 2, status.to(tl.int32), mask=m_r)

    # Job 2: capture rows [i_p * BLOCK_ROWS, (i_p + 1) * BLOCK_ROWS) of the step.
    num_rows = tl.minimum(tl.load(qsl_ptr + num_reqs).to(tl.int64), row_limit)
    row_start = i_p * BLOCK_ROWS
    if row_start < num_rows:
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
        q_begin, q_end, start, first_block, accepted, status, col_lo, num_cols = (
            _request_fields(
                o_r, m_t, qsl_ptr, start_ptr, first_block_ptr, rejected_ptr, row_limit,
                table_width, HAS_REJECTED, HASH_BLOCK,
            )
        )  # fmt: skip
        owned = m_t & (q_begin <= o_t) & (o_t < q_end)
        # The first row of each request inside this tile scans that request's slot range.
        leader = owned & ((o_t == q_begin) | (o_t == row_start))
        bad_slot = _any_bad_slot(
            o_r, col_lo, tl.where(leader, num_cols, 0), table_ptr, stride_table_r, num_slots,
            SCAN_ROWS,
        )  # fmt: skip
        same_req = (o_r[:, None] == o_r[None, :]) & (leader & bad_slot)[None, :]
        bad_slot = tl.max(same_req.to(tl.int32), axis=1) > 0  # [BLOCK_ROWS], from the leader

        i_row = o_t - q_begin
        write = owned & (status == _OK) & ~bad_slot & (i_row < accepted)
        pos = tl.where(write, start + i_row, 0)
        col = pos // HASH_BLOCK - first_block
        b_slot = tl.load(table_ptr + o_r * stride_table_r + col, mask=write, other=0)
        b_slot = b_slot.to(tl.int64)
        # Already implied by status == OK; repeated per row so that no bug in the status
        # logic can ever turn into a store outside the arena.
        write = write & (b_slot >= 0) & (b_slot < num_slots)

        o_e = tl.arange(0, BLOCK_COLS)
        m_e = o_e < ROW_ELEMS
        m_tile = write[:, None] & m_e[None, :]  # [BLOCK_ROWS, BLOCK_COLS]
        p_src = capture_ptr + o_t[:, None] * ROW_ELEMS + o_e[None, :]
        b_rows = tl.load(p_src, mask=m_tile, other=0)
        dst_row = b_slot * stride_dest_s + (pos % HASH_BLOCK) * ROW_ELEMS
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


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _launch(
    capture: torch.Tensor,
    query_start_loc: torch.Tensor,
    start_pos: torch.Tensor,
    first_block: torch.Tensor,
    slot_table: torch.Tensor,
    dest: torch.Tensor,
    step_info: torch.Tensor,
    num_rejected: torch.Tensor | None,
    num_reqs: int | None,
    num_rows: int | None,
) -> None:
    shape = check_gather_pack_args(
        capture, query_start_loc, start_pos, first_block, slot_table, dest, step_info,
        num_rejected, num_reqs, num_rows,
    )  # fmt: skip
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
                "staging tensor of the same layout and copy it to the host"
            )
    if shape.num_reqs == 0:
        return

    tiles = _tile_config(shape.num_layers * shape.top_k)
    grid = (
        max(
            triton.cdiv(shape.row_limit, tiles["BLOCK_ROWS"]),
            triton.cdiv(shape.num_reqs, tiles["BLOCK_REQS"]),
        ),
    )
    # Without num_rejected the pointer is never read (HAS_REJECTED is constexpr False); any
    # valid pointer keeps the signature, and so the compiled variants, the same.
    rejected = num_rejected if num_rejected is not None else query_start_loc
    kwargs = dict(
        capture_ptr=capture,
        qsl_ptr=query_start_loc,
        start_ptr=start_pos,
        first_block_ptr=first_block,
        table_ptr=slot_table,
        rejected_ptr=rejected,
        dest_ptr=dest,
        info_ptr=step_info,
        num_reqs=shape.num_reqs,
        row_limit=shape.row_limit,
        num_slots=shape.num_slots,
        table_width=shape.table_width,
        num_steps=(shape.num_reqs - 1).bit_length(),
        stride_table_r=slot_table.stride(0),
        stride_dest_s=dest.stride(0),
        stride_info_r=step_info.stride(0),
        ROW_ELEMS=shape.num_layers * shape.top_k,
        HASH_BLOCK=shape.hash_block,
        HAS_REJECTED=num_rejected is not None,
        num_warps=_NUM_WARPS,
        **tiles,
    )
    if capture.is_cuda:
        with torch.cuda.device(capture.device):
            _gather_pack_kernel[grid](**kwargs)
    else:
        _gather_pack_kernel[grid](**kwargs)


def gather_pack(
    capture: torch.Tensor,
    query_start_loc: torch.Tensor,
    start_pos: torch.Tensor,
    first_block: torch.Tensor,
    slot_table: torch.Tensor,
    dest: torch.Tensor,
    step_info: torch.Tensor,
    num_rejected: torch.Tensor | None = None,
    *,
    num_reqs: int | None = None,
    num_rows: int | None = None,
    impl: str = "auto",
) -> None:
    """Write each request's accepted rows of one step into block-aligned ``dest`` slots.

    Args:
        capture: [T, L, K] int32 (vLLM's capture buffer), uint8 or uint16; contiguous.
            Rows ``0 .. query_start_loc[R] - 1`` are the step's rows.
        query_start_loc: [>= R+1] int32/int64, non-decreasing; request r owns rows
            ``qsl[r] .. qsl[r+1] - 1``.
        start_pos: [>= R] int32/int64, token position of request r's first row in this step.
        first_block: [>= R] int32/int64, the hash-block index that ``slot_table[r, 0]`` maps.
        slot_table: [>= R, M] int32/int64, destination slot of block ``first_block[r] + j``;
            -1 = unmapped. Slots must be distinct across the step (the host allocates them).
        dest: [S, B, L, K] uint8/uint16, each slot contiguous (any slot stride); on
            capture's device, or pinned host memory when
            ``can_write_host_directly(capture.device)``. B = hash block size.
        step_info: [>= R, 3] int32, out: ``(start_pos[r], accepted rows or -1, status)``.
        num_rejected: [>= R] int32/int64 on capture's device (rejected speculative rows at
            the end of each request's range), or None when nothing is rejected.
        num_reqs: R, requests to handle (default ``len(query_start_loc) - 1``); lets a
            CUDA-graph caller keep tensors sized for the maximum batch.
        num_rows: bound on the step's row count (default T); sizes the grid. Requests whose
            rows pass it get status BAD_ROWS, never a silent partial write.
        impl: "auto" (Triton on CUDA or under TRITON_INTERPRET=1, else the torch reference),
            "triton" or "reference".

    For request r with ``n = qsl[r+1] - qsl[r]`` and ``a = n - num_rejected[r]``, row i < a
    is ``capture[qsl[r] + i]`` cast (wrapping, as torch ``.to``) to ``dest.dtype`` and
    written to ``dest[slot_table[r, p // B - first_block[r]], p % B]`` with
    ``p = start_pos[r] + i``. Nothing else in ``dest`` changes. A request with a nonzero
    status (see ``Status``) writes nothing. No allocation, no host synchronization on the
    Triton path; raises ValueError naming the argument for a malformed call.
    """
    if impl not in ("auto", "triton", "reference"):
        raise ValueError(f"gather_pack: impl must be 'auto', 'triton' or 'reference'; got {impl!r}")
    use_triton = impl == "triton" or (
        impl == "auto"
        and isinstance(capture, torch.Tensor)
        and (capture.is_cuda or _interpreting())
    )
    if use_triton:
        _launch(
            capture, query_start_loc, start_pos, first_block, slot_table, dest, step_info,
            num_rejected, num_reqs, num_rows,
        )  # fmt: skip
        return
    # Imported here, not at the top: the kernel code never depends on its oracle.
    from r3capture.kernels.reference import gather_pack_reference

    gather_pack_reference(
        capture, query_start_loc, start_pos, first_block, slot_table, dest, step_info,
        num_rejected, num_reqs=num_reqs, num_rows=num_rows,
    )  # fmt: skip
