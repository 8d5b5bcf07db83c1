"""gather_alloc on calls the engine should never make: two requests of a launch on one request
index, and a launch serial that is not the last launch's + 1. Each fails closed by status in
that launch, and in every later launch that would read what it left, and no request ever
reports OK with a row anywhere but where its caller's account puts it.

The account is the worker's (``RequestBook``): the queue entries a launch took go, in batch
order and by ``step_info[:, 3]``, to the requests the kernel placed, each from the end of its
own blocks (or its first block); those of a request the kernel failed go back to the caller.
"""

from __future__ import annotations

import random

import pytest
import torch
from gather_alloc_cases import Scenario, programs_in_order

from r3capture.kernels import Status, gather_alloc, gather_alloc_reference

IMPLS = ["triton", "reference"]
STATE = ("ring", "records", "heads", "dest")  # what a failed launch must leave as it was


def _call(impl: str, state: dict, **kwargs) -> None:
    if impl == "reference":
        gather_alloc_reference(**state, **kwargs)
    else:
        gather_alloc(**state, **kwargs, impl=impl)


def _issue_state() -> dict:
    """Two request indices, slots of 2 rows, L = K = 1, and the queue 5, 6, 7, 0."""
    return dict(
        capture=torch.zeros((4, 1, 1), dtype=torch.int32),
        ring=torch.full((2, 4), -1, dtype=torch.int64),
        records=torch.zeros((2, 2), dtype=torch.int64),
        queue=torch.tensor([5, 6, 7, 0], dtype=torch.int32),
        heads=torch.zeros(4, dtype=torch.int64),
        dest=torch.zeros((8, 2, 1, 1), dtype=torch.uint8),
        step_info=torch.zeros((2, 4), dtype=torch.int32),
    )


def _statuses(state: dict, num_reqs: int) -> list[int]:
    return state["step_info"][:num_reqs, 2].tolist()


@pytest.mark.parametrize("impl", IMPLS)
def test_two_requests_on_one_index_fail_closed_in_that_launch_and_every_later_one(impl):
    """The issue's case: A holds index 0 (block 0 in slot 5); a launch gives index 0 to A
    (block 1) and to a new request C too. Both fail and write nothing; A alone on index 0
    still fails (its block 1 would have been split over two slots); a request new to the
    index (fresh) takes it over and is placed."""
    s = _issue_state()
    s["capture"][:2] = 11
    _call(impl, s, query_start_loc=torch.tensor([0, 2]), positions=torch.tensor([0, 1, 0, 0]),
          request_index=torch.tensor([0]), launch=1, queue_tail=3)  # fmt: skip
    assert s["step_info"][0].tolist() == [0, 2, Status.OK, 1]
    s["capture"][0], s["capture"][1] = 12, 33
    before = {name: s[name].clone() for name in STATE}
    _call(impl, s, query_start_loc=torch.tensor([0, 1, 2]),
          positions=torch.tensor([2, 0, 0, 0]), request_index=torch.tensor([0, 0]),
          fresh=torch.tensor([0, 1], dtype=torch.uint8), launch=2, queue_tail=3)  # fmt: skip
    assert _statuses(s, 2) == [Status.SHARED_INDEX] * 2
    assert s["step_info"][:2, 1].tolist() == [-1, -1]
    assert torch.equal(s["dest"], before["dest"]) and torch.equal(s["ring"], before["ring"])
    s["capture"][0] = 13
    before = {name: s[name].clone() for name in ("ring", "dest")}
    _call(impl, s, query_start_loc=torch.tensor([0, 1]), positions=torch.tensor([3, 0, 0, 0]),
          request_index=torch.tensor([0]), launch=3, queue_tail=4)  # fmt: skip
    assert s["step_info"][0].tolist() == [3, -1, Status.SHARED_INDEX, 0]
    assert torch.equal(s["dest"], before["dest"]) and torch.equal(s["ring"], before["ring"])
    # Launch 2 took queue entries 1-2 (step_info[:, 3] says so); the next is entry 3, slot 0.
    s["capture"][:2] = torch.tensor([21, 22]).view(2, 1, 1)
    _call(impl, s, query_start_loc=torch.tensor([0, 2]), positions=torch.tensor([0, 1, 0, 0]),
          request_index=torch.tensor([0]), fresh=torch.tensor([1], dtype=torch.uint8),
          launch=4, queue_tail=4)  # fmt: skip
    assert s["step_info"][0].tolist() == [0, 2, Status.OK, 1]
    assert s["dest"][0, :, 0, 0].tolist() == [21, 22]
    assert s["dest"][5, :, 0, 0].tolist() == [11, 11]  # A's block 0, untouched throughout


@pytest.mark.parametrize("impl", IMPLS)
def test_every_request_on_a_shared_index_fails_whatever_else_it_fails(impl):
    """Requests 0, 1 and 3 share index 1: one with rows, one whose rejected count is bad (its
    status says so), one new to the index with no rows at all. All three fail, index 0's
    request is placed, an index out of range is no request's; then index 1 fails a request
    it is not new to, and takes one that is."""
    s = _issue_state()
    s["step_info"] = torch.zeros((5, 4), dtype=torch.int32)
    s["capture"][:4] = torch.tensor([1, 2, 3, 4]).view(4, 1, 1)
    _call(impl, s, query_start_loc=torch.tensor([0, 2, 3, 4, 4, 4]),
          positions=torch.tensor([0, 1, 0, 2]), request_index=torch.tensor([1, 1, 0, 1, 9]),
          num_rejected=torch.tensor([0, 5, 0, 0, 0]),
          fresh=torch.tensor([0, 0, 0, 1, 0], dtype=torch.uint8), num_rows=4, launch=1,
          queue_tail=4)  # fmt: skip
    assert _statuses(s, 5) == [Status.SHARED_INDEX, Status.BAD_REJECTED, Status.OK,
                               Status.SHARED_INDEX, Status.BAD_INDEX]  # fmt: skip
    # Entries in batch order: request 0 takes entry 0 all the same, request 2 entry 1 (slot
    # 6) for its block 1, the only block written.
    assert s["step_info"][:, 3].tolist() == [1, 0, 1, 0, 0]
    assert s["dest"][6, 0, 0, 0] == 4 and int(s["dest"].sum()) == 4
    one = dict(query_start_loc=torch.tensor([0, 1]), positions=torch.tensor([2, 0, 0, 0]),
               request_index=torch.tensor([1]), num_rows=1, queue_tail=4)  # fmt: skip
    _call(impl, s, **one, launch=2)
    assert s["step_info"][0].tolist() == [2, -1, Status.SHARED_INDEX, 0]
    _call(impl, s, **one, fresh=torch.tensor([1], dtype=torch.uint8), launch=3)
    assert s["step_info"][0].tolist() == [2, 1, Status.OK, 1]
    assert s["dest"][7, 0, 0, 0] == 1  # queue entry 2


def _serial_state() -> dict:
    state = _issue_state()
    state["capture"] = torch.arange(1, 9, dtype=torch.int32).view(8, 1, 1)
    state["queue"] = torch.tensor([3, 1, 4, 2], dtype=torch.int32)
    return state


def _one_request(impl: str, state: dict, serial: int, index: int, start: int, num_reqs=1):
    """A launch of one request on ``index`` that opens block ``start // 2`` (2 rows)."""
    positions = torch.tensor([start, start + 1] + [0] * 6)
    _call(impl, state, query_start_loc=torch.tensor([0, 2]), positions=positions,
          request_index=torch.tensor([index]), num_reqs=num_reqs, num_rows=2, launch=serial,
          queue_tail=4)  # fmt: skip


# Serials a caller might get wrong, after launch 1: the serial that fails, and the right one.
SERIAL_MISTAKES = {
    "skipped-one": 3,
    "repeated": 1,
    "counted-an-empty-call": "empty",
    "backwards": 0,
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mistake", list(SERIAL_MISTAKES))
def test_a_serial_other_than_the_last_plus_one_fails_every_request_and_changes_nothing(
    mistake, impl
):
    """Launch 1 took queue entry 0; a launch with the wrong serial would read a stale head
    (entry 0 again: a slot two indices share) or stale records. It fails every request
    (BAD_LAUNCH), writes nothing but step_info, and leaves the state so that the right
    serial then takes entry 1."""
    state = _serial_state()
    _one_request(impl, state, 1, index=0, start=0)
    assert state["step_info"][0].tolist() == [0, 2, Status.OK, 1]
    serial = SERIAL_MISTAKES[mistake]
    if serial == "empty":
        _one_request(impl, state, 2, index=1, start=0, num_reqs=0)  # launches nothing
        serial = 3
    if serial == 0:
        # Serials start at 1: 0 is refused by name; going back is launch 2 after launch 3.
        _one_request(impl, state, 2, index=0, start=2)
        _one_request(impl, state, 3, index=0, start=4)
        serial = 2
    before = {name: state[name].clone() for name in STATE}
    state["step_info"].fill_(-99)
    _one_request(impl, state, serial, index=1, start=0)
    assert state["step_info"][0].tolist() == [-1, -1, Status.BAD_LAUNCH, 0]
    for name in STATE:
        assert torch.equal(state[name], before[name]), name
    right = 4 if mistake == "backwards" else 2
    _one_request(impl, state, right, index=1, start=0)
    entry = 3 if mistake == "backwards" else 1
    assert state["step_info"][0].tolist() == [0, 2, Status.OK, 1]
    assert int(state["ring"][1, 0]) & 0xFFFFFFFF == int(state["queue"][entry])


class _Caller(Scenario):
    """The worker's side of a launch sequence, with its account of each request."""

    def account(self, step: list, info: list[list[int]]) -> None:
        """Hand out the entries the launch took (``info``: its step_info rows), check each
        placed request took exactly its new blocks, record its rows."""
        offset = self.head
        for (req_id, _, start, rows, rejected, value), (_, accepted, status, taken) in zip(
            step, info
        ):
            slots = self.queue_model[offset : offset + taken]
            offset += taken
            request = self.live[req_id]
            if status != Status.OK:
                self.free_slots.extend(slots)
                continue
            assert accepted == rows - rejected, (req_id, info)
            blocks = range(start // self.block, (start + accepted - 1) // self.block + 1)
            new = [b for b in blocks if b not in request.blocks] if accepted else []
            assert taken == len(new), (req_id, new, info)
            request.blocks.update(zip(new, slots))
            request.rows.update({start + i: value + i for i in range(accepted)})
            request.cursor = start + accepted
        self.head = offset

    def assert_every_placed_row_is_where_its_account_says(self, dest: torch.Tensor) -> None:
        for req_id, request in self.live.items():
            for position, value in request.rows.items():
                slot = request.blocks[position // self.block]
                got = int(dest[slot, position % self.block, 0, 0])
                assert got == value % 256, (req_id, position, slot, got, value % 256)


def _draw_step(caller: _Caller, max_rows: int) -> list:
    """``(req_id, index, start, rows, rejected, first value)`` per request, in batch order."""
    ids = list(caller.live)
    caller.rng.shuffle(ids)
    step, total = [], 0
    for req_id in ids[: caller.rng.randint(1, 4)]:
        request = caller.live[req_id]
        rows = min(caller.rng.choice([1, 1, 2, 3, 2 * caller.block + 1]), max_rows - total)
        if rows <= 0:
            break
        rejected = caller.rng.randint(0, rows - 1) if caller.rng.random() < 0.3 else 0
        value = caller.rng.randrange(1, 200)
        step.append([req_id, request.index, request.cursor, rows, rejected, value])
        total += rows
    return step


# Every launch's misuse, in turn (a misuse the step cannot take is none).
MISUSES = ("none", "shared", "none", "intruder", "shared", "serial")


def _misuse(caller: _Caller, step: list, kind: str) -> str:
    """Change the step the way a faulty engine might (``kind``); returns what it did."""
    if kind == "shared" and len(step) >= 2:
        # One request of the step on another's index (it keeps its own afterwards).
        victim, intruder = caller.rng.sample(range(len(step)), 2)
        if caller.live[step[intruder][0]].launched:  # a new one would take that index
            step[intruder][1] = step[victim][1]
            return "shared"
    if kind == "intruder":
        # A new request given the index of a request of the step; the engine drops it after.
        victim = caller.rng.randrange(len(step))
        req_id = caller.admit(index=step[victim][1])
        request = caller.live[req_id]
        step.append([req_id, request.index, request.cursor, 1, 0, 7])
        return "intruder"
    if kind == "serial":
        return "serial"
    return "none"


def _reversed(n: int) -> list[int]:
    return list(range(n))[::-1]


@pytest.mark.parametrize("order", [None, _reversed], ids=["in-order", "reversed"])
@pytest.mark.parametrize("block", [1, 2, 4])
@pytest.mark.parametrize("seed", range(3))
def test_misused_launch_sequences_never_place_a_row_where_the_account_does_not(block, seed, order):
    """Drawn launch sequences where a launch now and then gives two requests one index (one
    already launched on its own, or a new one), or goes with a wrong serial. The kernel (its
    programs run in turn, or in reverse: every request sharing an index writes the same
    record) and its reference agree state for state; every request on a shared index fails;
    a wrong serial fails every request and changes nothing; every placed request takes
    exactly its new blocks; and after every launch each live request's rows are where its
    account says, whatever came before (requests that failed go on being launched)."""
    with programs_in_order(order):
        _misused_sequence(block, seed)


def _misused_sequence(block: int, seed: int) -> None:
    T = 16
    caller = _Caller(block, 5, T // block + 2, 12, 48, random.Random(seed * 100 + block))
    capture = torch.zeros((T, 1, 1), dtype=torch.int32)
    kernel = dict(
        ring=torch.full((5, caller.ring_width), -1, dtype=torch.int64),
        records=torch.zeros((5, 2), dtype=torch.int64),
        queue=torch.full((caller.queue_size,), -1, dtype=torch.int32),
        heads=torch.zeros(4, dtype=torch.int64),
        dest=torch.zeros((caller.num_slots, block, 1, 1), dtype=torch.uint8),
        step_info=torch.zeros((8, 4), dtype=torch.int32),
    )
    reference = {name: t.clone() for name, t in kernel.items()}
    seen = set()
    for launch in range(18):
        while len(caller.live) < 3 and caller.free_indices:
            caller.admit()
        caller.refill(kernel["queue"], caller.queue_size)
        reference["queue"].copy_(kernel["queue"])
        step = _draw_step(caller, T - 1)
        kind = _misuse(caller, step, MISUSES[launch % len(MISUSES)])
        qsl, positions = [0], torch.zeros(T, dtype=torch.int64)
        for _, _, start, rows, _, value in step:
            positions[qsl[-1] : qsl[-1] + rows] = torch.arange(start, start + rows)
            capture[qsl[-1] : qsl[-1] + rows, 0, 0] = torch.arange(value, value + rows)
            qsl.append(qsl[-1] + rows)
        fresh = [not caller.live[s[0]].launched for s in step]
        serial = caller.launch + 1
        if kind == "serial":  # a serial skipped, or the last one again
            serial = caller.launch + 2 if caller.rng.random() < 0.5 else max(caller.launch, 1)
            serial += serial == caller.launch + 1
        args = dict(
            capture=capture, query_start_loc=torch.tensor(qsl), positions=positions,
            request_index=torch.tensor([s[1] for s in step]),
            num_rejected=torch.tensor([s[4] for s in step]),
            fresh=torch.tensor(fresh) if any(fresh) else None, num_rows=qsl[-1],
            launch=serial, queue_tail=len(caller.queue_model),
        )  # fmt: skip
        before = {name: kernel[name].clone() for name in STATE}
        gather_alloc(**kernel, **args, impl="triton")
        gather_alloc_reference(**reference, **args)
        for name in kernel:
            assert torch.equal(kernel[name], reference[name]), (caller.launch, name)
        info = kernel["step_info"][: len(step)].tolist()
        statuses = [row[2] for row in info]
        seen.add(kind)
        if kind == "serial":
            assert statuses == [Status.BAD_LAUNCH] * len(step)
            for name in STATE:
                assert torch.equal(kernel[name], before[name]), name
            continue
        caller.launch = serial
        indices = [s[1] for s in step]
        for s, status in zip(step, statuses):
            if indices.count(s[1]) > 1:
                assert status == Status.SHARED_INDEX, (kind, step, info)
        for s in step:
            caller.live[s[0]].launched = True
        caller.account(step, info)
        caller.assert_every_placed_row_is_where_its_account_says(kernel["dest"])
        if kind == "intruder":
            caller.finish(step[-1][0], frees_index=False)
        for s, status in zip(step, statuses):
            if s[0] in caller.live and caller.rng.random() < (0.2 if status else 0.15):
                caller.finish(s[0])
    assert {"shared", "intruder", "serial"} <= seen
