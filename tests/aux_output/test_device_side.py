"""DeviceSide on a CPU device: a step's round trip (upload, launch, copies back, results) in
both destinations, the per-step buffers of steps in flight, the transfer count, and the bound
on slot-ring updates one upload carries."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from r3capture.aux_output import device_side
from r3capture.aux_output.device_side import DeviceSide, pick_destination
from r3capture.aux_output.errors import AuxOutputProtocolError

L, K, B = 2, 2, 4


def _make_side(*, max_num_seqs=2, max_updates=8, depth=1, destination="direct", capture=None):
    """``(side, arena)``: a DeviceSide (reference kernel) attached to a ring of four table
    rows two blocks wide (slot columns, then each row's block window) and to ``arena``, eight
    slots of ``[B, L, K]`` uint8."""
    side = DeviceSide(
        capture_buffer=torch.zeros((8, L, K), dtype=torch.int32) if capture is None else capture,
        dtype=np.dtype(np.uint8),
        block_size=B,
        max_num_seqs=max_num_seqs,
        max_updates=max_updates,
        depth=depth,
        destination=destination,
        kernel_impl="reference",
    )
    arena = torch.zeros((8, B, L, K), dtype=torch.uint8)
    side.attach(np.full((4, 2 + 2), -1, np.int32), arena)
    return side, arena


def _upload(side: DeviceSide, flat: list[int], values: list[int]) -> None:
    """A step without requests whose only device work is the ring entries' upload."""
    _launch(side, (np.array(flat, np.int64), np.array(values, np.int64)))


def _launch(side: DeviceSide, ring_updates=None, rejected: list[int] | None = None):
    """Launch a step without requests or, given host ``rejected`` counts, the two-request
    step ``STEP_*``; returns its ``LaunchedStep``."""
    inputs = dict(
        table_row=np.empty(0, np.int64),
        shape=None,
        query_start_loc=None,
        positions=None,
        num_rejected=None,
        num_rows=0,
    )
    if rejected is not None:
        num_rejected = torch.tensor(rejected)
        inputs = dict(
            table_row=STEP_ROWS,
            shape=side.check_step(STEP_QSL, STEP_POSITIONS, num_rejected, num_reqs=2, num_rows=5),
            query_start_loc=STEP_QSL,
            positions=STEP_POSITIONS,
            num_rejected=num_rejected,
            num_rows=5,
        )
    return side.launch(ring_updates=ring_updates, **inputs)


def test_an_upload_of_as_many_ring_entries_as_sized_for_is_applied():
    side, _ = _make_side(max_updates=2)
    _upload(side, [0, 5], [3, 1])
    # Flat entries 0 and 5: row 0's first slot column, row 1's second.
    assert side._ring_flat[[0, 5]].tolist() == [3, 1]


@pytest.mark.parametrize(("max_num_seqs", "max_updates"), [(2, 8), (3, 6)])
def test_every_upload_size_reaches_the_device_whole(max_num_seqs, max_updates):
    """An upload copies a power-of-two prefix of the buffer, or all of it; whatever its
    used length (``max_num_seqs`` rounded up to even, ``+ 3 n``: both parities of
    ``max_num_seqs``, every power-of-two boundary, buffers of 26 and 22 entries), none of
    its entries is cut off."""
    side, _ = _make_side(max_num_seqs=max_num_seqs, max_updates=max_updates)
    for n in range(1, max_updates + 1):
        flat = list(range(16 - n, 16))
        values = [100 * n + i for i in range(n)]  # never left in the buffer by an earlier one
        _upload(side, flat, values)
        assert side._ring_flat[flat].tolist() == values, n


@pytest.mark.parametrize("max_cached_counts", [256, 2])
def test_uploads_repeating_a_count_reach_the_device_from_every_step_buffer(
    max_cached_counts, monkeypatch
):
    """The views of an upload are made once per entry count and reused: counts that repeat,
    alternate between the two step buffers of depth 2 and come back after the cache of
    views was emptied (a bound of 2 counts) still land whole, table rows included."""
    monkeypatch.setattr(device_side, "_MAX_CACHED_COUNTS", max_cached_counts)
    side, _ = _make_side(max_num_seqs=3, max_updates=6, depth=2)
    for step, n in enumerate([2, 2, 5, 2, 1, 5, 6, 2, 1, 1]):
        flat = list(range(16 - n, 16))
        values = [100 * step + i for i in range(n)]
        rows = np.array([step % 4, (step + 1) % 4], np.int64)
        # What launch() does before the kernel, into step buffer ``step % 2``.
        side._upload(step % 2, rows, (np.array(flat, np.int64), np.array(values, np.int64)))
        assert side._ring_flat[flat].tolist() == values, step
        assert side._table_row_dev[:2].tolist() == rows.tolist(), step
    assert len(side._update_views) <= max_cached_counts


def test_more_ring_entries_than_sized_for_are_refused():
    side, _ = _make_side(max_updates=2)
    for _ in range(2):  # a refused count is never remembered as a valid one
        with pytest.raises(OverflowError, match="3 slot-ring updates exceed 2"):
            _upload(side, [0, 1, 5], [3, 2, 1])


# Two requests on table rows 1 and 0 of a ring two blocks wide (slot columns, then each
# row's block window [lo, hi]): table row 1 writes positions 0..2 of block 0 into slot 6,
# table row 0 positions 4..5 of block 1 into slot 5. Both slots are past B, the block size.
STEP_ROWS = np.array([1, 0], np.int64)
STEP_RING = (
    np.array([1 * 4 + 0, 1 * 4 + 2, 1 * 4 + 3, 0 * 4 + 1, 0 * 4 + 2, 0 * 4 + 3], np.int64),
    np.array([6, 0, 0, 5, 1, 1], np.int64),
)
STEP_QSL = torch.tensor([0, 3, 5])
STEP_POSITIONS = torch.tensor([0, 1, 2, 4, 5])


def _capture(seed: int) -> torch.Tensor:
    """int32 ``[8, L, K]`` rows, distinct per (seed, row)."""
    return (torch.arange(8 * L * K, dtype=torch.int32).reshape(8, L, K) * 3 + seed) % 251


@pytest.mark.parametrize("destination", ["direct", "staging"])
def test_a_step_places_its_accepted_rows_and_reports_them(destination):
    side, arena = _make_side(depth=2, destination=destination, capture=_capture(0))
    capture = side.capture_buffer.to(torch.uint8)
    step = _launch(side, STEP_RING, rejected=[1, 0])
    side.copy_back(step)
    info, staged = side.host_results(step)
    # (start, rows written, status) per request: 2 of 3 rows accepted, then 2 of 2.
    assert info.tolist() == [[0, 2, 0], [4, 2, 0]]
    accepted = [0, 1, 3, 4]  # step rows
    if destination == "direct":
        assert staged is None
        assert torch.equal(arena[6, :2], capture[0:2]) and torch.equal(arena[5, :2], capture[3:5])
    else:
        # Staging keeps step-row order; the arena is written by the commit, not the kernel.
        assert staged.shape == (5, L, K)
        assert np.array_equal(staged[accepted], capture[accepted].numpy())
        assert not arena.any()
    side.count_transfer(step, rows_written=4)
    # The staging copy moves every scheduled row, direct writes only the accepted ones.
    rows = 5 if destination == "staging" else 4
    assert side.transfer_stats == {"steps": 1, "rows": rows, "bytes": rows * L * K}


@pytest.mark.parametrize(("destination", "copies"), [("direct", 0), ("staging", 2)])
def test_only_staging_copies_results_back(destination, copies, monkeypatch):
    # Direct writes put step_info, like the rows, where the host reads it: on a GPU each
    # copy is a launch on the main thread (10-12 µs of host CPU on the H200).
    side, _ = _make_side(depth=2, destination=destination, capture=_capture(0))
    step = _launch(side, STEP_RING, rejected=[1, 0])
    calls = []
    copy = torch.Tensor.copy_
    monkeypatch.setattr(
        torch.Tensor, "copy_", lambda t, *a, **k: calls.append(1) or copy(t, *a, **k)
    )
    side.copy_back(step)
    monkeypatch.undo()
    assert len(calls) == copies
    assert side.host_results(step)[0].tolist() == [[0, 2, 0], [4, 2, 0]]


def test_each_step_in_flight_keeps_its_own_results():
    side, _ = _make_side(depth=2, destination="staging", capture=_capture(0))
    first = _launch(side, STEP_RING, rejected=[1, 0])
    side.capture_buffer.copy_(_capture(7))
    second = _launch(side, rejected=[0, 2])
    side.copy_back(first)
    side.copy_back(second)
    assert first.ring_index != second.ring_index
    first_info, first_rows = side.host_results(first)
    second_info, second_rows = side.host_results(second)
    assert first_info.tolist() == [[0, 2, 0], [4, 2, 0]]
    assert second_info.tolist() == [[0, 3, 0], [4, 0, 0]]
    assert np.array_equal(first_rows[[0, 1]], _capture(0)[[0, 1]].to(torch.uint8).numpy())
    assert np.array_equal(second_rows[:3], _capture(7)[:3].to(torch.uint8).numpy())
    # The third launch reuses the first one's buffers: its results are read by then.
    assert _launch(side, rejected=[0, 0]).ring_index == first.ring_index


def test_results_are_read_only_after_their_copy_back():
    side, _ = _make_side(depth=2, capture=_capture(0))
    step = _launch(side, STEP_RING, rejected=[0, 0])
    with pytest.raises(AuxOutputProtocolError, match="CPU copy was not enqueued"):
        side.host_results(step)
    empty = _launch(side)
    side.copy_back(empty)  # nothing to copy for a step without requests
    assert not empty.copied
    side.count_transfer(empty, rows_written=0)
    assert side.transfer_stats == {"steps": 1, "rows": 0, "bytes": 0}


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
