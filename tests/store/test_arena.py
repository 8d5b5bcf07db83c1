"""The arena's byte copies: writes of one run of slots or of scattered slots, and gathers,
land exactly in the slots named."""

from __future__ import annotations

import numpy as np
import pytest

from r3capture.store.arena import Arena, take_rows


@pytest.mark.parametrize(
    "slots", [[], [3], [2, 3, 4], [4, 3], [0, 2, 5], [5, 6, 1]], ids=lambda s: str(s)
)
def test_write_then_gather_moves_the_bytes_of_exactly_those_slots(slots):
    arena = Arena(8, 6, pin_memory=False, on_grow=None)
    arena.np[:] = 0xEE
    blocks = np.arange(len(slots) * 6, dtype=np.uint8).reshape(len(slots), 6)
    arena.write(slots, blocks)
    slots = np.array(slots, np.int64)
    expected = np.full((8, 6), 0xEE, np.uint8)
    expected[slots] = blocks
    assert np.array_equal(arena.np, expected)
    for n in (len(slots), 20):  # below and above the gather's switch to torch
        picks = np.resize(slots, n) if len(slots) else np.zeros(0, np.int64)
        out = np.empty((len(picks), 6), np.uint8)
        arena.gather(picks, out)
        assert np.array_equal(out, expected[picks])


@pytest.mark.parametrize("rows, width", [(1, 8), (7, 384), (300, 6144)])
def test_take_rows_copies_exactly_the_indexed_rows(rows, width):
    rng = np.random.default_rng(rows)
    source = rng.integers(0, 256, (rows * 3 + 2, width), dtype=np.uint8)
    index = rng.integers(0, len(source), rows).astype(np.int64)
    out = np.full((rows, width), 7, np.uint8)
    take_rows(source, index, out)
    assert np.array_equal(out, source[index])


@pytest.mark.parametrize("bad", [-1, 10, 11])
def test_take_rows_refuses_a_row_out_of_range_before_copying(bad):
    """numpy's clip mode would copy the nearest row instead: the bounds are checked first."""
    source = np.arange(40, dtype=np.uint8).reshape(10, 4)
    out = np.full((3, 4), 255, np.uint8)
    with pytest.raises(IndexError, match=f"rows \\[{bad}\\] out of range for 10 rows"):
        take_rows(source, np.array([1, bad, 2], np.int64), out)
    assert (out == 255).all()
