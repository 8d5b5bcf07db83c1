"""Torch reference for the gather-pack kernel: the test oracle and the fallback without Triton.

Same arguments, statuses, errors and writes as ``r3capture.kernels.gather_pack`` (see its
docstring for the layouts). Written for reading, vectorized over rows so that it is also a
usable CPU fallback; it synchronizes with the device (it reads the metadata on the host).
"""

from __future__ import annotations

import torch

from r3capture.kernels._common import (
    STATUS_BAD_BLOCK,
    STATUS_BAD_REJECTED,
    STATUS_BAD_ROWS,
    STATUS_OK,
    GatherPackShape,
    check_static_args,
    check_step_args,
)

_CPU = torch.device("cpu")


def gather_pack_reference(
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
) -> None:
    """Write each request's accepted rows of ``capture`` block-aligned into ``dest``.

    capture [T, L, K] int32/uint8/uint16; query_start_loc [>=R+1], positions [>=num_rows],
    table_row, num_rejected [>=R] int32/int64; slot_table [N, W] (ring per row) and
    block_window [N, 2] int32/int64; dest [S, B, L, K] slots or [>=num_rows, L, K] staging,
    uint8/uint16; step_info [>=R, 3] int32 (out); R = num_reqs.
    """
    static = check_static_args(
        capture=capture,
        table_row=table_row,
        slot_table=slot_table,
        block_window=block_window,
        dest=dest,
        step_info=step_info,
        hash_block=hash_block,
        num_slots=num_slots,
    )
    shape = check_step_args(
        static,
        query_start_loc=query_start_loc,
        positions=positions,
        num_rejected=num_rejected,
        num_reqs=num_reqs,
        num_rows=num_rows,
    )
    args = dict(
        capture=capture,
        query_start_loc=query_start_loc,
        positions=positions,
        table_row=table_row,
        slot_table=slot_table,
        block_window=block_window,
        dest=dest,
        step_info=step_info,
        num_rejected=num_rejected,
    )
    gather_pack_reference_checked(args, shape)


def gather_pack_reference_checked(args: dict, shape: GatherPackShape) -> None:
    """The reference on arguments ``check_gather_pack_args`` has already validated."""
    num_reqs = shape.num_reqs
    if num_reqs == 0:
        return
    block = shape.hash_block
    capture, dest, step_info = args["capture"], args["dest"], args["step_info"]

    def host(name: str) -> torch.Tensor:
        return args[name][:num_reqs].to(_CPU, torch.int64)

    qsl = args["query_start_loc"][: num_reqs + 1].to(_CPU, torch.int64)
    row_begin, row_end = qsl[:-1], qsl[1:]
    num_sched = row_end - row_begin
    rejected = host("num_rejected") if args["num_rejected"] is not None else num_sched * 0
    accepted = num_sched - rejected
    num_table_rows, ring = args["slot_table"].shape

    # A query_start_loc that starts below 0 or decreases anywhere fails every request.
    qsl_sane = bool(qsl[0] >= 0) and bool((num_sched >= 0).all())
    bad_rows = ~torch.tensor(qsl_sane) | (row_end > shape.row_limit)
    readable = ~bad_rows & (num_sched > 0)
    positions = args["positions"][: shape.row_limit].to(_CPU, torch.int64)
    start = torch.full((num_reqs,), -1, dtype=torch.int64)
    start[readable] = positions[row_begin[readable]]
    bad_rejected = ~bad_rows & ((rejected < 0) | (rejected > num_sched))
    live = ~bad_rows & ~bad_rejected

    row = host("table_row")
    row_ok = (row >= 0) & (row < num_table_rows)
    # Only the entries the kernel reads are read: the tables have a row per request the
    # worker can hold, and converting all of [N, W] each step would be megabytes.
    table_device = args["slot_table"].device
    # Rows outside the table read the empty window [0, -1].
    window = torch.tensor([0, -1]).repeat(num_reqs, 1)
    window[row_ok] = args["block_window"][row[row_ok].to(table_device)].to(_CPU, torch.int64)
    lo, hi = window.unbind(1)
    first = torch.div(start.clamp(min=0), block, rounding_mode="floor")
    last = torch.div(start.clamp(min=0) + accepted - 1, block, rounding_mode="floor")
    bad_range = (start < 0) | (first < lo) | (last > hi)
    bad_table = ~row_ok | (hi - lo >= ring)
    bad_block = live & (accepted > 0) & (bad_range | bad_table)

    # One entry per accepted row of every request whose rows, counts and range are sane.
    counts = torch.where(live & ~bad_block, accepted, 0)
    req = torch.repeat_interleave(torch.arange(num_reqs), counts)
    first_entry = torch.cumsum(counts, 0) - counts
    i = torch.arange(req.numel()) - first_entry[req]
    pos = start[req] + i
    column = torch.div(pos, block, rounding_mode="floor") % ring
    # Only requests with a row in the table have entries here (bad_table covers the rest).
    slot = args["slot_table"][row[req].to(table_device), column.to(table_device)]
    slot = slot.to(_CPU, torch.int64)
    row_bad = (slot < 0) | (slot >= shape.num_slots)
    bad_block |= torch.zeros(num_reqs, dtype=torch.int64).index_add_(0, req, row_bad.long()) > 0

    status = torch.full((num_reqs,), STATUS_OK, dtype=torch.int64)
    status[bad_block] = STATUS_BAD_BLOCK
    status[bad_rejected] = STATUS_BAD_REJECTED
    status[bad_rows] = STATUS_BAD_ROWS

    write = status[req] == STATUS_OK
    src_rows = row_begin[req] + i
    rows = capture[src_rows[write].to(capture.device)].to(dest.device).to(dest.dtype)
    if shape.rows_layout:
        index = (src_rows[write].to(dest.device),)
    else:
        index = (slot[write].to(dest.device), (pos[write] % block).to(dest.device))
    if dest.dtype == torch.uint16:
        # torch has no index_put for uint16; the same bytes through int16 are identical.
        dest.view(torch.int16)[index] = rows.view(torch.int16)
    else:
        dest[index] = rows

    info = torch.stack([start, torch.where(status == STATUS_OK, accepted, -1), status], dim=1)
    step_info[:num_reqs] = info.to(torch.int32).to(step_info.device)
