"""Torch reference for the gather-pack kernel: the test oracle and the fallback without Triton.

Same arguments, statuses, errors and writes as ``r3capture.kernels.gather_pack`` (see its
docstring for the layout). Written for reading, vectorized over rows so that it is also a
usable CPU fallback; it synchronizes with the device (it reads the metadata on the host).
"""

from __future__ import annotations

import torch

from r3capture.kernels._common import (
    STATUS_BAD_BLOCK,
    STATUS_BAD_REJECTED,
    STATUS_BAD_ROWS,
    STATUS_OK,
    check_gather_pack_args,
)

_CPU = torch.device("cpu")


def gather_pack_reference(
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
) -> None:
    """Write each request's accepted rows of ``capture`` into block-aligned ``dest`` slots.

    capture [T, L, K] int32/uint8/uint16; query_start_loc [>=R+1] int32/int64;
    start_pos, first_block, num_rejected [>=R] int32/int64; slot_table [>=R, M] int32/int64;
    dest [S, B, L, K] uint8/uint16 (slots contiguous); step_info [>=R, 3] int32 (out);
    R = num_reqs.
    """
    shape = check_gather_pack_args(
        capture, query_start_loc, start_pos, first_block, slot_table, dest, step_info,
        num_rejected, num_reqs, num_rows,
    )  # fmt: skip
    num_reqs = shape.num_reqs
    if num_reqs == 0:
        return
    block = shape.hash_block

    def host(t: torch.Tensor) -> torch.Tensor:
        return t[:num_reqs].to(_CPU, torch.int64)

    qsl = query_start_loc[: num_reqs + 1].to(_CPU, torch.int64)
    row_begin, row_end = qsl[:-1], qsl[1:]
    num_sched = row_end - row_begin
    rejected = host(num_rejected) if num_rejected is not None else torch.zeros_like(num_sched)
    start, first = host(start_pos), host(first_block)
    accepted = num_sched - rejected

    bad_rows = (row_begin < 0) | (row_end < row_begin) | (row_end > shape.row_limit)
    bad_rejected = ~bad_rows & ((rejected < 0) | (rejected > num_sched))
    live = ~bad_rows & ~bad_rejected

    # One entry per accepted row of every request whose rows and rejected count are sane.
    counts = torch.where(live, accepted, 0)
    req = torch.repeat_interleave(torch.arange(num_reqs), counts)
    first_entry = torch.cumsum(counts, 0) - counts
    i = torch.arange(req.numel()) - first_entry[req]
    pos = start[req] + i
    table_col = torch.div(pos, block, rounding_mode="floor") - first[req]
    in_table = (pos >= 0) & (table_col >= 0) & (table_col < shape.table_width)
    slot = torch.full_like(pos, -1)
    table = slot_table[:num_reqs].to(_CPU, torch.int64)
    slot[in_table] = table[req[in_table], table_col[in_table]]
    row_bad = (slot < 0) | (slot >= shape.num_slots)
    bad_block = torch.zeros(num_reqs, dtype=torch.int64).index_add_(0, req, row_bad.long()) > 0

    status = torch.full((num_reqs,), STATUS_OK, dtype=torch.int64)
    status[bad_block] = STATUS_BAD_BLOCK
    status[bad_rejected] = STATUS_BAD_REJECTED
    status[bad_rows] = STATUS_BAD_ROWS

    write = status[req] == STATUS_OK
    src_rows = (row_begin[req] + i)[write].to(capture.device)
    rows = capture[src_rows].to(dest.device).to(dest.dtype)
    dst_slot = slot[write].to(dest.device)
    dst_off = (pos[write] % block).to(dest.device)
    if dest.dtype == torch.uint16:
        # torch has no index_put for uint16; the same bytes through int16 are identical.
        dest.view(torch.int16)[dst_slot, dst_off] = rows.view(torch.int16)
    else:
        dest[dst_slot, dst_off] = rows

    info = torch.stack([start, torch.where(status == STATUS_OK, accepted, -1), status], dim=1)
    step_info[:num_reqs] = info.to(torch.int32).to(step_info.device)
