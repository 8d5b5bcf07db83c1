"""Status codes and argument checks shared by the gather-pack kernel launcher and its reference.

Both implementations must report the same statuses and reject the same calls with the same
messages, so these live here, in torch alone. Only host-visible properties are checked
(shapes, dtypes, devices, strides): values that live on the GPU (query_start_loc,
num_rejected, the slot table) are checked by the kernel itself and reported per request in
``step_info``, because reading them here would synchronize the host with the device.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import torch


class Status(enum.IntEnum):
    """Per-request status written to ``step_info[r, 2]``; nonzero means nothing was written."""

    OK = 0
    BAD_REJECTED = 1  # num_rejected[r] outside [0, n_r]
    BAD_BLOCK = 2  # a needed block is outside the row's block window or the table, or maps
    # to a slot outside [0, S)
    BAD_ROWS = 3  # query_start_loc starts < 0 or decreases anywhere, or r's rows pass num_rows
    BAD_INDEX = 4  # (gather_alloc) request_index[r] outside [0, N)
    NO_STOCK = 5  # (gather_alloc) the free-slot queue cannot cover r's new blocks


STATUS_OK = int(Status.OK)
STATUS_BAD_REJECTED = int(Status.BAD_REJECTED)
STATUS_BAD_BLOCK = int(Status.BAD_BLOCK)
STATUS_BAD_ROWS = int(Status.BAD_ROWS)
STATUS_BAD_INDEX = int(Status.BAD_INDEX)
STATUS_NO_STOCK = int(Status.NO_STOCK)

CAPTURE_DTYPES = (torch.int32, torch.uint8, torch.uint16)
DEST_DTYPES = (torch.uint8, torch.uint16)
INDEX_DTYPES = (torch.int32, torch.int64)


class GatherPackShape(NamedTuple):
    """Host-side sizes of one gather-pack call, after validation (a tuple: made per step)."""

    num_reqs: int  # requests handled: step_info rows 0..num_reqs-1 are written
    row_limit: int  # rows that may be read: min(num_rows bound, capture rows)
    num_layers: int  # L
    top_k: int  # K
    hash_block: int  # B, rows per slot
    num_slots: int  # S, slots the table may name
    rows_layout: bool  # dest is [rows, L, K] staging, not [S, B, L, K] slots


class GatherPackArgumentError(ValueError):
    """A malformed gather-pack argument; ``argument`` is its name, so a caller that took the
    value from elsewhere (the worker: ``input_batch.positions``) can say where."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(message)
        self.argument = argument


def _fail(name: str, expected: str, tensor_or_value: object) -> GatherPackArgumentError:
    if isinstance(tensor_or_value, torch.Tensor):
        t = tensor_or_value
        actual = f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}, stride {t.stride()}"
    else:
        actual = repr(tensor_or_value)
    return GatherPackArgumentError(name, f"gather_pack: {name} must be {expected}; got {actual}")


def _check_tensor(name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...]) -> None:
    if type(t) is torch.Tensor and t.dim() == ndim and t.dtype in dtypes:
        return
    if not isinstance(t, torch.Tensor):
        raise _fail(name, "a torch.Tensor", type(t).__name__)
    if t.dim() != ndim:
        raise _fail(name, f"{ndim}-D", t)
    if t.dtype not in dtypes:
        names = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        raise _fail(name, f"of dtype {names}", t)


def _inner_dense(t: torch.Tensor, start_dim: int) -> bool:
    """True when dims start_dim.. are laid out densely, row-major (size-1 dims ignored)."""
    expected = 1
    for dim in range(t.dim() - 1, start_dim - 1, -1):
        if t.shape[dim] != 1 and t.stride(dim) != expected:
            return False
        expected *= t.shape[dim]
    return True


def _is_count(value: object, upper: int | None = None, lower: int = 0) -> bool:
    if not isinstance(value, int) or isinstance(value, bool) or value < lower:
        return False
    return upper is None or value <= upper


def _check_writable_place(name: str, t: torch.Tensor, capture: torch.Tensor) -> None:
    """Outputs live on capture's device, or in pinned host memory for a CUDA capture."""
    if t.device == capture.device:
        return
    if capture.device.type == "cuda" and t.device.type == "cpu" and t.is_pinned():
        return
    raise _fail(
        name,
        f"on the capture's device ({capture.device}) or, for a CUDA capture, in pinned host memory",
        t,
    )


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.device.type == "meta":
        return False
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _check_dest(
    dest: torch.Tensor, capture: torch.Tensor, hash_block: object, num_slots: object
) -> tuple[int, int, bool]:
    """``(hash_block, num_slots, rows_layout)`` of a valid ``dest``; rows of distinct slots
    (or staging rows) must never share memory, or a write would land where none was asked."""
    L, K = capture.shape[1:]
    if not isinstance(dest, torch.Tensor) or dest.dim() not in (3, 4):
        expected = f"[S, B, {L}, {K}] slots or [rows, {L}, {K}] staging"
        raise _fail(
            "dest", expected, dest if isinstance(dest, torch.Tensor) else type(dest).__name__
        )
    _check_tensor("dest", dest, dest.dim(), DEST_DTYPES)
    rows_layout = dest.dim() == 3
    if tuple(dest.shape[-2:]) != (L, K):
        layout = f"[rows, {L}, {K}]" if rows_layout else f"[S, B, {L}, {K}]"
        raise _fail("dest", f"{layout} (L, K of capture)", dest)
    if rows_layout:
        if not _is_count(hash_block, lower=1):
            raise _fail("hash_block", "an int >= 1 (required with a [rows, L, K] dest)", hash_block)
        if not _is_count(num_slots):
            raise _fail("num_slots", "an int >= 0 (required with a [rows, L, K] dest)", num_slots)
    else:
        if dest.shape[1] == 0:
            raise _fail("dest", "of a positive block size B (dim 1)", dest)
        if hash_block is not None and hash_block != dest.shape[1]:
            raise _fail("hash_block", f"None or dest.shape[1] ({dest.shape[1]})", hash_block)
        if num_slots is not None and not _is_count(num_slots, dest.shape[0]):
            raise _fail("num_slots", f"None or an int in [0, {dest.shape[0]}]", num_slots)
        hash_block = dest.shape[1]
        num_slots = dest.shape[0] if num_slots is None else num_slots
    if not _inner_dense(dest, 1):
        what = "each row" if rows_layout else "each slot (dims B, L, K)"
        raise _fail("dest", f"contiguous within {what}", dest)
    unit = dest[0].numel() if dest.shape[0] else 0
    if dest.shape[0] > 1 and dest.stride(0) < unit:
        what = "rows" if rows_layout else "slots"
        raise _fail("dest", f"of non-overlapping {what} (stride(0) >= {unit})", dest)
    _check_writable_place("dest", dest, capture)
    if _same_memory(dest, capture):
        raise _fail("dest", "memory apart from capture's", dest)
    return int(hash_block), int(num_slots), rows_layout


@dataclass(frozen=True)
class StaticArgs:
    """The validated step-independent arguments of gather_pack (see ``check_static_args``)."""

    num_layers: int
    top_k: int
    hash_block: int
    num_slots: int
    rows_layout: bool
    capture_rows: int  # T
    dest_rows: int  # staging rows (rows layout) or slots
    # Per-request buffers by name and length (a step's num_reqs may not pass them).
    request_lengths: tuple[tuple[str, int], ...]
    device: torch.device
    max_requests: int  # the most requests one step may name: the shortest of request_lengths


def check_static_args(
    *,
    capture: torch.Tensor,
    table_row: torch.Tensor,
    slot_table: torch.Tensor,
    block_window: torch.Tensor,
    dest: torch.Tensor,
    step_info: torch.Tensor,
    hash_block: int | None,
    num_slots: int | None,
) -> StaticArgs:
    """Validate what stays the same from step to step; raises ValueError naming the argument."""
    _check_tensor("capture", capture, 3, CAPTURE_DTYPES)
    num_cap_rows, num_layers, top_k = capture.shape
    # Before the layout: an empty tensor's strides say nothing about it.
    if num_layers == 0 or top_k == 0:
        raise _fail("capture", "non-empty in L and K", capture)
    if not _inner_dense(capture, 0):
        raise _fail("capture", "contiguous", capture)
    hash_block, num_slots, rows_layout = _check_dest(dest, capture, hash_block, num_slots)

    _check_tensor("table_row", table_row, 1, INDEX_DTYPES)
    if not table_row.is_contiguous():
        # Read as a dense array: a strided view would hand a request another one's table row.
        raise _fail("table_row", "contiguous (the kernel reads it as a dense array)", table_row)
    _check_tensor("slot_table", slot_table, 2, INDEX_DTYPES)
    if slot_table.shape[1] == 0:
        raise _fail("slot_table", "[N, W] with a ring width W >= 1", slot_table)
    if slot_table.shape[1] > 1 and slot_table.stride(1) != 1:
        raise _fail("slot_table", "contiguous along dim 1", slot_table)
    _check_tensor("block_window", block_window, 2, INDEX_DTYPES)
    if block_window.shape != (slot_table.shape[0], 2) or block_window.stride(1) != 1:
        raise _fail(
            "block_window", f"[N, 2] (N = {slot_table.shape[0]} table rows), dense rows",
            block_window,
        )  # fmt: skip

    _check_tensor("step_info", step_info, 2, (torch.int32,))
    if step_info.shape[1] != 3:
        raise _fail("step_info", "[R, 3]", step_info)
    if step_info.stride(1) != 1 or (step_info.shape[0] > 1 and step_info.stride(0) < 3):
        raise _fail("step_info", "of non-overlapping rows, contiguous along dim 1", step_info)
    if step_info.shape[0]:
        # An empty step_info admits no request (max_requests is 0), so nothing is ever
        # launched to write it; and PyTorch never pins an empty tensor, even when asked to.
        _check_writable_place("step_info", step_info, capture)
    if _same_memory(step_info, dest) or _same_memory(step_info, capture):
        raise _fail("step_info", "memory apart from dest and capture", step_info)

    for name, t in (
        ("table_row", table_row),
        ("slot_table", slot_table),
        ("block_window", block_window),
    ):
        if t.device != capture.device:
            raise _fail(name, f"on the capture's device ({capture.device})", t)

    return StaticArgs(
        num_layers=num_layers,
        top_k=top_k,
        hash_block=hash_block,
        num_slots=num_slots,
        rows_layout=rows_layout,
        capture_rows=num_cap_rows,
        dest_rows=dest.shape[0],
        request_lengths=(("table_row", table_row.shape[0]), ("step_info", step_info.shape[0])),
        device=capture.device,
        max_requests=min(table_row.shape[0], step_info.shape[0]),
    )


def check_step_args(
    static: StaticArgs,
    *,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    num_rejected: torch.Tensor | None,
    num_reqs: int | None,
    num_rows: int | None,
) -> GatherPackShape:
    """Validate one step's arguments against the static ones; ``num_reqs`` None means every
    entry of ``query_start_loc`` and ``num_rows`` None every capture row.

    The kernel reads ``query_start_loc``, ``positions`` and ``num_rejected`` as dense 1-D
    arrays of ``int32``/``int64`` on the capture's device. A step is checked with one
    expression; only a call it refuses goes through ``_refuse_step``, which names the
    argument, and accepts what is valid but not of the exact types the expression expects
    (tensor or int subclasses).
    """
    q, p, r = query_start_loc, positions, num_rejected
    if num_reqs is None and isinstance(q, torch.Tensor) and q.dim() == 1:
        num_reqs = q.shape[0] - 1
    if num_rows is None:
        num_rows = static.capture_rows
    device = static.device
    if not (
        type(q) is torch.Tensor
        and type(p) is torch.Tensor
        and type(num_reqs) is int
        and type(num_rows) is int
        and q.dim() == 1
        and p.dim() == 1
        and q.dtype in INDEX_DTYPES
        and p.dtype in INDEX_DTYPES
        and 0 <= num_reqs < q.shape[0]
        and num_reqs <= static.max_requests
        and 0 <= num_rows <= static.capture_rows
        and num_rows <= p.shape[0]
        and (not static.rows_layout or num_rows <= static.dest_rows)
        and q.is_contiguous()
        and p.is_contiguous()
        and q.device == device
        and p.device == device
        and (
            r is None
            or (
                type(r) is torch.Tensor
                and r.dim() == 1
                and r.dtype in INDEX_DTYPES
                and num_reqs <= r.shape[0]
                and r.is_contiguous()
                and r.device == device
            )
        )
    ):
        _refuse_step(static, q, p, r, num_reqs, num_rows)
        num_reqs, num_rows = int(num_reqs), int(num_rows)
    return GatherPackShape(
        num_reqs,
        num_rows,
        static.num_layers,
        static.top_k,
        static.hash_block,
        static.num_slots,
        static.rows_layout,
    )


def _refuse_step(
    static: StaticArgs,
    query_start_loc: object,
    positions: object,
    num_rejected: object,
    num_reqs: object,
    num_rows: object,
) -> None:
    """Every check of a step's arguments, one at a time: raises the ``GatherPackArgumentError``
    naming the first argument at fault (in signature order), or returns if there is none."""
    device = static.device
    _check_tensor("query_start_loc", query_start_loc, 1, INDEX_DTYPES)
    max_reqs = query_start_loc.shape[0] - 1
    if max_reqs < 0:
        raise _fail("query_start_loc", "of length R+1 >= 1", query_start_loc)
    _check_dense_on("query_start_loc", query_start_loc, device)
    if not _is_count(num_reqs, max_reqs):
        raise _fail("num_reqs", f"an int in [0, {max_reqs}] (len(query_start_loc) - 1)", num_reqs)
    for name, length in static.request_lengths:
        if length < num_reqs:
            layout = "[R, 3] with R" if name == "step_info" else "of length"
            raise _fail(name, f"{layout} >= num_reqs ({num_reqs})", f"{length} entries")
    if not _is_count(num_rows, static.capture_rows):
        raise _fail("num_rows", f"an int in [0, {static.capture_rows}] (capture rows)", num_rows)
    if static.rows_layout and static.dest_rows < num_rows:
        raise _fail("dest", f"[rows >= num_rows ({num_rows}), L, K]", f"{static.dest_rows} rows")
    _check_tensor("positions", positions, 1, INDEX_DTYPES)
    if positions.shape[0] < num_rows:
        raise _fail("positions", f"of length >= num_rows ({num_rows})", positions)
    _check_dense_on("positions", positions, device)
    if num_rejected is not None:
        _check_tensor("num_rejected", num_rejected, 1, INDEX_DTYPES)
        if num_rejected.shape[0] < num_reqs:
            raise _fail("num_rejected", f"of length >= num_reqs ({num_reqs})", num_rejected)
        _check_dense_on("num_rejected", num_rejected, device)


def _check_dense_on(name: str, t: torch.Tensor, device: torch.device) -> None:
    if not t.is_contiguous():
        raise _fail(name, "contiguous (the kernel reads it as a dense array)", t)
    if t.device != device:
        raise _fail(name, f"on the capture's device ({device})", t)
