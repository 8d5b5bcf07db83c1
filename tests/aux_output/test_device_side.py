"""DeviceSide on a CPU device: the bound on slot-ring updates one upload carries."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from r3capture.aux_output.device_side import DeviceSide, pick_destination

L, K, B = 2, 2, 4


def _device_side(max_updates: int) -> DeviceSide:
    side = DeviceSide(
        capture_buffer=torch.zeros((8, L, K), dtype=torch.int32),
        dtype=np.dtype(np.uint8),
        block_size=B,
        max_num_seqs=2,
        max_updates=max_updates,
        depth=1,
        destination="direct",
        kernel_impl="reference",
    )
    # Three table rows of a device ring two blocks wide (slots, then the block window).
    side.attach(np.full((3, 2 + 2), -1, np.int32), torch.zeros((4, B, L, K), dtype=torch.uint8))
    return side


def _upload(side: DeviceSide, flat: list[int], values: list[int]) -> None:
    """A step without requests whose only device work is the ring entries' upload."""
    side.launch(
        table_row=np.empty(0, np.int64),
        ring_updates=(np.array(flat, np.int64), np.array(values, np.int64)),
        shape=None,
        query_start_loc=None,
        positions=None,
        num_rejected=None,
        num_rows=0,
    )


def test_an_upload_of_as_many_ring_entries_as_sized_for_is_applied():
    side = _device_side(max_updates=2)
    _upload(side, [0, 5], [3, 1])
    # Flat entries 0 and 5: row 0's first slot column, row 1's second.
    assert side._ring_flat[[0, 5]].tolist() == [3, 1]


def test_more_ring_entries_than_sized_for_are_refused():
    side = _device_side(max_updates=2)
    with pytest.raises(OverflowError, match="3 slot-ring updates exceed 2"):
        _upload(side, [0, 1, 5], [3, 2, 1])


@pytest.mark.parametrize(
    ("requested", "depth", "picked"),
    [
        ("auto", 1, "direct"),
        ("auto", 2, "direct"),
        ("auto", 3, "staging"),  # a later step may be scheduled over rows still in flight
        ("auto", 4, "staging"),
        ("direct", 3, "direct"),  # explicit: kept, and the commit fails such a step closed
        ("staging", 1, "staging"),
    ],
)
def test_auto_destination_is_staging_from_three_steps_in_flight(requested, depth, picked):
    assert pick_destination(requested, torch.device("cpu"), depth) == picked
