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

import torch


class Status(enum.IntEnum):
    """Per-request status written to ``step_info[r, 2]``; nonzero means nothing was written."""

    OK = 0
    BAD_REJECTED = 1  # num_rejected[r] outside [0, n_r]
    BAD_BLOCK = 2  # a needed block is outside the slot table, or maps to a slot outside [0, S)
    BAD_ROWS = 3  # query_start_loc[r] < 0, decreasing, or past the num_rows bound


STATUS_OK = int(Status.OK)
STATUS_BAD_REJECTED = int(Status.BAD_REJECTED)
STATUS_BAD_BLOCK = int(Status.BAD_BLOCK)
STATUS_BAD_ROWS = int(Status.BAD_ROWS)

CAPTURE_DTYPES = (torch.int32, torch.uint8, torch.uint16)
DEST_DTYPES = (torch.uint8, torch.uint16)
INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class GatherPackShape:
    """Host-side sizes of one gather-pack call, after validation."""

    num_reqs: int  # requests handled: step_info rows 0..num_reqs-1 are written
    row_limit: int  # rows that may be read: min(num_rows bound, capture rows)
    num_layers: int  # L
    top_k: int  # K
    hash_block: int  # B, rows per destination slot
    num_slots: int  # S
    table_width: int  # M


def _fail(name: str, expected: str, tensor_or_value: object) -> ValueError:
    if isinstance(tensor_or_value, torch.Tensor):
        t = tensor_or_value
        actual = f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}, stride {t.stride()}"
    else:
        actual = repr(tensor_or_value)
    return ValueError(f"gather_pack: {name} must be {expected}; got {actual}")


def _check_tensor(name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...]) -> None:
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


def _is_count(value: object, upper: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= upper


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


def check_gather_pack_args(
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
) -> GatherPackShape:
    """Validate one gather_pack call; raises ValueError naming the argument at fault."""
    _check_tensor("capture", capture, 3, CAPTURE_DTYPES)
    if not _inner_dense(capture, 0):
        raise _fail("capture", "contiguous", capture)
    num_cap_rows, num_layers, top_k = capture.shape
    if num_layers == 0 or top_k == 0:
        raise _fail("capture", "non-empty in L and K", capture)

    _check_tensor("dest", dest, 4, DEST_DTYPES)
    if tuple(dest.shape[2:]) != (num_layers, top_k):
        raise _fail("dest", f"[S, B, {num_layers}, {top_k}] (L, K of capture)", dest)
    if dest.shape[1] == 0:
        raise _fail("dest", "of a positive block size B (dim 1)", dest)
    if not _inner_dense(dest, 1):
        raise _fail("dest", "contiguous within each slot (dims B, L, K; slot stride free)", dest)
    _check_writable_place("dest", dest, capture)

    _check_tensor("query_start_loc", query_start_loc, 1, INDEX_DTYPES)
    max_reqs = query_start_loc.shape[0] - 1
    if max_reqs < 0:
        raise _fail("query_start_loc", "of length R+1 >= 1", query_start_loc)
    if num_reqs is None:
        num_reqs = max_reqs
    if not _is_count(num_reqs, max_reqs):
        raise _fail("num_reqs", f"an int in [0, {max_reqs}] (len(query_start_loc) - 1)", num_reqs)
    if num_rows is None:
        num_rows = num_cap_rows
    if not _is_count(num_rows, num_cap_rows):
        raise _fail("num_rows", f"an int in [0, {num_cap_rows}] (capture rows)", num_rows)

    for name, t in (("start_pos", start_pos), ("first_block", first_block)):
        _check_tensor(name, t, 1, INDEX_DTYPES)
        if t.shape[0] < num_reqs:
            raise _fail(name, f"of length >= num_reqs ({num_reqs})", t)
    if num_rejected is not None:
        _check_tensor("num_rejected", num_rejected, 1, INDEX_DTYPES)
        if num_rejected.shape[0] < num_reqs:
            raise _fail("num_rejected", f"of length >= num_reqs ({num_reqs})", num_rejected)

    _check_tensor("slot_table", slot_table, 2, INDEX_DTYPES)
    if slot_table.shape[0] < num_reqs:
        raise _fail("slot_table", f"[R, M] with R >= num_reqs ({num_reqs})", slot_table)
    if slot_table.shape[1] > 1 and slot_table.stride(1) != 1:
        raise _fail("slot_table", "contiguous along dim 1", slot_table)

    _check_tensor("step_info", step_info, 2, (torch.int32,))
    if step_info.shape[0] < num_reqs or step_info.shape[1] != 3:
        raise _fail("step_info", f"[R, 3] with R >= num_reqs ({num_reqs})", step_info)
    if step_info.stride(1) != 1:
        raise _fail("step_info", "contiguous along dim 1", step_info)
    _check_writable_place("step_info", step_info, capture)

    for name, t in (
        ("query_start_loc", query_start_loc),
        ("start_pos", start_pos),
        ("first_block", first_block),
        ("slot_table", slot_table),
        ("num_rejected", num_rejected),
    ):
        if t is not None and t.device != capture.device:
            raise _fail(name, f"on the capture's device ({capture.device})", t)

    return GatherPackShape(
        num_reqs=num_reqs,
        row_limit=num_rows,
        num_layers=num_layers,
        top_k=top_k,
        hash_block=dest.shape[1],
        num_slots=dest.shape[0],
        table_width=slot_table.shape[1],
    )
