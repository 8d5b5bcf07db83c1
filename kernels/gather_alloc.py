"""Gather each request's accepted rows into block-aligned slots the kernel takes itself.

One launch per engine step, after rejection sampling, with no host synchronization. Request
r's rows sit at token positions ``positions[qsl[r]] + i`` (the device's own positions, so a
request that reattached below the scheduler's view after a rejected speculative suffix is
placed correctly); the row of position ``p`` lands at ``dest[slot, p % B]``, cast to
``dest``'s dtype, so every complete hash block comes out whole and contiguous in its slot.
``dest`` is the pinned host arena itself (the kernel's stores cross PCIe directly) or, where
a GPU cannot write host memory, device staging in step-row order that the host places.

The slot planning is on the device (``docs/device_slots.md``): the host hands the launch no
table, only scalars, and the kernel finds each request's state by its request index (Model
Runner V2's persistent ``input_batch.idx_mapping``):

* ``ring [N, D]`` int64: entry ``(block << 32) | slot`` at column ``block % D`` of the
  request index's row, ``-1`` where none was written; only the blocks of the last ``D``
  are ever read, and an entry whose block is not the one asked for fails the request.
* ``records [N, 2]`` int64: ``(launch << 24) | (hi + 1)``, with ``hi`` the last block of the
  index that has a slot. The record with the greater launch tag below this launch holds it;
  a launch writes the other one, so every program of the launch reads the same ``hi``
  whatever order they run in. A fresh request (``fresh[r]`` nonzero: its index was held by
  another request before) has ``hi = -1`` and always writes its record. ``hi + 1 = 2**24 -
  1`` marks an index two requests of a launch shared.
* ``queue [Q]`` int32: free slots the host put there (entries ``head .. queue_tail - 1``,
  modulo ``Q``); ``heads [4]`` int64: launch ``n`` reads its head at ``heads[n % 2]`` and
  program 0 writes the next at ``heads[(n + 1) % 2]``; ``heads[2]`` is the serial of the
  last launch, which the program that finishes last writes (``heads[3]`` counts them).

A launch is a call with at least one request (``num_reqs >= 1``; a call with none launches
nothing and takes no serial); its serial must be the last launch's + 1, starting at 1. Any
other serial would read a stale head (a slot two indices share) or stale records: such a
launch fails every request with ``BAD_LAUNCH``, and every later one fails too until the
serial is the last launch's + 1 again.

Request ``r`` (start ``s = positions[qsl[r]]``, ``a`` accepted rows) covers blocks
``first = s // B .. last = (s + a - 1) // B``; blocks above ``hi`` are new and take queue
entries ``head + off .. head + off + new - 1``, where ``off`` sums the new blocks of the
requests before ``r`` in batch order (every program computes these prefix sums itself, so
no atomics are needed and the torch reference agrees slot for slot). The request tile that
owns ``r`` writes its new ring entries and its record. ``step_info[r]`` is ``(start,
accepted or -1, status, queue entries taken)``; a request whose new blocks pass the queue's
tail fails with ``NO_STOCK`` and takes none (and so does every later request that needs
any). A request with any non-OK status writes no row and no ring entry or record, except a
fresh request, which always resets its record.

Two or more requests of a launch on one index (``SHARED_INDEX``) all fail: each would read
the index's state as its own. They still take the queue entries their blocks need (every
program counted them in its prefix sums before it could know), and each marks the index, so
that every later launch fails a request on it until a fresh request takes it over. Every
program finds the requests that share its requests' indices in the same pass over the batch
that sums the queue offsets.

Preconditions the host keeps (the kernel cannot check them): a request keeps its index while
it lives and holds it alone across launches (the fresh flags say when it changes hands), and
the queue entries ``head .. queue_tail - 1`` name distinct free slots.

Work split: one 1-D grid of max(cdiv(num_rows bound, BLOCK_ROWS), cdiv(R, BLOCK_REQS))
programs (host-known bounds; rows past ``query_start_loc[R]`` are masked); every program
does two independent jobs, then counts itself done:
  * request tile ``pid``: validates ``BLOCK_REQS`` requests, writes their ``step_info`` row,
    their new ring entries and their records (program 0 also the next head);
  * row tile ``pid``: ``BLOCK_ROWS`` consecutive capture rows, each mapped to its request by
    a vectorized binary search over ``query_start_loc`` (log2(R) steps), columns L*K padded
    to a power of two.
Failing closed needs a request's status before any of its rows is written, and a request's
rows may span many row tiles; programs of one launch cannot wait for each other, so every
row tile recomputes the plan and status of the requests it touches (only the request's
first row in the tile checks its slots).

Naming: ``o_`` offsets, ``m_`` masks, ``p_`` pointers, ``b_`` loaded blocks; sizes in
lower case, compile-time block sizes in UPPER case.
"""

from __future__ import annotations

import importlib

import torch
import triton
import triton.language as tl

from r3capture.kernels._alloc_checks import (
    BLOCK_LIMIT,
    HEAD_DONE,
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
from r3capture.kernels._device import can_write_host_directly, kernel_address
from r3capture.kernels._launch import (
    _NUM_WARPS,
    _interpreting,
    _launch_variant,
    _tile_config,
    direct_launch_supported,
)

_OK = tl.constexpr(STATUS_OK)
_BAD_REJECTED = tl.constexpr(STATUS_BAD_REJECTED)
_BAD_BLOCK = tl.constexpr(STATUS_BAD_BLOCK)
_BAD_ROWS = tl.constexpr(STATUS_BAD_ROWS)
_BAD_INDEX = tl.constexpr(STATUS_BAD_INDEX)
_NO_STOCK = tl.constexpr(STATUS_NO_STOCK)
_BAD_LAUNCH = tl.constexpr(STATUS_BAD_LAUNCH)
_SHARED_INDEX = tl.constexpr(STATUS_SHARED_INDEX)
_SHARED = tl.constexpr(RECORD_SHARED)
_HEAD_SERIAL = tl.constexpr(HEAD_SERIAL)
_HEAD_DONE = tl.constexpr(HEAD_DONE)
_HI_BITS = tl.constexpr(RECORD_HI_BITS)
_HI_MASK = tl.constexpr((1 << RECORD_HI_BITS) - 1)
_BLOCK_LIMIT = tl.constexpr(BLOCK_LIMIT)
_SLOT_MASK = tl.constexpr((1 << 32) - 1)
# Blocks per slot-check tile and requests per prefix-sum chunk: [8, 64] tiles keep every
# specialization without spills on sm_80-sm_120 (ptxas -v); the row tiles' 512-wide scans
# spill here, where each tile holds several int64 values per element.
_ALLOC_SCAN = 64
_PLAN_CHUNK = 64


@triton.jit
def _qsl_is_sane(qsl_ptr, num_reqs, SCAN: tl.constexpr):
    """True when qsl[0] >= 0 and qsl[0..num_reqs] never decreases.

    Rows are mapped to requests by a binary search that is only meaningful on a sorted
    query_start_loc; anything else fails every request of the launch. Every program checks
    all of it (num_reqs / SCAN loads of an array that stays in L2).
    """
    num_bad = (tl.load(qsl_ptr).to(tl.int64) < 0).to(tl.int32)
    c0 = num_reqs * 0
    # A while loop, not range(): Triton 3.6's interpreter (with numpy >= 2.4) cannot use a
    # runtime value as a range() bound; compiled, it is the same short loop.
    while c0 < num_reqs:
        o_q = c0 + tl.arange(0, SCAN)
        m_q = o_q < num_reqs
        b_lo = tl.load(qsl_ptr + o_q, mask=m_q, other=0)
        b_hi = tl.load(qsl_ptr + o_q + 1, mask=m_q, other=0)
        num_bad += tl.sum((m_q & (b_hi < b_lo)).to(tl.int32), axis=0)
        c0 += SCAN
    return num_bad == 0


@triton.jit
def _request_plan(
    o_r,
    m_r,
    qsl_ptr,
    pos_ptr,
    idx_ptr,
    rejected_ptr,
    fresh_ptr,
    record_ptr,
    qsl_sane,
    row_limit,
    num_indices,
    ring_width,
    launch,
    HAS_REJECTED: tl.constexpr,
    HAS_FRESH: tl.constexpr,
    HASH_BLOCK: tl.constexpr,
):
    """Everything about requests ``o_r`` that needs no other request and no slot. [N] each."""
    q_begin = tl.load(qsl_ptr + o_r, mask=m_r, other=0).to(tl.int64)
    q_end = tl.load(qsl_ptr + o_r + 1, mask=m_r, other=0).to(tl.int64)
    num_sched = q_end - q_begin
    if HAS_REJECTED:
        rejected = tl.load(rejected_ptr + o_r, mask=m_r, other=0).to(tl.int64)
    else:
        rejected = tl.zeros_like(num_sched)
    accepted = num_sched - rejected
    bad_rows = ~qsl_sane | (q_end > row_limit)
    readable = m_r & ~bad_rows & (num_sched > 0)
    start = tl.load(pos_ptr + q_begin, mask=readable, other=-1).to(tl.int64)
    bad_rejected = ~bad_rows & ((rejected < 0) | (rejected > num_sched))
    idx = tl.load(idx_ptr + o_r, mask=m_r, other=-1).to(tl.int64)
    idx_ok = (idx >= 0) & (idx < num_indices)
    bad_index = ~bad_rows & ~bad_rejected & ~idx_ok
    if HAS_FRESH:
        fresh = tl.load(fresh_ptr + o_r, mask=m_r, other=0).to(tl.int32) != 0
    else:
        fresh = tl.zeros_like(m_r)

    # A fresh request reads the records too, only to overwrite the older one like any other:
    # a request that shares its index must still read the same record.
    m_rec = m_r & idx_ok
    rec0 = tl.load(record_ptr + idx * 2, mask=m_rec, other=0)
    rec1 = tl.load(record_ptr + idx * 2 + 1, mask=m_rec, other=0)
    tag0 = rec0 >> _HI_BITS
    tag1 = rec1 >> _HI_BITS
    valid0 = m_rec & (tag0 < launch)
    valid1 = m_rec & (tag1 < launch)
    use0 = valid0 & (~valid1 | (tag0 >= tag1))
    held = tl.where(~fresh & (use0 | valid1), tl.where(use0, rec0, rec1) & _HI_MASK, 0)
    shared = held == _SHARED
    hi = held - 1
    overwrite = tl.where(use0, 1, 0).to(tl.int64)

    needs = m_r & ~bad_rows & ~bad_rejected & ~bad_index & ~shared & (accepted > 0)
    safe_start = tl.maximum(start, 0)
    first = safe_start // HASH_BLOCK
    last = (safe_start + accepted - 1) // HASH_BLOCK
    bad_range = needs & (
        (start < 0)
        | (last - first >= ring_width)
        | (last >= _BLOCK_LIMIT)
        | ((first <= hi) & (first < hi - ring_width + 1))
    )
    new_first = tl.maximum(first, hi + 1)
    new = tl.where(needs & ~bad_range, tl.maximum(last - new_first + 1, 0), 0)
    return (
        q_begin, q_end, start, accepted, idx, idx_ok, fresh, hi, overwrite, needs, first, last,
        new_first, new, bad_rows, bad_rejected, bad_index, shared, bad_range,
    )  # fmt: skip


@triton.jit
def _queue_offsets(
    o_t,
    idx_t,
    num_reqs,
    available,
    qsl_ptr,
    pos_ptr,
    idx_ptr,
    rejected_ptr,
    fresh_ptr,
    record_ptr,
    qsl_sane,
    row_limit,
    num_indices,
    ring_width,
    launch,
    HAS_REJECTED: tl.constexpr,
    HAS_FRESH: tl.constexpr,
    HASH_BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """``(off, taken, shared)``: for each request ``o_t`` (of index ``idx_t``) the new blocks
    of the requests before it in batch order ([N] int64), the queue entries the whole launch
    takes (scalar), and whether another request of the launch has its index ([N] bool; an
    index outside [0, N) is no request's)."""
    off = tl.zeros_like(o_t)
    shared = o_t < 0
    running = num_reqs.to(tl.int64) * 0
    taken = running
    c0 = num_reqs * 0
    while c0 < num_reqs:  # not range(): see _qsl_is_sane
        o_c = c0 + tl.arange(0, CHUNK)
        m_c = o_c < num_reqs
        (
            _, _, _, _, idx_c, idx_ok_c, _, _, _, _, _, _, _, new_c, _, _, _, _, _,
        ) = _request_plan(
            o_c, m_c, qsl_ptr, pos_ptr, idx_ptr, rejected_ptr, fresh_ptr, record_ptr, qsl_sane,
            row_limit, num_indices, ring_width, launch, HAS_REJECTED, HAS_FRESH, HASH_BLOCK,
        )  # fmt: skip
        before = o_c[None, :] < o_t[:, None]  # [N, CHUNK]
        off += tl.sum(tl.where(before, new_c[None, :], 0), axis=1)
        same = (idx_c[None, :] == idx_t[:, None]) & (o_c[None, :] != o_t[:, None])
        same = same & idx_ok_c[None, :]  # [N, CHUNK]
        shared = shared | (tl.max(same.to(tl.int32), axis=1) > 0)
        through = running + tl.cumsum(new_c, axis=0)
        taken += tl.sum(tl.where(through <= available, new_c, 0), axis=0)
        running += tl.sum(new_c, axis=0)
        c0 += CHUNK
    return off, taken, shared


@triton.jit
def _any_bad_slot(
    idx,
    first,
    last,
    new_first,
    off,
    head,
    check,
    ring_ptr,
    queue_ptr,
    stride_ring,
    ring_width,
    queue_size,
    num_slots,
    SCAN: tl.constexpr,
):
    """[N] bool: some block ``first ..= last`` (of the requests where ``check``) has no
    valid slot: an old block whose ring entry names another block or a slot outside
    [0, num_slots), or a new block whose queue entry is outside it."""
    bad = tl.zeros_like(check)
    num_cols = tl.where(check, last - first + 1, 0)
    max_cols = tl.max(num_cols, axis=0)
    c0 = max_cols * 0
    while c0 < max_cols:
        o_c = c0 + tl.arange(0, SCAN)
        m_c = o_c[None, :] < num_cols[:, None]  # [N, SCAN]
        block = first[:, None] + o_c[None, :]
        old = block < new_first[:, None]
        p_ring = ring_ptr + idx[:, None] * stride_ring + block % ring_width
        entry = tl.load(p_ring, mask=m_c & old, other=-1)
        where = (head + off[:, None] + block - new_first[:, None]) % queue_size
        queued = tl.load(queue_ptr + where, mask=m_c & ~old, other=-1).to(tl.int64)
        slot = tl.where(old, entry & _SLOT_MASK, queued)
        b_bad = m_c & ((old & ((entry >> 32) != block)) | (slot < 0) | (slot >= num_slots))
        bad = bad | (tl.max(b_bad.to(tl.int32), axis=1) > 0)
        c0 += SCAN
    return bad


@triton.jit
def _request_tile(
    o_r,
    m_r,
    p_info,
    qsl_ptr,
    pos_ptr,
    idx_ptr,
    rejected_ptr,
    fresh_ptr,
    ring_ptr,
    record_ptr,
    queue_ptr,
    heads_ptr,
    qsl_sane,
    num_reqs,
    available,
    head,
    row_limit,
    num_slots,
    num_indices,
    ring_width,
    queue_size,
    launch,
    stride_ring,
    writes_head,
    HAS_REJECTED: tl.constexpr,
    HAS_FRESH: tl.constexpr,
    HASH_BLOCK: tl.constexpr,
    SCAN: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Requests ``o_r`` of a launch with a good serial: their ``step_info`` rows (at
    ``p_info``), ring entries and records, and (``writes_head``) the next queue head."""
    (
        _, _, start, accepted, idx, idx_ok, fresh, hi, overwrite, needs, first, last,
        new_first, new, bad_rows, bad_rejected, bad_index, shared_before, bad_range,
    ) = _request_plan(
        o_r, m_r, qsl_ptr, pos_ptr, idx_ptr, rejected_ptr, fresh_ptr, record_ptr, qsl_sane,
        row_limit, num_indices, ring_width, launch, HAS_REJECTED, HAS_FRESH, HASH_BLOCK,
    )  # fmt: skip
    off, taken, shared = _queue_offsets(
        o_r, idx, num_reqs, available, qsl_ptr, pos_ptr, idx_ptr, rejected_ptr, fresh_ptr,
        record_ptr, qsl_sane, row_limit, num_indices, ring_width, launch, HAS_REJECTED,
        HAS_FRESH, HASH_BLOCK, CHUNK,
    )  # fmt: skip
    no_stock = (new > 0) & (off + new > available)
    bad_slot = _any_bad_slot(
        idx, first, last, new_first, off, head, needs & ~bad_range & ~no_stock, ring_ptr,
        queue_ptr, stride_ring, ring_width, queue_size, num_slots, SCAN,
    )  # fmt: skip
    status = tl.where(
        bad_rows, _BAD_ROWS,
        tl.where(bad_rejected, _BAD_REJECTED,
        tl.where(bad_index, _BAD_INDEX,
        tl.where(shared | shared_before, _SHARED_INDEX,
        tl.where(bad_range, _BAD_BLOCK,
        tl.where(no_stock, _NO_STOCK,
        tl.where(bad_slot, _BAD_BLOCK, _OK)))))),
    )  # fmt: skip
    ok = m_r & (status == _OK)
    tl.store(p_info, start.to(tl.int32), mask=m_r)
    tl.store(p_info + 1, tl.where(ok, accepted, -1).to(tl.int32), mask=m_r)
    tl.store(p_info + 2, status.to(tl.int32), mask=m_r)
    # A request sharing its index still takes its entries: every program counted them in
    # its prefix sums before it could know.
    tl.store(p_info + 3, tl.where(no_stock, 0, new).to(tl.int32), mask=m_r)

    num_new = tl.where(ok, new, 0)
    max_new = tl.max(num_new, axis=0)
    c0 = max_new * 0
    while c0 < max_new:
        o_c = c0 + tl.arange(0, SCAN)
        m_c = o_c[None, :] < num_new[:, None]  # [BLOCK_REQS, SCAN]
        where = (head + off[:, None] + o_c[None, :]) % queue_size
        slot = tl.load(queue_ptr + where, mask=m_c, other=0).to(tl.int64)
        block = new_first[:, None] + o_c[None, :]
        p_ring = ring_ptr + idx[:, None] * stride_ring + block % ring_width
        tl.store(p_ring, (block << 32) | slot, mask=m_c)
        c0 += SCAN
    # Every request sharing an index marks it, with the same value in the same record, so
    # that later launches fail it until a fresh request takes it.
    grown = ok & (new > 0)
    write_record = m_r & idx_ok & (grown | fresh | shared)
    held = tl.where(shared, _SHARED, tl.where(grown, last, hi) + 1)
    tl.store(record_ptr + idx * 2 + overwrite, (launch << _HI_BITS) | held, mask=write_record)
    if writes_head:
        tl.store(heads_ptr + (launch + 1) % 2, head + taken)


@triton.jit(
    do_not_specialize=[
        "num_reqs", "row_limit", "num_slots", "num_indices", "ring_width", "queue_size",
        "num_steps", "launch", "queue_tail", "stride_ring", "stride_info",
    ],
    do_not_specialize_on_alignment=["qsl_ptr", "pos_ptr", "idx_ptr", "rejected_ptr", "fresh_ptr"],
)  # fmt: skip
def _gather_alloc_kernel(
    # pointers
    capture_ptr,
    qsl_ptr,
    pos_ptr,
    idx_ptr,
    rejected_ptr,
    fresh_ptr,
    ring_ptr,
    record_ptr,
    queue_ptr,
    heads_ptr,
    dest_ptr,
    info_ptr,
    # sizes and scalars
    num_reqs,
    row_limit,
    num_slots,
    num_indices,
    ring_width,
    queue_size,
    num_steps,
    launch,
    queue_tail,
    # strides, in elements
    stride_ring,
    stride_dest,
    stride_info,
    # meta
    ROW_ELEMS: tl.constexpr,
    HASH_BLOCK: tl.constexpr,
    HAS_REJECTED: tl.constexpr,
    HAS_FRESH: tl.constexpr,
    ROWS_LAYOUT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_REQS: tl.constexpr,
    SCAN: tl.constexpr,
    CHUNK: tl.constexpr,
):
    i_p = tl.program_id(0).to(tl.int64)
    launch = launch.to(tl.int64)
    # A launch with any serial but the last launch's + 1 would read a stale head and stale
    # records: it fails every request and changes nothing but step_info.
    launch_ok = tl.load(heads_ptr + _HEAD_SERIAL) == launch - 1
    qsl_sane = _qsl_is_sane(qsl_ptr, num_reqs, SCAN)
    head = tl.load(heads_ptr + launch % 2)
    available = queue_tail.to(tl.int64) - head

    # Job 1: step_info, ring entries and records for requests [i_p * BLOCK_REQS, ...).
    if i_p * BLOCK_REQS < num_reqs:
        o_r = i_p * BLOCK_REQS + tl.arange(0, BLOCK_REQS)
        m_r = o_r < num_reqs
        p_info = info_ptr + o_r * stride_info
        if launch_ok:
            _request_tile(
                o_r, m_r, p_info, qsl_ptr, pos_ptr, idx_ptr, rejected_ptr, fresh_ptr, ring_ptr,
                record_ptr, queue_ptr, heads_ptr, qsl_sane, num_reqs, available, head,
                row_limit, num_slots, num_indices, ring_width, queue_size, launch, stride_ring,
                i_p == 0, HAS_REJECTED, HAS_FRESH, HASH_BLOCK, SCAN, CHUNK,
            )  # fmt: skip
        else:
            tl.store(p_info, -1, mask=m_r)
            tl.store(p_info + 1, -1, mask=m_r)
            tl.store(p_info + 2, _BAD_LAUNCH, mask=m_r)
            tl.store(p_info + 3, 0, mask=m_r)

    # Job 2: capture rows [i_p * BLOCK_ROWS, ...) of the step.
    num_rows = tl.minimum(tl.load(qsl_ptr + num_reqs).to(tl.int64), row_limit)
    row_start = i_p * BLOCK_ROWS
    if launch_ok & qsl_sane & (row_start < num_rows):
        o_t = row_start + tl.arange(0, BLOCK_ROWS)
        m_t = o_t < num_rows
        lo = tl.zeros([BLOCK_ROWS], dtype=tl.int64)
        hi_r = tl.zeros([BLOCK_ROWS], dtype=tl.int64) + num_reqs
        step = num_steps * 0
        while step < num_steps:
            mid = (lo + hi_r) // 2
            m_mid = m_t & (hi_r - lo > 1)
            b_mid = tl.load(qsl_ptr + mid, mask=m_mid, other=0).to(tl.int64)
            go_right = b_mid <= o_t
            lo = tl.where(m_mid & go_right, mid, lo)
            hi_r = tl.where(m_mid & ~go_right, mid, hi_r)
            step += 1
        o_r = lo
        (
            q_begin, q_end, start, accepted, idx, _, _, hi, _, needs, first, last,
            new_first, new, bad_rows, bad_rejected, bad_index, _, bad_range,
        ) = _request_plan(
            o_r, m_t, qsl_ptr, pos_ptr, idx_ptr, rejected_ptr, fresh_ptr, record_ptr, qsl_sane,
            row_limit, num_indices, ring_width, launch, HAS_REJECTED, HAS_FRESH, HASH_BLOCK,
        )  # fmt: skip
        off, _, shared = _queue_offsets(
            o_r, idx, num_reqs, available, qsl_ptr, pos_ptr, idx_ptr, rejected_ptr, fresh_ptr,
            record_ptr, qsl_sane, row_limit, num_indices, ring_width, launch, HAS_REJECTED,
            HAS_FRESH, HASH_BLOCK, CHUNK,
        )  # fmt: skip
        no_stock = (new > 0) & (off + new > available)
        owned = m_t & (q_begin <= o_t) & (o_t < q_end)
        leader = owned & ((o_t == q_begin) | (o_t == row_start))
        check = leader & needs & ~bad_range & ~no_stock
        bad_slot = _any_bad_slot(
            idx, first, last, new_first, off, head, check, ring_ptr, queue_ptr, stride_ring,
            ring_width, queue_size, num_slots, SCAN,
        )  # fmt: skip
        same_req = (o_r[:, None] == o_r[None, :]) & (leader & bad_slot)[None, :]
        bad_slot = tl.max(same_req.to(tl.int32), axis=1) > 0
        ok = needs & ~bad_range & ~no_stock & ~bad_slot & ~shared

        i_row = o_t - q_begin
        write = owned & ok & (i_row < accepted)
        pos = tl.where(write, start + i_row, 0)
        block = pos // HASH_BLOCK
        old = block < new_first
        entry = tl.load(
            ring_ptr + idx * stride_ring + block % ring_width, mask=write & old, other=-1
        )
        where = (head + off + block - new_first) % queue_size
        queued = tl.load(queue_ptr + where, mask=write & ~old, other=-1).to(tl.int64)
        b_slot = tl.where(old, entry & _SLOT_MASK, queued)
        # Implied by ok; repeated per row so that no bug in the checks can ever turn into a
        # store outside the arena.
        write = write & (b_slot >= 0) & (b_slot < num_slots)

        o_e = tl.arange(0, BLOCK_COLS)
        m_e = o_e < ROW_ELEMS
        m_tile = write[:, None] & m_e[None, :]
        b_rows = tl.load(capture_ptr + o_t[:, None] * ROW_ELEMS + o_e[None, :], mask=m_tile)
        if ROWS_LAYOUT:
            dst_row = o_t * stride_dest
        else:
            dst_row = b_slot * stride_dest + (pos % HASH_BLOCK) * ROW_ELEMS
        p_dst = dest_ptr + dst_row[:, None] + o_e[None, :]
        tl.store(p_dst, b_rows.to(dest_ptr.dtype.element_ty), mask=m_tile)

    # The serial is recorded once no program can still read the last one: by the program
    # that finishes last (its count, taken after every thread of it is past its reads).
    tl.debug_barrier()
    done = tl.atomic_add(heads_ptr + _HEAD_DONE, 1, sem="acq_rel")
    if done == tl.num_programs(0) - 1:
        tl.store(heads_ptr + _HEAD_DONE, 0)
        tl.store(heads_ptr + _HEAD_SERIAL, launch, mask=launch_ok)


def _check_triton_place(capture: torch.Tensor, host_side: dict[str, torch.Tensor]) -> None:
    """The Triton kernel runs on a CUDA capture, or under the interpreter; on a GPU, the
    tensors of ``host_side`` in (pinned) host memory need one that maps it."""
    if not capture.is_cuda and not _interpreting():
        raise ValueError(
            "gather_alloc: impl='triton' needs a CUDA capture or TRITON_INTERPRET=1 "
            f"(capture is on {capture.device}); use impl='reference' or 'auto'"
        )
    for name, t in host_side.items():
        if capture.is_cuda and t.device.type == "cpu" and t.numel():
            if not can_write_host_directly(capture.device):
                raise ValueError(
                    f"gather_alloc: {name} is pinned host memory, but kernels on "
                    f"{capture.device} cannot reach host memory directly (no unified "
                    "addressing); pass a device tensor (staging for dest)"
                )


# The kernel arguments that change from launch to launch, in the order launch_checked
# passes them.
_STEP_ARGS = (
    "qsl_ptr", "pos_ptr", "idx_ptr", "rejected_ptr", "fresh_ptr", "num_reqs", "row_limit",
    "num_steps", "launch", "queue_tail", "HAS_REJECTED", "HAS_FRESH",
)  # fmt: skip
_INT32_MAX = 2**31 - 1


class GatherAllocLaunch:
    """``gather_alloc`` with its step-independent arguments validated once (see the module
    docstring for the state): ``capture [T, L, K]``, ``ring [N, D]`` and ``records [N, 2]``
    int64 and ``heads [4]`` int64 on the capture's device, ``queue [Q]`` int32 there or in
    pinned host memory, ``dest`` (``[S, B, L, K]`` slots or ``[rows, L, K]`` staging, on the
    capture's device or in pinned host memory) and ``step_info [>= R, 4]`` int32 (on the
    capture's device or in pinned host memory).

    The per-step hot path: the step-independent arguments are checked at construction;
    each call checks only what changes and launches (on a GPU, after the first launch of
    each per-step type combination, the compiled variant directly: ``_launch``)."""

    def __init__(
        self,
        capture: torch.Tensor,
        ring: torch.Tensor,
        records: torch.Tensor,
        queue: torch.Tensor,
        heads: torch.Tensor,
        dest: torch.Tensor,
        step_info: torch.Tensor,
        *,
        hash_block: int | None = None,
        num_slots: int | None = None,
        impl: str = "auto",
    ) -> None:
        if impl not in ("auto", "triton", "reference"):
            raise ValueError(
                f"gather_alloc: impl must be 'auto', 'triton' or 'reference'; got {impl!r}"
            )
        self._args = dict(
            capture=capture, ring=ring, records=records, queue=queue, heads=heads, dest=dest,
            step_info=step_info,
        )  # fmt: skip
        self._static = check_alloc_static_args(
            **self._args, hash_block=hash_block, num_slots=num_slots
        )
        self._use_triton = impl == "triton" or (
            impl == "auto" and (capture.is_cuda or _interpreting())
        )
        if self._use_triton:
            _check_triton_place(capture, dict(dest=dest, step_info=step_info, queue=queue))
        if not self._use_triton:
            # The kernel code never depends on its oracle: imported only when chosen.
            self._reference = importlib.import_module("r3capture.kernels.alloc_reference")
            # The reference's arguments, the step's filled in at each launch.
            self._reference_args = dict(self._args)
        static = self._static
        tiles = _tile_config(static.num_layers * static.top_k)
        self._tiles = tiles
        self._kernel_args = dict(
            capture_ptr=capture, ring_ptr=ring, record_ptr=records, queue_ptr=queue,
            heads_ptr=heads, dest_ptr=dest, info_ptr=step_info, num_slots=static.num_slots,
            num_indices=static.num_indices, ring_width=static.ring_width,
            queue_size=static.queue_size, stride_ring=ring.stride(0),
            stride_dest=dest.stride(0), stride_info=step_info.stride(0),
            ROW_ELEMS=static.num_layers * static.top_k, HASH_BLOCK=static.hash_block,
            ROWS_LAYOUT=static.rows_layout, BLOCK_ROWS=tiles["BLOCK_ROWS"],
            BLOCK_COLS=tiles["BLOCK_COLS"], BLOCK_REQS=tiles["BLOCK_REQS"],
            SCAN=min(_ALLOC_SCAN, tiles["SCAN_ROWS"]),
            CHUNK=min(_PLAN_CHUNK, tiles["SCAN_ROWS"]),
            num_warps=_NUM_WARPS,
        )  # fmt: skip
        # The variant Triton's JIT picked for each per-step type combination, launched
        # directly after its first launch (``_launch`` says why); none under the interpreter
        # or on a Triton the direct launch is not tested on. The step-independent tensors go
        # to compiled variants as kernel addresses, resolved once: Triton's launcher would
        # otherwise call data_ptr() and ask the driver for each of them on every launch.
        self._variants: dict[tuple, object] | None = None
        if self._use_triton and not _interpreting():
            self._device_index = capture.device.index
            active = triton.runtime.driver.active
            self._current_device = active.get_current_device
            self._current_stream = active.get_current_stream
            if direct_launch_supported():
                self._variants = {}
                names = _gather_alloc_kernel.arg_names
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
    def static(self) -> AllocStatic:
        """The validated step-independent arguments (``check_alloc_step_args`` checks a step
        against them)."""
        return self._static

    @property
    def step_info(self) -> torch.Tensor:
        """The ``[>= R, 4]`` int32 tensor each launch writes its results to."""
        return self._args["step_info"]

    def check_step(
        self,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        request_index: torch.Tensor,
        num_rejected: torch.Tensor | None = None,
        fresh: torch.Tensor | None = None,
        *,
        launch: int,
        queue_tail: int,
        num_reqs: int | None = None,
        num_rows: int | None = None,
    ) -> AllocShape:
        """Validate one launch's arguments (see ``gather_alloc``) without launching."""
        return check_alloc_step_args(
            self._static, query_start_loc=query_start_loc, positions=positions,
            request_index=request_index, num_rejected=num_rejected, fresh=fresh,
            num_reqs=num_reqs, num_rows=num_rows, launch=launch, queue_tail=queue_tail,
        )  # fmt: skip

    def __call__(
        self,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        request_index: torch.Tensor,
        num_rejected: torch.Tensor | None = None,
        fresh: torch.Tensor | None = None,
        *,
        launch: int,
        queue_tail: int,
        num_reqs: int | None = None,
        num_rows: int | None = None,
    ) -> None:
        """Launch once (``gather_alloc``'s arguments)."""
        shape = self.check_step(
            query_start_loc, positions, request_index, num_rejected, fresh, launch=launch,
            queue_tail=queue_tail, num_reqs=num_reqs, num_rows=num_rows,
        )  # fmt: skip
        self.launch_checked(shape, query_start_loc, positions, request_index, num_rejected, fresh)

    def launch_checked(
        self,
        shape: AllocShape,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        request_index: torch.Tensor,
        num_rejected: torch.Tensor | None,
        fresh: torch.Tensor | None,
    ) -> None:
        """Launch with arguments ``check_step`` returned ``shape`` for."""
        if shape.num_reqs == 0:
            return
        if not self._use_triton:
            args = self._reference_args
            args["query_start_loc"] = query_start_loc
            args["positions"] = positions
            args["request_index"] = request_index
            args["num_rejected"] = num_rejected
            args["fresh"] = fresh
            self._reference.gather_alloc_reference_checked(args, self._static, shape)
            return
        tiles = self._tiles
        grid = (
            max(
                -(-shape.row_limit // tiles["BLOCK_ROWS"]),
                -(-shape.num_reqs // tiles["BLOCK_REQS"]),
            ),
        )
        # Pointers that a constexpr flag keeps unread: any valid one keeps the signature.
        unused = self._args["heads"]
        step_args = (
            query_start_loc,
            positions,
            request_index,
            num_rejected if num_rejected is not None else unused,
            fresh if fresh is not None else unused,
            shape.num_reqs,
            shape.row_limit,
            (shape.num_reqs - 1).bit_length(),
            shape.launch,
            shape.queue_tail,
            num_rejected is not None,
            fresh is not None,
        )
        capture = self._args["capture"]
        if capture.is_cuda and self._current_device() != self._device_index:
            with torch.cuda.device(capture.device):
                self._launch_triton(grid, step_args)
        else:
            self._launch_triton(grid, step_args)

    def _launch_triton(self, grid: tuple[int], step_args: tuple) -> None:
        """Launch with ``step_args`` (``_STEP_ARGS``' values): through Triton's JIT the first
        time for each per-step type combination, then that variant directly."""
        variants = self._variants
        key = None
        if variants is not None:
            key = (
                *(t.dtype for t in step_args[:5]),
                *step_args[-2:],
                # Triton types an int argument as i64 past int32: another variant.
                step_args[8] > _INT32_MAX,
                step_args[9] > _INT32_MAX,
            )
            variant = variants.get(key)
            if variant is not None:
                args = self._positional.copy()
                for slot, value in zip(self._step_slots, step_args):
                    args[slot] = value
                _launch_variant(variant, grid[0], self._current_stream(self._device_index), args)
                return
        compiled = _gather_alloc_kernel[grid](
            **self._kernel_args, **dict(zip(_STEP_ARGS, step_args))
        )
        if key is not None:
            variants[key] = compiled


def gather_alloc(
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
    impl: str = "auto",
) -> None:
    """Write each request's accepted rows block-aligned into slots, taking new slots from
    the queue (module docstring: the state, the statuses, the preconditions).

    Args:
        capture: [T, L, K] int32 (vLLM's capture buffer), uint8 or uint16; contiguous.
        query_start_loc: [>= R+1] int32/int64; request r owns rows ``qsl[r] .. qsl[r+1]-1``.
            Must start at >= 0 and never decrease; otherwise every request is BAD_ROWS.
        positions: [>= num_rows] int32/int64, the token position of each row (MRV2's
            ``input_batch.positions``); request r's rows sit at ``positions[qsl[r]] + i``.
        request_index: [>= R] int32/int64 on the device, the request's row of
            ``ring``/``records`` (MRV2's ``input_batch.idx_mapping``). Requests of one
            launch sharing an index all fail with SHARED_INDEX, and so does every later
            request on it until a fresh one takes it.
        ring, records, queue, heads: the state (module docstring); a new state is ``ring``
            all -1 and ``records`` and ``heads [4]`` all 0.
        dest: ``[S, B, L, K]`` uint8/uint16 slots (the row of position p goes to
            ``dest[slot, p % B]``) or ``[>= num_rows, L, K]`` device staging (row t goes to
            ``dest[t]``); on capture's device, or pinned host memory when
            ``can_write_host_directly(capture.device)``.
        step_info: [>= R, 4] int32, out: ``(start or -1, accepted rows or -1, status,
            queue entries taken)``.
        num_rejected: [>= R] int32/int64 (rejected speculative rows at the end of each
            request's range), or None when nothing is rejected.
        fresh: [>= R] bool/uint8/int32 or None (nonzero: the request's index is new to it).
        launch: this launch's serial: the last launch's + 1 over the launches that share the
            state, 1 for the first. A call with ``num_reqs = 0`` is no launch and takes no
            serial. Any other serial fails every request with BAD_LAUNCH and changes
            nothing but ``step_info``.
        queue_tail: entries ever put in the queue.
        num_reqs: R (default ``len(query_start_loc) - 1``).
        num_rows: bound on the step's row count (default T); sizes the grid. Requests whose
            rows pass it get status BAD_ROWS, never a silent partial write.
        hash_block: B; required for the rows layout, else must match ``dest.shape[1]``.
        num_slots: S, the slots the queue and ring may name; required for the rows layout,
            else at most ``dest.shape[0]`` (default).
        impl: "auto" (Triton on CUDA or under TRITON_INTERPRET=1, else the torch reference),
            "triton" or "reference".

    Row i < a of request r is ``capture[qsl[r] + i]`` cast (wrapping, as torch ``.to``) to
    ``dest.dtype``. A request with a nonzero status (see ``Status``) writes nothing. No
    allocation, no host synchronization on the Triton path; raises
    ``KernelArgumentError`` (a ValueError) naming the argument for a malformed call.
    """
    GatherAllocLaunch(
        capture, ring, records, queue, heads, dest, step_info, hash_block=hash_block,
        num_slots=num_slots, impl=impl,
    )(
        query_start_loc, positions, request_index, num_rejected, fresh, launch=launch,
        queue_tail=queue_tail, num_reqs=num_reqs, num_rows=num_rows,
    )  # fmt: skip
