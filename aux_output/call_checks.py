"""Argument checks for the worker's protocol calls, run before any state changes.

vLLM's scheduler and model runner are the only intended callers, so every check here is
either one vectorized operation or a loop over the few entries the step actually names
(new block hashes, finished requests). What they refuse is malformed input, named by the
argument: the wrong type, a negative cursor, a request the worker has never heard of, a
count array of the wrong shape. Protocol violations with well-formed input (a cursor that
moved ahead, a capture gap) stay vLLM's ``AssertionError``s, raised where vLLM raises them.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

_METADATA_FIELDS = ("generation", "requests", "block_hashes", "finished_requests")
_INT64_MAX = 2**63 - 1


def checked_emit_starts(
    metadata: Any, is_known: Callable[[str], bool], generation_now: int
) -> list[int] | np.ndarray:
    """Check one step's metadata; return its emit starts, in the order of ``requests``:
    Python ints for up to ``EMIT_LIST_MAX`` requests, else int64 ``[len(requests)]``.

    ``is_known(request_id)``: whether the worker tracks the request in ``generation_now``.
    Block hashes and finish events may name only known or newly scheduled requests. vLLM
    raises a bare ``KeyError`` there after part of the step is applied; here it is a
    ``KeyError`` naming the field, raised before anything changes. vLLM's own assertions
    come first, as in vLLM: a request both scheduled and finished, or a generation that
    moved backwards, is left for the caller to refuse.
    """
    try:
        generation = metadata.generation
        requests = metadata.requests
        block_hashes = metadata.block_hashes
        finished = metadata.finished_requests
    except AttributeError:
        missing = [name for name in _METADATA_FIELDS if not hasattr(metadata, name)]
        raise TypeError(
            f"metadata must be an AuxOutputConnectorMetadata, got {type(metadata).__name__} "
            f"without {', '.join(missing)}"
        ) from None
    if type(generation) is not int and (
        isinstance(generation, bool) or not isinstance(generation, numbers.Integral)
    ):
        raise TypeError(f"metadata.generation must be an int, got {generation!r}")
    if generation < 0:
        raise ValueError(f"metadata.generation must be >= 0, got {generation}")
    if generation > generation_now:
        is_known = _nothing  # the bump clears every request first
    check_ids = generation >= generation_now
    if type(requests) is not dict and not isinstance(requests, Mapping):
        raise TypeError(f"metadata.requests must be a dict, got {type(requests).__name__}")
    if not requests:
        emit_starts = _NO_EMIT_STARTS  # steps that only finish requests, or none at all
    elif len(requests) <= EMIT_LIST_MAX:
        emit_starts = list(requests.values())
        for value in emit_starts:
            if type(value) is not int or not 0 <= value <= _INT64_MAX:
                emit_starts = _emit_start_array(requests).tolist()
                break
    else:
        emit_starts = _emit_start_array(requests)
    if type(block_hashes) is not dict and not isinstance(block_hashes, Mapping):
        raise TypeError(f"metadata.block_hashes must be a dict, got {type(block_hashes).__name__}")
    for request_id, packed in block_hashes.items():
        if check_ids and request_id not in requests and not is_known(request_id):
            raise KeyError(f"metadata.block_hashes names unknown request {request_id!r}")
        if not _is_packed(packed):
            _refuse_packed(f"metadata.block_hashes[{request_id!r}]", packed)
    if type(finished) is not tuple and (
        isinstance(finished, (str, bytes))
        or not hasattr(finished, "__iter__")
        or iter(finished) is finished  # read more than once: an iterator would lose ids
    ):
        raise TypeError(
            f"metadata.finished_requests must be a tuple of request ids, got {finished!r}"
        )
    for request_id in finished if check_ids else ():
        if request_id not in requests and not is_known(request_id):
            raise KeyError(f"metadata.finished_requests names unknown request {request_id!r}")
    packed = getattr(metadata, "retained_block_hashes", None)
    if packed is not None and not _is_packed(packed):
        _refuse_packed("metadata.retained_block_hashes", packed)
    packed = getattr(metadata, "released_block_hashes", None)
    if packed is not None and not _is_packed(packed):
        _refuse_packed("metadata.released_block_hashes", packed)
    return emit_starts


# Second form of the emit starts: Python ints, up to this many scheduled requests (the long
# tail of a batch, a few agentic turns), where numpy's fixed cost per call exceeds a loop's.
EMIT_LIST_MAX = 32
# What np.array makes of Python ints that fit int64 (numpy's builtin dtypes are singletons).
_INT64 = np.dtype(np.int64)
# What a step without scheduled requests hands on: shared, so never written.
_NO_EMIT_STARTS = np.zeros(0, np.int64)
_NO_EMIT_STARTS.flags.writeable = False


def _emit_start_array(requests: Mapping[str, Any]) -> np.ndarray:
    """The values of non-empty ``requests`` as int64 ``[len(requests)]``, or the error
    naming what is wrong with them."""
    values = list(requests.values())
    emit_starts = np.array(values)
    if emit_starts.dtype is not _INT64:
        return _diagnosed_emit_starts(requests)
    lowest = emit_starts.min()
    if lowest < 0:
        _refuse_negative(requests)
    # numpy reads a bool among ints as 0 or 1: only the types tell, and only then.
    if lowest <= 1 and bool in set(map(type, values)):
        return _diagnosed_emit_starts(requests)
    return emit_starts


def _diagnosed_emit_starts(requests: Mapping[str, Any]) -> np.ndarray:
    """The values of ``requests``, which numpy did not read as int64 (numpy integers, ints
    of several numpy types, or a value that is not an int64 int), as int64, or the error
    naming what is wrong: judged value by value, as numpy's common type of a mix (float64
    for int and uint64) says nothing of each."""
    values = list(requests.values())
    for value in values:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            raise TypeError(
                f"metadata.requests must map request ids to int emit starts, got "
                f"{type(value).__name__} {value!r}"
            )
    values = [int(value) for value in values]
    if min(values) < 0:
        _refuse_negative(requests)
    if max(values) > _INT64_MAX:
        raise ValueError(
            f"metadata.requests has an emit start beyond int64: "
            f"{ {k: v for k, v in requests.items() if v > _INT64_MAX} }"
        )
    return np.array(values, np.int64)


def _refuse_negative(requests: Mapping[str, Any]) -> None:
    raise ValueError(
        f"metadata.requests has a negative emit start: "
        f"{ {k: v for k, v in requests.items() if v < 0} }"
    )


def _nothing(request_id: str) -> bool:
    return False


def _is_packed(packed: Any) -> bool:
    """Whether ``packed`` is whole packed hashes: ``data`` bytes, ``item_size`` per hash."""
    data = getattr(packed, "data", None)
    item_size = getattr(packed, "item_size", None)
    return (
        type(data) is bytes
        and type(item_size) is int
        and item_size > 0
        and not len(data) % item_size
    )


def _refuse_packed(name: str, packed: Any) -> None:
    """Raise the error naming what is wrong with ``packed``, which ``_is_packed`` did not
    accept; other bytes-like data and integral sizes are readable and pass."""
    data = getattr(packed, "data", None)
    item_size = getattr(packed, "item_size", None)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"{name} must be PackedBlockHashes with bytes data, got {packed!r}")
    if isinstance(item_size, bool) or not isinstance(item_size, numbers.Integral):
        raise TypeError(f"{name}.item_size must be an int, got {item_size!r}")
    if item_size <= 0 or len(data) % item_size:
        raise ValueError(
            f"{name} must hold whole hashes: {len(data)} bytes of {item_size}-byte hashes"
        )


def check_host_counts(name: str, counts: Any, num_reqs: int) -> None:
    """``counts``: a 1-D integer numpy array with ``>= num_reqs`` entries (``num_sampled``,
    ``num_rejected``). Only the shape and dtype are checked: the values arrive later, when
    the copy stream's event completes, and the commit checks them as vLLM does."""
    if (
        type(counts) is not np.ndarray
        or counts.ndim != 1
        or counts.dtype.kind not in "iu"
        or counts.shape[0] < num_reqs
    ):
        raise ValueError(
            f"{name} must be a 1-D integer numpy array with >= {num_reqs} entries "
            f"(one per request of the step), got {_describe(counts)}"
        )


def checked_batch_arrays(
    input_batch: Any, max_num_seqs: int, max_num_batched_tokens: int
) -> tuple[list[str], np.ndarray, np.ndarray, int]:
    """``input_batch``'s request ids (a list it owns), scheduler starts (``[>= R]``),
    ``query_start_loc`` (``[>= R + 1]``; ``[0]`` for an empty step) and rows (its entry
    ``R``), after checking they agree and fit the worker's limits. The arrays are the
    batch's own, uncut (``StepLayout`` cuts them when read): Model Runner V2 makes them anew
    for every step."""
    request_ids = list(input_batch.req_ids)
    num_reqs = len(request_ids)
    if num_reqs > max_num_seqs:
        raise ValueError(
            f"input_batch has {num_reqs} requests, more than max_num_seqs ({max_num_seqs})"
        )
    qsl = input_batch.query_start_loc_np
    starts = input_batch.num_computed_tokens_np
    if type(qsl) is not np.ndarray:
        qsl = np.asarray(qsl)
    if type(starts) is not np.ndarray:
        starts = np.asarray(starts)
    if num_reqs and (len(qsl) <= num_reqs or qsl.dtype.kind not in "iu"):
        raise ValueError(
            f"input_batch.query_start_loc_np must be integers with >= {num_reqs + 1} "
            f"entries for its {num_reqs} requests; got {qsl.dtype} [{len(qsl)}]"
        )
    if len(starts) < num_reqs:
        raise ValueError(
            f"input_batch.num_computed_tokens_np must have >= {num_reqs} entries; got {len(starts)}"
        )
    if num_reqs == 0:
        return request_ids, starts, _EMPTY_QSL, 0
    num_rows = qsl.item(num_reqs)
    if not 0 <= num_rows <= max_num_batched_tokens:
        raise ValueError(
            f"input_batch has {num_rows} rows (query_start_loc_np[{num_reqs}]), outside "
            f"[0, max_num_batched_tokens = {max_num_batched_tokens}]"
        )
    return request_ids, starts, qsl, num_rows


_EMPTY_QSL = np.zeros(1, np.int64)
_EMPTY_QSL.flags.writeable = False


# The input_batch field behind each kernel argument the worker takes from the batch; the
# batch's request count is num_reqs, so too many of them means query_start_loc is short.
_BATCH_FIELD_OF = {
    "query_start_loc": "query_start_loc",
    "num_reqs": "query_start_loc",
    "positions": "positions",
    "request_index": "idx_mapping",
}


def input_batch_error(exc: Exception) -> Exception:
    """The error to raise for a ``KernelArgumentError`` from checking a batch's device
    inputs: one naming the ``input_batch`` field it came from, or ``exc`` itself when the
    argument (``num_rejected``) is not the batch's."""
    field = _BATCH_FIELD_OF.get(getattr(exc, "argument", None))
    if field is None:
        return exc
    per = {"query_start_loc": "request and one more", "idx_mapping": "request"}.get(field, "row")
    return ValueError(
        f"input_batch.{field} must be the 1-D integer tensor on the device that Model Runner "
        f"V2 provides, with an entry per {per} ({exc})"
    )


def _describe(value: Any) -> str:
    """Type, and for an array or tensor its dtype and shape, for an error message."""
    got = type(value).__name__
    if isinstance(value, (np.ndarray, torch.Tensor)):
        got += f" {value.dtype} of shape {tuple(value.shape)}"
    return got
