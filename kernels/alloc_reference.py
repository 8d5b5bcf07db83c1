"""Torch reference for ``gather_alloc``: the test oracle, slot for slot.

Same arguments, statuses, state updates and writes as ``r3capture.kernels.gather_alloc``
(its docstring has the layouts), as vector operations over the step's requests, their
blocks and their rows; queue entries go out in batch order, as the kernel's prefix sums
hand them out. It reads what the kernel reads on the host (a CPU fallback that
synchronizes with the device).
"""

from __future__ import annotations

import torch

from r3capture.kernels._alloc_checks import (
    BLOCK_LIMIT,
    HEAD_SERIAL,
    RECORD_HI_BITS,
    RECORD_SHARED,
    AllocShape,
    AllocStatic,
    check_alloc_static_args,
    check_alloc_step_args,
)
from r3capture.kernels._common import (
    STATUS_BAD_BLOCK,
    STATUS_BAD_INDEX,
    STATUS_BAD_LAUNCH,
    STATUS_BAD_REJECTED,
    STATUS_BAD_ROWS,
    STATUS_NO_STOCK,
    STATUS_OK,
    STATUS_SHARED_INDEX,
)

_CPU = torch.device("cpu")
_HI_MASK = (1 << RECORD_HI_BITS) - 1
_SLOT_MASK = (1 << 32) - 1


def gather_alloc_reference(
    capture: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    request_index: torch.Tensor,
    ring: torch.Tensor,
    records: torch.Tensor,
    queue: torch.Tensor,
    heads: torch.Tensor,
    dest: torch.Tensor,
    step_info: torch.Tensor,
    num_rejected: torch.Tensor | None = None,
    fresh: torch.Tensor | None = None,
    *,
    launch: int,
    queue_tail: int,
    num_reqs: int | None = None,
    num_rows: int | None = None,
    hash_block: int | None = None,
    num_slots: int | None = None,
) -> None:
    """``gather_alloc`` in torch (see its docstring)."""
    static = check_alloc_static_args(
        capture=capture, ring=ring, records=records, queue=queue, heads=heads, dest=dest,
        step_info=step_info, hash_block=hash_block, num_slots=num_slots,
    )  # fmt: skip
    shape = check_alloc_step_args(
        static, query_start_loc=query_start_loc, positions=positions,
        request_index=request_index, num_rejected=num_rejected, fresh=fresh, num_reqs=num_reqs,
        num_rows=num_rows, launch=launch, queue_tail=queue_tail,
    )  # fmt: skip
    args = dict(
        capture=capture, query_start_loc=query_start_loc, positions=positions,
        request_index=request_index, ring=ring, records=records, queue=queue, heads=heads,
        dest=dest, step_info=step_info, num_rejected=num_rejected, fresh=fresh,
    )  # fmt: skip
    gather_alloc_reference_checked(args, static, shape)


def gather_alloc_reference_checked(args: dict, static: AllocStatic, shape: AllocShape) -> None:
    """The reference on arguments the checks have already validated: vector operations over
    the step's requests, their blocks and their rows, in the kernel's order of decisions."""
    R = shape.num_reqs
    if R == 0:
        return
    B, N, D, Q, S = (
        static.hash_block, static.num_indices, static.ring_width, static.queue_size,
        static.num_slots,
    )  # fmt: skip
    launch = shape.launch
    ring, records, queue, heads = args["ring"], args["records"], args["queue"], args["heads"]
    capture, dest = args["capture"], args["dest"]
    if int(heads[HEAD_SERIAL]) != launch - 1:
        # Not the launch after the last: every request fails, nothing else changes.
        info = torch.tensor([[-1, -1, STATUS_BAD_LAUNCH, 0]] * R, dtype=torch.int32)
        args["step_info"][:R] = info.to(args["step_info"].device)
        return

    def host(t: torch.Tensor | None, n: int) -> torch.Tensor:
        if t is None:
            return torch.zeros(n, dtype=torch.int64)
        return t[:n].to(_CPU, torch.int64)

    qsl = host(args["query_start_loc"], R + 1)
    rejected = host(args["num_rejected"], R)
    index = host(args["request_index"], R)
    fresh = host(args["fresh"], R) != 0
    head = int(heads[launch % 2])
    available = shape.queue_tail - head

    # Everything about each request that needs no slot (the kernel's _request_plan).
    q0, q1 = qsl[:-1], qsl[1:]
    num_sched = q1 - q0
    accepted = num_sched - rejected
    sane = bool(qsl[0] >= 0) and bool((num_sched >= 0).all())
    bad_rows = torch.tensor(not sane) | (q1 > shape.row_limit)
    readable = ~bad_rows & (num_sched > 0)
    start = torch.full((R,), -1, dtype=torch.int64)
    positions = args["positions"][: shape.row_limit].to(_CPU, torch.int64)
    start[readable] = positions[q0[readable]]
    bad_rejected = ~bad_rows & ((rejected < 0) | (rejected > num_sched))
    index_ok = (index >= 0) & (index < N)
    bad_index = ~bad_rows & ~bad_rejected & ~index_ok
    # Fresh requests read their records too: which one to overwrite.
    rec = torch.zeros((R, 2), dtype=torch.int64)
    rec[index_ok] = records[index[index_ok].to(records.device)].to(_CPU, torch.int64)
    tags = rec >> RECORD_HI_BITS
    valid = index_ok[:, None] & (tags < launch)
    use0 = valid[:, 0] & (~valid[:, 1] | (tags[:, 0] >= tags[:, 1]))
    held = torch.where(use0, rec[:, 0], rec[:, 1]) & _HI_MASK
    held = torch.where(~fresh & (use0 | valid[:, 1]), held, 0)
    shared_before = held == RECORD_SHARED
    hi = held - 1
    overwrite = torch.where(use0, 1, 0)
    # Requests whose index another request of the launch has too.
    claims = torch.bincount(index[index_ok], minlength=N)
    shared = index_ok & (claims[index.clamp(0, N - 1)] > 1)
    needs = ~bad_rows & ~bad_rejected & ~bad_index & ~shared_before & (accepted > 0)
    safe = start.clamp(min=0)
    first = torch.div(safe, B, rounding_mode="floor")
    last = torch.div(safe + accepted - 1, B, rounding_mode="floor")
    bad_range = needs & (
        (start < 0)
        | (last - first >= D)
        | (last >= BLOCK_LIMIT)
        | ((first <= hi) & (first < hi - D + 1))
    )
    new_first = torch.maximum(first, hi + 1)
    new = torch.where(needs & ~bad_range, (last - new_first + 1).clamp(min=0), 0)
    # Queue entries in batch order: an exclusive prefix sum, as every program computes it.
    offset = torch.cumsum(new, 0) - new
    no_stock = (new > 0) & (offset + new > available)

    # Every block of the requests that get this far, with the slot each would use.
    check = needs & ~bad_range & ~no_stock
    counts = torch.where(check, last - first + 1, 0)
    req = torch.repeat_interleave(torch.arange(R), counts)
    block = torch.arange(req.numel()) - (torch.cumsum(counts, 0) - counts)[req] + first[req]
    old = block < new_first[req]
    entry = torch.full_like(block, -1)
    entry[old] = ring[index[req][old].to(ring.device), (block[old] % D).to(ring.device)].to(_CPU)
    where = (head + offset[req] + block - new_first[req]) % Q
    queued = queue.to(_CPU, torch.int64)[where]
    slot = torch.where(old, entry & _SLOT_MASK, queued)
    bad = (old & ((entry >> 32) != block)) | (slot < 0) | (slot >= S)
    bad_slot = torch.zeros(R, dtype=torch.int64).index_add_(0, req, bad.long()) > 0

    status = torch.full((R,), STATUS_OK, dtype=torch.int64)
    for mask, code in (
        (bad_slot, STATUS_BAD_BLOCK), (no_stock, STATUS_NO_STOCK), (bad_range, STATUS_BAD_BLOCK),
        (shared | shared_before, STATUS_SHARED_INDEX), (bad_index, STATUS_BAD_INDEX),
        (bad_rejected, STATUS_BAD_REJECTED), (bad_rows, STATUS_BAD_ROWS),
    ):  # fmt: skip
        status[mask] = code  # the last assignment is the first failing check
    ok = status == STATUS_OK
    taken = torch.where(no_stock, 0, new)

    # Rows of OK requests, each into its block's slot (or its staging row).
    rows_of = torch.where(ok, accepted, 0)
    row_req = torch.repeat_interleave(torch.arange(R), rows_of)
    i = torch.arange(row_req.numel()) - (torch.cumsum(rows_of, 0) - rows_of)[row_req]
    source = q0[row_req] + i
    values = capture[source.to(capture.device)].to(dest.device).to(dest.dtype)
    view = dest.view(torch.int16) if dest.dtype == torch.uint16 else dest
    values = values.view(torch.int16) if dest.dtype == torch.uint16 else values
    if static.rows_layout:
        view[source.to(dest.device)] = values
    else:
        position = start[row_req] + i
        # The block's place among its request's checked blocks, then its slot.
        first_entry = torch.cumsum(counts, 0) - counts
        at = first_entry[row_req] + torch.div(position, B, rounding_mode="floor") - first[row_req]
        view[slot[at].to(dest.device), (position % B).to(dest.device)] = values

    # New blocks of OK requests into the ring; records of grown and fresh requests.
    new_block = ok[req] & ~old
    ring_index = (index[req][new_block].to(ring.device), (block[new_block] % D).to(ring.device))
    ring[ring_index] = ((block[new_block] << 32) | slot[new_block]).to(ring.device)
    # Requests sharing an index mark it, each with the same value in the same record.
    grown = ok & (new > 0)
    write_record = index_ok & (grown | fresh | shared)
    value = torch.where(shared, RECORD_SHARED, torch.where(grown, last, hi) + 1)
    value = (launch << RECORD_HI_BITS) | value
    records[index[write_record].to(records.device), overwrite[write_record].to(records.device)] = (
        value[write_record].to(records.device)
    )
    heads[(launch + 1) % 2] = head + int(taken.sum())
    heads[HEAD_SERIAL] = launch
    info = torch.stack([start, torch.where(ok, accepted, -1), status, taken], dim=1)
    args["step_info"][:R] = info.to(torch.int32).to(args["step_info"].device)
