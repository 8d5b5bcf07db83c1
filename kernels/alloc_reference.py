"""Torch reference for ``gather_alloc``: the test oracle, slot for slot.

Same arguments, statuses, state updates and writes as ``r3capture.kernels.gather_alloc``
(its docstring has the layouts), written as a loop over the step's requests in batch order,
the order in which the kernel's prefix sums hand out queue entries. It reads everything on
the host.
"""

from __future__ import annotations

import torch

from r3capture.kernels._alloc_checks import (
    BLOCK_LIMIT,
    RECORD_HI_BITS,
    AllocShape,
    AllocStatic,
    check_alloc_static_args,
    check_alloc_step_args,
)
from r3capture.kernels._common import (
    STATUS_BAD_BLOCK,
    STATUS_BAD_INDEX,
    STATUS_BAD_REJECTED,
    STATUS_BAD_ROWS,
    STATUS_NO_STOCK,
    STATUS_OK,
)

_HI_MASK = (1 << RECORD_HI_BITS) - 1
_SLOT_MASK = (1 << 32) - 1


def latest_hi(records: list[int], launch: int) -> tuple[int, int]:
    """``(hi, record to overwrite)`` of one request index's two records before ``launch``:
    the newer record tagged below ``launch`` holds ``hi`` (-1 with none), the other is the
    one this launch may overwrite."""
    tags = [r >> RECORD_HI_BITS for r in records]
    valid = [tag < launch for tag in tags]
    if valid[0] and (not valid[1] or tags[0] >= tags[1]):
        return (records[0] & _HI_MASK) - 1, 1
    if valid[1]:
        return (records[1] & _HI_MASK) - 1, 0
    return -1, 0


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
    """The reference on arguments the checks have already validated."""
    R = shape.num_reqs
    if R == 0:
        return
    B, N, D, Q, S = (
        static.hash_block, static.num_indices, static.ring_width, static.queue_size,
        static.num_slots,
    )  # fmt: skip
    launch = shape.launch

    def host(t: torch.Tensor, n: int) -> list[int]:
        return t[:n].to("cpu", torch.int64).tolist()

    qsl = host(args["query_start_loc"], R + 1)
    rejected = host(args["num_rejected"], R) if args["num_rejected"] is not None else [0] * R
    index = host(args["request_index"], R)
    fresh = [0] * R if args["fresh"] is None else host(args["fresh"], R)
    pos_all = args["positions"][: shape.row_limit].to("cpu", torch.int64)
    ring, records, queue = args["ring"], args["records"], args["queue"]
    heads = args["heads"]
    head = int(heads[launch % 2])
    available = shape.queue_tail - head
    qsl_sane = qsl[0] >= 0 and all(b >= a for a, b in zip(qsl, qsl[1:]))

    # Pass 1, as every program of the kernel does: each request's new blocks and its offset.
    plans = []
    offset = 0
    for r in range(R):
        q0, q1 = qsl[r], qsl[r + 1]
        n = q1 - q0
        accepted = n - rejected[r]
        bad_rows = not qsl_sane or q1 > shape.row_limit
        start = int(pos_all[q0]) if not bad_rows and n > 0 else -1
        bad_rejected = not bad_rows and not 0 <= rejected[r] <= n
        idx = index[r]
        bad_index = not bad_rows and not bad_rejected and not 0 <= idx < N
        is_fresh = fresh[r] != 0
        hi, overwrite = -1, 0
        if 0 <= idx < N and not is_fresh:
            hi, overwrite = latest_hi(host(records[idx], 2), launch)
        needs = not (bad_rows or bad_rejected or bad_index) and accepted > 0
        first = max(start, 0) // B
        last = (max(start, 0) + accepted - 1) // B
        bad_range = needs and (
            start < 0
            or last - first >= D
            or last >= BLOCK_LIMIT
            or (first <= hi and first < hi - D + 1)
        )
        new_first = max(first, hi + 1)
        new = max(0, last - new_first + 1) if needs and not bad_range else 0
        no_stock = new > 0 and offset + new > available
        plans.append(
            dict(q0=q0, n=n, accepted=accepted, start=start, idx=idx, fresh=is_fresh, hi=hi,
                 overwrite=overwrite, needs=needs, first=first, last=last, new_first=new_first,
                 new=new, offset=offset, bad_rows=bad_rows, bad_rejected=bad_rejected,
                 bad_index=bad_index, bad_range=bad_range, no_stock=no_stock)
        )  # fmt: skip
        offset += new

    # Pass 2: slots, statuses, writes.
    consumed_total = 0
    info = []
    for p in plans:
        slots = {}
        bad_slot = False
        if p["needs"] and not (p["bad_range"] or p["no_stock"]):
            for b in range(p["first"], p["last"] + 1):
                if b < p["new_first"]:
                    entry = int(ring[p["idx"], b % D])
                    slot = entry & _SLOT_MASK
                    ok = entry >> 32 == b and 0 <= slot < S
                else:
                    slot = int(queue[(head + p["offset"] + b - p["new_first"]) % Q])
                    ok = 0 <= slot < S
                bad_slot |= not ok
                slots[b] = slot
        status = (
            STATUS_BAD_ROWS if p["bad_rows"]
            else STATUS_BAD_REJECTED if p["bad_rejected"]
            else STATUS_BAD_INDEX if p["bad_index"]
            else STATUS_BAD_BLOCK if p["bad_range"]
            else STATUS_NO_STOCK if p["no_stock"]
            else STATUS_BAD_BLOCK if bad_slot
            else STATUS_OK
        )  # fmt: skip
        consumed = 0 if p["no_stock"] else p["new"]
        consumed_total += consumed
        info.append((p["start"], p["accepted"] if status == STATUS_OK else -1, status, consumed))
        if status == STATUS_OK and p["accepted"] > 0:
            _write_rows(args, static, p, slots)
            for b in range(p["new_first"], p["last"] + 1):
                ring[p["idx"], b % D] = (b << 32) | slots[b]
        new_hi = None
        if status == STATUS_OK and p["new"] > 0:
            new_hi = p["last"]
        elif p["fresh"] and 0 <= p["idx"] < N:
            new_hi = p["hi"]  # -1: the index's earlier owner's blocks are gone
        if new_hi is not None:
            records[p["idx"], p["overwrite"]] = (launch << RECORD_HI_BITS) | (new_hi + 1)
    heads[(launch + 1) % 2] = head + consumed_total
    step_info = args["step_info"]
    step_info[:R] = torch.tensor(info, dtype=torch.int32).to(step_info.device)


def _write_rows(args: dict, static: AllocStatic, plan: dict, slots: dict[int, int]) -> None:
    """Request ``plan``'s accepted rows, cast, into its slots (or staging rows)."""
    B = static.hash_block
    capture, dest = args["capture"], args["dest"]
    q0, accepted, start = plan["q0"], plan["accepted"], plan["start"]
    rows = capture[q0 : q0 + accepted].to(dest.device).to(dest.dtype)
    view = dest.view(torch.int16) if dest.dtype == torch.uint16 else dest
    rows = rows.view(torch.int16) if dest.dtype == torch.uint16 else rows
    if static.rows_layout:
        view[q0 : q0 + accepted] = rows
        return
    positions = torch.arange(start, start + accepted)
    first = start // B
    block_slots = torch.tensor([slots[b] for b in range(first, (start + accepted - 1) // B + 1)])
    index = (block_slots[positions // B - first].to(dest.device), (positions % B).to(dest.device))
    view[index] = rows
