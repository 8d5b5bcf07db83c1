"""Status codes, the argument error and the checks shared by the capture kernel's launcher
and its reference (``_alloc_checks`` builds the launch's checks on them).

Both implementations must report the same statuses and reject the same calls with the same
messages, so these live here, in torch alone. Only host-visible properties are checked
(shapes, dtypes, devices, strides): values that live on the GPU (query_start_loc,
num_rejected, the request indices, the queue) are checked by the kernel itself and reported
per request in ``step_info``, because reading them here would synchronize the host with the
device.
"""

from __future__ import annotations

import enum

import torch


class Status(enum.IntEnum):
    """Per-request status written to ``step_info[r, 2]``; nonzero means nothing was written."""

    OK = 0
    BAD_REJECTED = 1  # num_rejected[r] outside [0, n_r]
    BAD_BLOCK = 2  # a needed block cannot be placed: below what the ring keeps, past the
    # block limit, a ring entry naming another block, or a slot outside [0, S)
    BAD_ROWS = 3  # query_start_loc starts < 0 or decreases anywhere, or r's rows pass num_rows
    BAD_INDEX = 4  # request_index[r] outside [0, N)
    NO_STOCK = 5  # the free-slot queue cannot cover r's new blocks
    BAD_LAUNCH = 6  # the launch serial is not the last launch's + 1: every request fails
    SHARED_INDEX = 7  # request_index[r] is another request's of the launch too, or was
    # shared in an earlier launch and no request new to it (fresh) has held it since


STATUS_OK = int(Status.OK)
STATUS_BAD_REJECTED = int(Status.BAD_REJECTED)
STATUS_BAD_BLOCK = int(Status.BAD_BLOCK)
STATUS_BAD_ROWS = int(Status.BAD_ROWS)
STATUS_BAD_INDEX = int(Status.BAD_INDEX)
STATUS_NO_STOCK = int(Status.NO_STOCK)
STATUS_BAD_LAUNCH = int(Status.BAD_LAUNCH)
STATUS_SHARED_INDEX = int(Status.SHARED_INDEX)

CAPTURE_DTYPES = (torch.int32, torch.uint8, torch.uint16)
DEST_DTYPES = (torch.uint8, torch.uint16)
INDEX_DTYPES = (torch.int32, torch.int64)


class KernelArgumentError(ValueError):
    """A malformed kernel argument; ``argument`` is its name, so a caller that took the
    value from elsewhere (the worker: ``input_batch.positions``) can say where."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(message)
        self.argument = argument


def _fail(name: str, expected: str, tensor_or_value: object) -> KernelArgumentError:
    """The error for argument ``name``, which must be ``expected``, describing what it got."""
    if isinstance(tensor_or_value, torch.Tensor):
        t = tensor_or_value
        actual = f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}, stride {t.stride()}"
    else:
        actual = repr(tensor_or_value)
    return KernelArgumentError(name, f"gather_alloc: {name} must be {expected}; got {actual}")


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
