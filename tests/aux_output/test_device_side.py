"""DeviceSide on a CPU device, driven as the request book drives it (launch serials 1, 2,
..., the queue's tail, fresh flags): a step's round trip (check, launch, copies back,
results) in both destinations, the slots the kernel takes from the free-slot queue and keeps
per request index across launches, fresh indices, the per-step buffers of steps in flight,
the transfer count and the device bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from r3capture.aux_output.device_side import DeviceSide, pick_destination
from r3capture.aux_output.errors import AuxOutputProtocolError
from r3capture.kernels import KernelArgumentError, Status
from sim.request_indices import RequestIndices

L, K, B = 2, 2, 4
NUM_SEQS, RING_WIDTH, QUEUE_SIZE, NUM_SLOTS, CAPTURE_ROWS = 4, 4, 8, 8, 12
# The free slots the host put in the queue, in queue order.
QUEUE = [6, 5, 3, 2, 7, 1, 0, 4]
IMPLS = ["reference", "triton"]


def _capture(seed: int) -> torch.Tensor:
    """int32 ``[CAPTURE_ROWS, L, K]`` rows, nonzero and distinct per (seed, row)."""
    values = torch.arange(CAPTURE_ROWS * L * K, dtype=torch.int32) * 3 + seed
    return (values % 250 + 1).reshape(CAPTURE_ROWS, L, K)


def _make_side(
    *,
    depth: int = 2,
    destination: str = "direct",
    impl: str = "reference",
) -> tuple[DeviceSide, torch.Tensor]:
    """``(side, arena)``: a DeviceSide attached to ``arena``, ``NUM_SLOTS`` zeroed slots of
    ``[B, L, K]``."""
    side = DeviceSide(
        capture_buffer=_capture(1),
        dtype=np.dtype(np.uint8),
        block_size=B,
        max_num_seqs=NUM_SEQS,
        ring_width=RING_WIDTH,
        queue_size=QUEUE_SIZE,
        depth=depth,
        destination=destination,
        kernel_impl=impl,
    )
    arena = torch.zeros((NUM_SLOTS, B, L, K), dtype=torch.uint8)
    side.attach(arena)
    return side, arena


class _Driver:
    """The request book's part: the queue's entries and tail, the launch serials, the
    request indices (Model Runner V2's, ``RequestIndices``)."""

    def __init__(self, side: DeviceSide, *, tail: int = len(QUEUE)) -> None:
        self.side = side
        side.queue_np[: len(QUEUE)] = QUEUE
        self.tail = tail
        self.launches = 0
        self.indices = RequestIndices(NUM_SEQS)

    def step(self, requests: list[tuple[str, int, int, int]], fresh: list[int] | None = None):
        """Launch a step of ``(req_id, start, scheduled rows, rejected)``; ``fresh``: the
        flags to fill for it. Returns its ``LaunchedStep``."""
        side = self.side
        for req_id, *_ in requests:
            if req_id not in self.indices.of:
                self.indices.add(req_id)
        counts = [n for _, _, n, _ in requests]
        qsl = torch.tensor(np.concatenate(([0], np.cumsum(counts))).astype(np.int32))
        positions = torch.cat(
            [torch.arange(s, s + n, dtype=torch.int64) for _, s, n, _ in requests]
        )
        _, idx_mapping = self.indices.mapping([req_id for req_id, *_ in requests])
        rejected = torch.tensor([r for *_, r in requests], dtype=torch.int32)
        num_reqs, num_rows = len(requests), int(qsl[-1])
        shape = side.check_step(
            qsl, positions, idx_mapping, rejected, num_reqs=num_reqs, num_rows=num_rows,
            launch=self.launches + 1, queue_tail=self.tail,
        )  # fmt: skip
        if fresh is not None:
            side.fresh_flags()[:num_reqs] = fresh
        launched = side.launch(
            shape, qsl, positions, idx_mapping, rejected, fresh=fresh is not None,
            num_rows=num_rows,
        )  # fmt: skip
        self.launches += 1
        return launched


def _results(side: DeviceSide, step) -> tuple[list[list[int]], np.ndarray | None]:
    side.copy_back(step)
    info, staged = side.host_results(step)
    return info.tolist(), staged


def _ring(side: DeviceSide, index: int) -> dict[int, int]:
    """The device ring of request index ``index``: block -> slot."""
    return {e >> 32: e & 0xFFFFFFFF for e in side._ring[index].tolist() if e >= 0}


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.uint8)


# Request a: positions 2..6, the last rejected: blocks 0 and 1, the queue's first two slots
# (6 and 5). Request b: positions 0..2: block 0, the queue's third slot (3). Step rows 0..4
# are a's (row 4 rejected), rows 5..7 b's.
FIRST_STEP = [("a", 2, 5, 1), ("b", 0, 3, 0)]
FIRST_INFO = [[2, 4, 0, 2], [0, 3, 0, 1]]


def _first_step_arena(capture: torch.Tensor) -> torch.Tensor:
    expected = torch.zeros((NUM_SLOTS, B, L, K), dtype=torch.uint8)
    expected[6, 2:4] = _u8(capture[0:2])
    expected[5, 0:2] = _u8(capture[2:4])
    expected[3, 0:3] = _u8(capture[5:8])
    return expected


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("destination", ["direct", "staging"])
def test_a_step_places_its_accepted_rows_into_the_slots_it_took(destination, impl):
    side, arena = _make_side(destination=destination, impl=impl)
    driver = _Driver(side)
    capture = side.capture_buffer.clone()
    step = driver.step(FIRST_STEP)
    info, staged = _results(side, step)
    # (start, accepted, status, slots taken from the queue) per request, in batch order.
    assert info == FIRST_INFO
    a, b = driver.indices.of["a"], driver.indices.of["b"]
    assert _ring(side, a) == {0: 6, 1: 5} and _ring(side, b) == {0: 3}
    accepted = [0, 1, 2, 3, 5, 6, 7]  # step rows
    if destination == "direct":
        assert staged is None
        assert torch.equal(arena, _first_step_arena(capture))
    else:
        # Staging keeps step-row order; the arena is written by the commit, not the kernel.
        assert staged.shape == (8, L, K)
        assert np.array_equal(staged[accepted], _u8(capture[accepted]).numpy())
        assert not arena.any()
    side.count_transfer(step, rows_written=7)
    # The staging copy moves every scheduled row, direct writes only the accepted ones.
    rows = 8 if destination == "staging" else 7
    assert side.transfer_stats == {"steps": 1, "rows": rows, "bytes": rows * L * K}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("destination", ["direct", "staging"])
def test_a_second_launch_of_an_index_continues_in_its_own_slots(destination, impl):
    """Launched while the first step is still in flight, in the other batch order: b's row
    lands in its block 0 (slot 3) and takes nothing, a's rows fill its block 1 (slot 5) and
    only its new block 2 takes a slot, the queue's next (2)."""
    side, arena = _make_side(destination=destination, impl=impl)
    driver = _Driver(side)
    first_capture = side.capture_buffer.clone()
    first = driver.step(FIRST_STEP)
    side.capture_buffer.copy_(_capture(7))
    second = driver.step([("b", 3, 1, 0), ("a", 6, 3, 0)])
    assert _results(side, first)[0] == FIRST_INFO
    info, staged = _results(side, second)
    assert info == [[3, 1, 0, 0], [6, 3, 0, 1]]
    a, b = driver.indices.of["a"], driver.indices.of["b"]
    assert _ring(side, a) == {0: 6, 1: 5, 2: 2} and _ring(side, b) == {0: 3}
    capture = _capture(7)
    if destination == "direct":
        expected = _first_step_arena(first_capture)
        expected[3, 3] = _u8(capture[0])
        expected[5, 2:4] = _u8(capture[1:3])
        expected[2, 0] = _u8(capture[3])
        assert torch.equal(arena, expected)
    else:
        assert np.array_equal(staged, _u8(capture[:4]).numpy())
        assert not arena.any()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fresh", [True, False])
def test_a_fresh_flag_makes_an_index_forget_its_earlier_owners_blocks(fresh, impl):
    """c takes the index a freed (last freed, first taken). Flagged fresh, its block 0 takes
    a new slot; unflagged, the index still reads a's block 0 and c's rows would overwrite
    a's slot, which is what the flag is for."""
    side, arena = _make_side(impl=impl)
    driver = _Driver(side)
    first_capture = side.capture_buffer.clone()
    first = driver.step([("a", 0, 3, 0)])
    assert _results(side, first)[0] == [[0, 3, 0, 1]]
    index = driver.indices.of["a"]
    driver.indices.free(["a"])
    driver.indices.add("c")
    assert driver.indices.of["c"] == index
    side.capture_buffer.copy_(_capture(7))
    second = driver.step([("c", 0, 2, 0)], fresh=[1] if fresh else None)
    info, _ = _results(side, second)
    expected = torch.zeros_like(arena)
    expected[6, 0:3] = _u8(first_capture[0:3])
    if fresh:
        assert info == [[0, 2, 0, 1]]
        assert _ring(side, index) == {0: 5}
        expected[5, 0:2] = _u8(_capture(7)[0:2])
    else:
        assert info == [[0, 2, 0, 0]]
        assert _ring(side, index) == {0: 6}
        expected[6, 0:2] = _u8(_capture(7)[0:2])
    assert torch.equal(arena, expected)


def test_a_launch_without_fresh_reads_no_flags_left_in_its_buffer():
    """Depth 1: the flags a fresh launch filled stay in the one buffer; the next launch,
    not fresh, continues in its request's slots rather than forgetting them."""
    side, arena = _make_side(depth=1)
    driver = _Driver(side)
    assert _results(side, driver.step([("a", 0, 2, 0)], fresh=[1]))[0] == [[0, 2, 0, 1]]
    assert side.fresh_flags()[0] == 1
    assert _results(side, driver.step([("a", 2, 1, 0)]))[0] == [[2, 1, 0, 0]]
    assert _ring(side, driver.indices.of["a"]) == {0: 6}
    assert arena[6, :3].any(dim=(1, 2)).all() and not arena[5].any()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("destination", ["direct", "staging"])
def test_each_step_in_flight_keeps_its_own_results(destination, impl):
    side, _ = _make_side(depth=2, destination=destination, impl=impl)
    driver = _Driver(side)
    flags = side.fresh_flags()
    first = driver.step(FIRST_STEP, fresh=[0, 0])
    # The next step's flags are its own: filling them leaves the first step's alone.
    assert not np.shares_memory(side.fresh_flags(), flags)
    side.capture_buffer.copy_(_capture(7))
    second = driver.step([("a", 6, 2, 0), ("b", 3, 3, 2)])
    assert first.ring_index != second.ring_index
    first_info, first_rows = _results(side, first)
    second_info, second_rows = _results(side, second)
    assert first_info == FIRST_INFO
    assert second_info == [[6, 2, 0, 0], [3, 1, 0, 0]]
    if destination == "staging":
        accepted = [0, 1, 2, 3, 5, 6, 7]
        assert np.array_equal(first_rows[accepted], _u8(_capture(1)[accepted]).numpy())
        assert np.array_equal(second_rows[:3], _u8(_capture(7)[:3]).numpy())
    else:
        assert first_rows is None and second_rows is None
    # The third launch reuses the first one's buffers (its results are read by then).
    assert np.shares_memory(side.fresh_flags(), flags)
    third = driver.step([("a", 8, 1, 0)])
    assert third.ring_index == first.ring_index
    assert _results(side, third)[0] == [[8, 1, 0, 1]]  # a's block 2 is new
    # The second step's buffer is untouched by the third.
    assert side.host_results(second)[0].tolist() == second_info


@pytest.mark.parametrize(("destination", "copies"), [("direct", 0), ("staging", 2)])
def test_only_staging_copies_results_back(destination, copies, monkeypatch):
    # Direct writes put step_info, like the rows, where the host reads it: on a GPU each
    # copy is a launch on the main thread (10-12 µs of host CPU on the H200).
    side, _ = _make_side(destination=destination)
    step = _Driver(side).step(FIRST_STEP)
    calls = []
    copy = torch.Tensor.copy_
    monkeypatch.setattr(
        torch.Tensor, "copy_", lambda t, *a, **k: calls.append(1) or copy(t, *a, **k)
    )
    side.copy_back(step)
    monkeypatch.undo()
    assert len(calls) == copies
    assert side.host_results(step)[0].tolist() == FIRST_INFO


@pytest.mark.parametrize("destination", ["direct", "staging"])
def test_results_are_refused_before_their_copy_back(destination):
    side, _ = _make_side(destination=destination)
    step = _Driver(side).step(FIRST_STEP)
    # Even direct writes, whose step_info is already in place: never read without the copy.
    with pytest.raises(AuxOutputProtocolError, match="CPU copy was not enqueued"):
        side.host_results(step)
    side.copy_back(step)
    assert side.host_results(step)[0].tolist() == FIRST_INFO


def test_a_step_without_requests_launches_and_copies_nothing():
    side, arena = _make_side()
    empty = side.launch(None, None, None, None, None, fresh=False, num_rows=0)
    assert empty.num_reqs == 0
    side.copy_back(empty)  # nothing to copy for a step without requests
    assert not empty.copied
    side.count_transfer(empty, rows_written=0)
    assert side.transfer_stats == {"steps": 1, "rows": 0, "bytes": 0}
    assert not arena.any() and (side._ring == -1).all()


def test_a_launch_the_queue_cannot_cover_takes_nothing():
    """One entry past the head: a needs two, so it fails NO_STOCK, and so does b after it;
    nothing is written or taken, and the next launch, with the queue refilled, takes the
    same front entries."""
    side, arena = _make_side()
    driver = _Driver(side, tail=1)
    info, _ = _results(side, driver.step(FIRST_STEP))
    no_stock = int(Status.NO_STOCK)
    assert info == [[2, -1, no_stock, 0], [0, -1, no_stock, 0]]
    assert not arena.any() and (side._ring == -1).all()
    driver.tail = len(QUEUE)
    capture = side.capture_buffer.clone()
    assert _results(side, driver.step([("a", 2, 5, 1), ("b", 0, 3, 0)]))[0] == FIRST_INFO
    assert torch.equal(arena, _first_step_arena(capture))


def test_attach_moves_the_writes_to_a_new_arena_and_keeps_the_slots():
    """The store grew: its new arena holds the old one's slots (copied by the store); the
    index's slots stay on the device, and the next launch writes them in the new arena."""
    side, arena = _make_side()
    driver = _Driver(side)
    _results(side, driver.step(FIRST_STEP))
    grown = torch.zeros((2 * NUM_SLOTS, B, L, K), dtype=torch.uint8)
    side.attach(grown)
    side.capture_buffer.copy_(_capture(7))
    before = arena.clone()
    assert _results(side, driver.step([("a", 6, 2, 0)]))[0] == [[6, 2, 0, 0]]
    assert torch.equal(arena, before)
    expected = torch.zeros_like(grown)
    expected[5, 2:4] = _u8(_capture(7)[0:2])
    assert torch.equal(grown, expected)


def test_check_step_refuses_bad_inputs_before_anything_changes():
    side, arena = _make_side()
    qsl, positions = torch.tensor([0, 2]), torch.tensor([0, 1])
    index, rejected = torch.tensor([0]), torch.tensor([0])
    bad = [
        ((qsl, positions, index.float(), rejected), 1, "request_index"),
        ((qsl, positions[:1], index, rejected), 1, "positions"),
        ((qsl, positions, index, rejected), 0, "launch"),
    ]
    for inputs, launch, name in bad:
        with pytest.raises(KernelArgumentError) as caught:
            side.check_step(*inputs, num_reqs=1, num_rows=2, launch=launch, queue_tail=8)
        assert caught.value.argument == name
    # Nothing moved: the next step still takes the first buffer and the queue's front.
    driver = _Driver(side)
    step = driver.step([("a", 0, 2, 0)])
    assert step.ring_index == 0
    assert _results(side, step)[0] == [[0, 2, 0, 1]]
    assert _ring(side, driver.indices.of["a"]) == {0: 6}


@pytest.mark.parametrize("dtype", [np.dtype(np.uint8), np.dtype(np.uint16)])
@pytest.mark.parametrize("destination", ["direct", "staging"])
@pytest.mark.parametrize("depth", [1, 2])
def test_device_bytes_counts_ring_records_heads_and_staging(destination, depth, dtype):
    def made(queue_size: int) -> DeviceSide:
        return DeviceSide(
            capture_buffer=_capture(1),
            dtype=dtype,
            block_size=B,
            max_num_seqs=NUM_SEQS,
            ring_width=RING_WIDTH,
            queue_size=queue_size,
            depth=depth,
            destination=destination,
            kernel_impl="reference",
        )

    ring = NUM_SEQS * RING_WIDTH * 8
    records = NUM_SEQS * 2 * 8
    heads = 4 * 8
    expected = ring + records + heads
    if destination == "staging":
        # Per step in flight: its staging rows and its step_info (direct writes both on
        # the host).
        rows = CAPTURE_ROWS * L * K * dtype.itemsize
        info = NUM_SEQS * 4 * 4
        expected += depth * (rows + info)
    assert made(QUEUE_SIZE).device_bytes == expected
    # The queue is in (pinned) host memory, written by the host: not device bytes.
    assert made(4 * QUEUE_SIZE).device_bytes == expected


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
