"""Argument checks shared by the slot-taking gather kernel's launcher and its reference.

Same rules as ``_common`` (host-visible properties only: shapes, dtypes, devices, strides;
values on the device are checked by the kernel and reported per request), for the state
``gather_alloc`` keeps on the device (``docs/device_slots.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch

from r3capture.kernels._common import (
    CAPTURE_DTYPES,
    INDEX_DTYPES,
    _check_dest,
    _fail,
    _inner_dense,
    _is_count,
    _same_memory,
)

# Records pack (launch serial << RECORD_HI_BITS) | (hi + 1); ring entries (block << 32) | slot.
RECORD_HI_BITS = 24
BLOCK_LIMIT = (1 << RECORD_HI_BITS) - 2  # hash blocks 0 .. BLOCK_LIMIT - 1 have slots
# The hi + 1 of a record no block reaches: the index was shared by two requests of a launch.
RECORD_SHARED = (1 << RECORD_HI_BITS) - 1
LAUNCH_LIMIT = 1 << (63 - RECORD_HI_BITS)
# heads [HEADS_LEN] int64: the queue head of even and of odd launches, the serial of the last
# launch, and the programs of the running launch that have finished (0 between launches).
HEADS_LEN = 4
HEAD_SERIAL = 2
HEAD_DONE = 3
# Per-request flags (nonzero: the request's index is new to it this launch).
FRESH_DTYPES = (torch.bool, torch.uint8, torch.int32)


class AllocShape(NamedTuple):
    """Host-side sizes and scalars of one ``gather_alloc`` launch, after validation."""

    num_reqs: int
    row_limit: int
    launch: int
    queue_tail: int


# NamedTuple's generated ``__new__`` is a Python frame; a launch builds its shape directly
# from a tuple of the four fields.
new_alloc_shape = partial(tuple.__new__, AllocShape)


@dataclass(frozen=True)
class AllocStatic:
    """The validated step-independent arguments of ``gather_alloc``."""

    num_layers: int
    top_k: int
    hash_block: int
    num_slots: int
    rows_layout: bool
    capture_rows: int
    dest_rows: int
    num_indices: int  # N: request indices the ring and records cover
    ring_width: int  # D
    queue_size: int  # Q
    max_requests: int  # step_info rows
    device: torch.device
    # ``device``'s CUDA index, CPU_INDEX for the CPU, None for any other device (whose
    # launches ``step_tensors_pass`` never passes): what its device test compares.
    device_index: int | None


CPU_INDEX = -1


def _device_index(device: torch.device) -> int | None:
    """``AllocStatic.device_index`` of ``device`` (a tensor's: a CUDA one has its index)."""
    if device.type == "cuda":
        return device.index
    return CPU_INDEX if device.type == "cpu" else None


def _tensor(name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise _fail(name, "a torch.Tensor", type(t).__name__)
    if t.dim() != ndim:
        raise _fail(name, f"{ndim}-D", t)
    if t.dtype not in dtypes:
        names = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        raise _fail(name, f"of dtype {names}", t)
    return t


def _on(name: str, t: torch.Tensor, device: torch.device, *, pinned_ok: bool = False) -> None:
    if t.device == device:
        return
    if pinned_ok and device.type == "cuda" and t.device.type == "cpu" and t.is_pinned():
        return
    where = f"on the capture's device ({device})"
    raise _fail(name, where + (" or pinned host memory" if pinned_ok else ""), t)


def _dense(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise _fail(name, "contiguous (the kernel reads it as a dense array)", t)


def check_alloc_static_args(
    *,
    capture: torch.Tensor,
    ring: torch.Tensor,
    records: torch.Tensor,
    queue: torch.Tensor,
    heads: torch.Tensor,
    dest: torch.Tensor,
    step_info: torch.Tensor,
    hash_block: int | None,
    num_slots: int | None,
) -> AllocStatic:
    """Validate what stays the same from launch to launch; raises ValueError naming it."""
    capture = _tensor("capture", capture, 3, CAPTURE_DTYPES)
    num_cap_rows, num_layers, top_k = capture.shape
    if num_layers == 0 or top_k == 0:
        raise _fail("capture", "non-empty in L and K", capture)
    if not _inner_dense(capture, 0):
        raise _fail("capture", "contiguous", capture)
    hash_block, num_slots, rows_layout = _check_dest(dest, capture, hash_block, num_slots)
    device = capture.device
    ring = _tensor("ring", ring, 2, (torch.int64,))
    if ring.shape[1] == 0 or (ring.shape[1] > 1 and ring.stride(1) != 1):
        raise _fail("ring", "[N, D] with D >= 1, contiguous along dim 1", ring)
    records = _tensor("records", records, 2, (torch.int64,))
    # The kernel reads a request's records at index * 2: the rows must be dense too.
    if records.shape != (ring.shape[0], 2) or not records.is_contiguous():
        raise _fail("records", f"[N, 2] (N = {ring.shape[0]} ring rows), dense rows", records)
    queue = _tensor("queue", queue, 1, (torch.int32,))
    if queue.shape[0] == 0:
        raise _fail("queue", "non-empty", queue)
    _dense("queue", queue)
    heads = _tensor("heads", heads, 1, (torch.int64,))
    if heads.shape[0] != HEADS_LEN:
        raise _fail(
            "heads", f"[{HEADS_LEN}] (two queue heads, the last serial, a program count)", heads
        )
    _dense("heads", heads)
    step_info = _tensor("step_info", step_info, 2, (torch.int32,))
    if step_info.shape[1] != 4:
        raise _fail("step_info", "[R, 4]", step_info)
    if step_info.stride(1) != 1 or (step_info.shape[0] > 1 and step_info.stride(0) < 4):
        raise _fail("step_info", "of non-overlapping rows, contiguous along dim 1", step_info)
    for name, t in (("ring", ring), ("records", records), ("heads", heads)):
        _on(name, t, device)
    _on("queue", queue, device, pinned_ok=True)
    if step_info.shape[0]:
        _on("step_info", step_info, device, pinned_ok=True)
    written = (("ring", ring), ("records", records), ("heads", heads), ("step_info", step_info))
    for i, (name, t) in enumerate(written):
        others = [*written[i + 1 :], ("dest", dest), ("capture", capture), ("queue", queue)]
        for other_name, other in others:
            if t.numel() and other.numel() and _same_memory(t, other):
                raise _fail(name, f"memory apart from {other_name}", t)
    return AllocStatic(
        num_layers=num_layers,
        top_k=top_k,
        hash_block=hash_block,
        num_slots=num_slots,
        rows_layout=rows_layout,
        capture_rows=num_cap_rows,
        dest_rows=dest.shape[0],
        num_indices=ring.shape[0],
        ring_width=ring.shape[1],
        queue_size=queue.shape[0],
        max_requests=step_info.shape[0],
        device=device,
        device_index=_device_index(device),
    )


def check_alloc_step_args(
    static: AllocStatic,
    *,
    query_start_loc: object,
    positions: object,
    request_index: object,
    num_rejected: object,
    fresh: object,
    num_reqs: object,
    num_rows: object,
    launch: object,
    queue_tail: object,
) -> AllocShape:
    """Validate one launch's arguments; ``num_reqs`` None means ``len(query_start_loc) - 1``
    and ``num_rows`` None every capture row.

    A launch is checked with two expressions, its counts and then its tensors
    (``step_tensors_pass``); only a call they refuse goes through every check in turn, which
    names the argument at fault and accepts what is valid but not of the exact types the
    expressions expect."""
    q, p, i, r, f = query_start_loc, positions, request_index, num_rejected, fresh
    if (
        type(num_reqs) is int
        and type(num_rows) is int
        and type(launch) is int
        and type(queue_tail) is int
        and 0 <= num_reqs <= static.max_requests
        and 0 <= num_rows <= static.capture_rows
        and (not static.rows_layout or num_rows <= static.dest_rows)
        and 1 <= launch < LAUNCH_LIMIT
        and queue_tail >= 0
        and f is None
        and step_tensors_pass(static.device_index, q, p, i, r, num_reqs, num_rows)
    ):
        return AllocShape(num_reqs, num_rows, launch, queue_tail)
    return _check_one_by_one(static, q, p, i, r, f, num_reqs, num_rows, launch, queue_tail)


def step_tensors_pass(
    device_index: int | None,
    query_start_loc: object,
    positions: object,
    request_index: object,
    num_rejected: object,
    num_reqs: int,
    num_rows: int,
) -> bool:
    """Whether a launch's device tensors pass every check ``check_alloc_step_args`` makes of
    them, for counts ``num_reqs``/``num_rows`` (ints) already within the launch's static
    bounds: 1-D ``int32``/``int64`` tensors of unit stride on the device of
    ``device_index`` (``AllocStatic.device_index``), ``query_start_loc`` ``[> num_reqs]``,
    ``positions`` ``[>= num_rows]``, ``request_index`` and ``num_rejected`` (None: not
    passed) ``[>= num_reqs]``.

    Two expressions, for a caller that launches every step and whose counts are its own
    (the worker); a unit stride stands for 1-D and dense in one read, ``numel`` for the
    length, and ``is_cpu``/``is_cuda`` with ``get_device`` for the device: reading
    ``Tensor.device`` builds a device object, the costliest read of a launch on a cold cache.
    False names nothing, and may refuse what is valid in another form (a tensor subclass,
    one element of another stride): ``check_alloc_step_args`` then judges the launch and
    names a fault."""
    q, p, i, r = query_start_loc, positions, request_index, num_rejected
    if not (
        type(q) is _TENSOR
        and type(p) is _TENSOR
        and type(i) is _TENSOR
        and q.stride() == _DENSE_1D
        and p.stride() == _DENSE_1D
        and i.stride() == _DENSE_1D
        and q.dtype in _INDEX_DTYPE_SET
        and p.dtype in _INDEX_DTYPE_SET
        and i.dtype in _INDEX_DTYPE_SET
        and num_reqs < q.numel()
        and num_reqs <= i.numel()
        and num_rows <= p.numel()
        and (
            r is None
            or (
                type(r) is _TENSOR
                and r.stride() == _DENSE_1D
                and r.dtype in _INDEX_DTYPE_SET
                and num_reqs <= r.numel()
            )
        )
    ):
        return False
    if device_index == CPU_INDEX:
        return q.is_cpu and p.is_cpu and i.is_cpu and (r is None or r.is_cpu)
    return (
        device_index is not None
        and q.is_cuda
        and p.is_cuda
        and i.is_cuda
        and q.get_device() == device_index
        and p.get_device() == device_index
        and i.get_device() == device_index
        and (r is None or (r.is_cuda and r.get_device() == device_index))
    )


_TENSOR = torch.Tensor
_DENSE_1D = (1,)  # the stride of a dense 1-D tensor of two or more elements
_INDEX_DTYPE_SET = frozenset(INDEX_DTYPES)


def _check_one_by_one(
    static: AllocStatic,
    query_start_loc: object,
    positions: object,
    request_index: object,
    num_rejected: object,
    fresh: object,
    num_reqs: object,
    num_rows: object,
    launch: object,
    queue_tail: object,
) -> AllocShape:
    """Every check of a launch's arguments in turn (signature order): raises the error naming
    the first argument at fault, or returns the launch's shape."""
    device = static.device
    qsl = _tensor("query_start_loc", query_start_loc, 1, INDEX_DTYPES)
    if qsl.shape[0] == 0:
        raise _fail("query_start_loc", "of length R+1 >= 1", qsl)
    _dense("query_start_loc", qsl)
    _on("query_start_loc", qsl, device)
    if num_reqs is None:
        num_reqs = qsl.shape[0] - 1
    max_reqs = min(qsl.shape[0] - 1, static.max_requests)
    if not _is_count(num_reqs, max_reqs):
        raise _fail("num_reqs", f"an int in [0, {max_reqs}] (query_start_loc, step_info)", num_reqs)
    if num_rows is None:
        num_rows = static.capture_rows
    if not _is_count(num_rows, static.capture_rows):
        raise _fail("num_rows", f"an int in [0, {static.capture_rows}] (capture rows)", num_rows)
    if static.rows_layout and static.dest_rows < num_rows:
        raise _fail("dest", f"[rows >= num_rows ({num_rows}), L, K]", f"{static.dest_rows} rows")
    pos = _tensor("positions", positions, 1, INDEX_DTYPES)
    if pos.shape[0] < num_rows:
        raise _fail("positions", f"of length >= num_rows ({num_rows})", pos)
    _dense("positions", pos)
    _on("positions", pos, device)
    index = _tensor("request_index", request_index, 1, INDEX_DTYPES)
    if index.shape[0] < num_reqs:
        raise _fail("request_index", f"of length >= num_reqs ({num_reqs})", index)
    _dense("request_index", index)
    _on("request_index", index, device)
    if num_rejected is not None:
        rejected = _tensor("num_rejected", num_rejected, 1, INDEX_DTYPES)
        if rejected.shape[0] < num_reqs:
            raise _fail("num_rejected", f"of length >= num_reqs ({num_reqs})", rejected)
        _dense("num_rejected", rejected)
        _on("num_rejected", rejected, device)
    if fresh is not None:
        flags = _tensor("fresh", fresh, 1, FRESH_DTYPES)
        if flags.shape[0] < num_reqs:
            raise _fail("fresh", f"of length >= num_reqs ({num_reqs})", flags)
        _dense("fresh", flags)
        _on("fresh", flags, device, pinned_ok=True)
    if not _is_count(launch, LAUNCH_LIMIT - 1, lower=1):
        raise _fail("launch", f"an int in [1, {LAUNCH_LIMIT - 1}]", launch)
    if not _is_count(queue_tail):
        raise _fail("queue_tail", "an int >= 0", queue_tail)
    return AllocShape(int(num_reqs), int(num_rows), int(launch), int(queue_tail))
