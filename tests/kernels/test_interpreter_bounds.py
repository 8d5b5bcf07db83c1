"""The interpreter's bounds checker (``interpreter_bounds.py``) catches what it must."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl
from interpreter_bounds import tensor_extent
from triton.runtime.errors import InterpreterError

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="checks the Triton interpreter"
)


@triton.jit
def _copy(src_ptr, dst_ptr, n, read_shift, write_shift, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    m = o < n
    values = tl.load(src_ptr + o + read_shift, mask=m, other=0)
    tl.store(dst_ptr + o + write_shift, values, mask=m)


def _launch(src, dst, n, read_shift=0, write_shift=0):
    _copy[(1,)](src, dst, n, read_shift, write_shift, BLOCK=8)


def test_accesses_inside_the_views_pass_and_masked_lanes_do_not_count() -> None:
    src = torch.arange(5, dtype=torch.int32)
    dst = torch.zeros(5, dtype=torch.int32)
    _launch(src, dst, 5)  # lanes 5..7 point past both tensors but are masked off
    assert dst.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("shift", ["read", "write"])
def test_one_element_past_a_view_is_refused_even_inside_its_storage(shift: str) -> None:
    storage = torch.arange(16, dtype=torch.int32)
    src, dst = storage[:5], storage[8:13]  # the storage continues after both views
    kwargs = {f"{shift}_shift": 1}
    access = "a load" if shift == "read" else "a store"
    with pytest.raises(InterpreterError, match=f"OutOfBoundsAccess.*{access} of 4 bytes"):
        _launch(src, dst, 5, **kwargs)
    assert storage[8:13].tolist() == [8, 9, 10, 11, 12]


@triton.jit
def _count(counter_ptr, shift):
    tl.atomic_add(counter_ptr + shift, 1, sem="acq_rel")


def test_an_atomic_past_a_view_is_refused_even_inside_its_storage() -> None:
    storage = torch.zeros(4, dtype=torch.int64)
    _count[(3,)](storage[:2], 1)
    assert storage.tolist() == [0, 3, 0, 0]
    with pytest.raises(InterpreterError, match="OutOfBoundsAccess.*an atomic of 8 bytes"):
        _count[(1,)](storage[:2], 2)
    assert storage.tolist() == [0, 3, 0, 0]


def test_extent_of_strided_and_empty_views() -> None:
    base = torch.zeros(4, 6, dtype=torch.int16)
    ptr = base.data_ptr()
    assert tensor_extent(base[:, 1]) == (ptr + 2, ptr + 2 + (3 * 6 + 1) * 2)
    assert tensor_extent(base[1:3].t()) == (ptr + 12, ptr + 12 + (6 + 5 + 1) * 2)
    assert tensor_extent(base[:0]) is None
