"""The arena's byte copies: writes of one run of slots or of scattered slots, and gathers,
land exactly in the slots named."""

from __future__ import annotations

import numpy as np
import pytest

from r3capture.store.arena import Arena


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
