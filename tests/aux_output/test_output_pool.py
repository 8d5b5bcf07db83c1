"""OutputPool: recycled buffers for large outputs, never reused while any view is alive."""

from __future__ import annotations

import functools
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from r3capture.aux_output import envs
from r3capture.aux_output.output_pool import OutputPool
from sim import (
    SCENARIOS,
    make_trace,
    make_vllm_worker,
    r3capture_worker_factory,
    run_trace,
)
from sim.compare import diff_results

SHAPE = (1000, 48, 8)  # 384,000 bytes: above the default min_nbytes


def _pool(**kwargs) -> OutputPool:
    kwargs.setdefault("max_bytes", 64 << 20)
    return OutputPool(**kwargs)


def test_buffer_comes_back_once_the_array_is_dropped():
    pool = _pool()
    a = pool.empty(SHAPE, np.uint8)
    address = a.ctypes.data
    del a
    b = pool.empty(SHAPE, np.uint8)
    assert b.ctypes.data == address
    assert pool.stats == {"reused": 1, "allocated": 1, "unpooled": 0}


@pytest.mark.parametrize(
    "derive",
    [
        lambda a: a[10:20],
        lambda a: a.reshape(-1)[4:].view(np.uint16),
        lambda a: torch.from_numpy(a),
        lambda a: memoryview(a),
        lambda a: np.frombuffer(memoryview(a), np.uint8),
        lambda a: [a[0]],
    ],
    ids=["slice", "view-of-view", "torch", "memoryview", "frombuffer", "row-in-list"],
)
def test_any_surviving_derivative_keeps_the_buffer_out_of_reuse(derive):
    pool = _pool()
    a = pool.empty(SHAPE, np.uint8)
    a[...] = 7
    survivor = derive(a)
    del a
    b = pool.empty(SHAPE, np.uint8)
    b[...] = 9
    flat = np.asarray(survivor[0] if isinstance(survivor, list) else survivor).reshape(-1)
    assert flat.view(np.uint8).min() == 7 == flat.view(np.uint8).max()
    assert pool.stats["allocated"] == 2 and pool.stats["reused"] == 0
    del survivor, flat
    c = pool.empty(SHAPE, np.uint8)
    assert pool.stats["reused"] == 1
    assert not np.shares_memory(b, c)


def test_small_arrays_and_a_disabled_pool_are_plain_allocations():
    small = _pool()
    x = small.empty((10, 48, 8), np.uint8)
    assert x.base is None and small.owned_bytes == 0 and small.stats["unpooled"] == 1
    off = _pool(max_bytes=0)
    y = off.empty(SHAPE, np.uint16)
    assert y.base is None and y.dtype == np.uint16 and y.shape == SHAPE
    assert off.owned_bytes == 0


def test_shape_dtype_and_contiguity():
    pool = _pool()
    a = pool.empty((300, 61, 8), np.uint16)
    assert a.shape == (300, 61, 8) and a.dtype == np.uint16 and a.flags.c_contiguous
    assert a.flags.writeable
    assert a.base.nbytes >= a.nbytes and a.base.nbytes <= a.nbytes * 1.125 + 4096


def test_cap_drops_idle_buffers_then_falls_back_to_plain_arrays():
    nbytes = 384_000
    pool = _pool(max_bytes=3 * nbytes)  # room for two 393,216-byte size-class buffers
    first, second = pool.empty(SHAPE, np.uint8), pool.empty(SHAPE, np.uint8)
    third = pool.empty(SHAPE, np.uint8)  # both pool buffers in use: over the cap
    assert third.base is None and pool.stats["unpooled"] == 1
    assert pool.owned_bytes == 2 * 393_216
    del first
    # A different size class needs room: the idle buffer is dropped to make it.
    other = pool.empty((1200, 48, 8), np.uint8)
    assert other.base is not None and pool.owned_bytes <= pool.max_bytes
    assert not np.shares_memory(other, second)


def test_clear_keeps_arrays_already_handed_out_valid():
    pool = _pool()
    a = pool.empty(SHAPE, np.uint8)
    a[...] = 3
    pool.clear()
    assert pool.owned_bytes == 0
    b = pool.empty(SHAPE, np.uint8)
    b[...] = 4
    assert not np.shares_memory(a, b) and int(a.max()) == 3


@pytest.mark.parametrize("gil_enabled", [None, True, False])
def test_pooling_is_off_where_reference_counts_are_not_exact(monkeypatch, gil_enabled):
    """A free-threaded CPython (``sys._is_gil_enabled()`` False) may count references
    lazily: the pool must not trust them there, and hands out plain arrays."""
    if gil_enabled is None:
        monkeypatch.delattr(sys, "_is_gil_enabled", raising=False)
    else:
        monkeypatch.setattr(sys, "_is_gil_enabled", lambda: gil_enabled, raising=False)
    pool = _pool()
    a = pool.empty(SHAPE, np.uint8)
    pooled = gil_enabled is not False
    assert pool.max_bytes == (64 << 20 if pooled else 0)
    assert (a.base is not None) == pooled
    assert pool.stats["unpooled"] == (0 if pooled else 1)


@pytest.mark.parametrize("kwargs", [{"max_bytes": -1}, {"max_bytes": 1, "min_nbytes": 0}])
def test_bad_arguments_name_themselves(kwargs):
    name = "min_nbytes" if "min_nbytes" in kwargs else "max_bytes"
    with pytest.raises(ValueError, match=name):
        OutputPool(**kwargs)


@pytest.mark.parametrize("raw, expected", [("", 256 << 20), ("0", 0), (" 1048576 ", 1 << 20)])
def test_env_var(monkeypatch, raw, expected):
    monkeypatch.setenv("R3CAPTURE_OUTPUT_POOL_BYTES", raw)
    assert envs.output_pool_bytes() == expected


@pytest.mark.parametrize("raw", ["-5", "lots", "1e6"])
def test_env_var_rejects_non_counts(monkeypatch, raw):
    monkeypatch.setenv("R3CAPTURE_OUTPUT_POOL_BYTES", raw)
    with pytest.raises(ValueError, match="R3CAPTURE_OUTPUT_POOL_BYTES"):
        envs.output_pool_bytes()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(0, 7), st.integers(1, 3)),
        min_size=1,
        max_size=40,
    )
)
def test_live_arrays_never_share_memory_and_keep_their_bytes(ops):
    """Random allocate/drop sequences: every live array keeps the bytes written to it and
    no two live arrays overlap, whatever the pool reused or dropped."""
    pool = OutputPool(max_bytes=600_000, min_nbytes=4096)
    live: dict[int, np.ndarray] = {}
    stamp = 0
    for allocate, slot, scale in ops:
        if allocate:
            stamp += 1
            array = pool.empty((scale * 70, 48, 8), np.uint8)
            array[...] = stamp % 251
            live[slot] = array  # replaces (drops) whatever was in the slot
        else:
            live.pop(slot, None)
        arrays = list(live.values())
        for i, a in enumerate(arrays):
            assert a.min() == a.max()
            for b in arrays[i + 1 :]:
                assert not np.shares_memory(a, b)
    assert pool.owned_bytes <= pool.max_bytes


@pytest.fixture
def pool_everything(monkeypatch):
    """Pool even the simulator's small outputs, so reuse happens on every step."""
    from r3capture.aux_output import request_book

    monkeypatch.setattr(request_book, "OutputPool", functools.partial(OutputPool, min_nbytes=1))


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_worker_outputs_stay_intact_with_every_output_pooled(pool_everything, scenario):
    """The simulator keeps every emitted array until the end and checks them against the
    oracle then, so an output whose buffer was reused too early would fail here."""
    trace = make_trace(scenario, seed=3)
    factory = r3capture_worker_factory(kernel_impl="reference")
    got = run_trace(trace, factory, catch_errors=True, check=False)
    ref = run_trace(trace, make_vllm_worker, catch_errors=True, check=False)
    assert diff_results(ref, got) is None
    if ref.error is None:
        assert got.check_ground_truth() == ref.check_ground_truth() > 0
