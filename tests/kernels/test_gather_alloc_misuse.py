"""gather_alloc on calls the engine should never make: a launch serial that is not the last
launch's + 1. It fails closed by status in that launch and in every later launch that would
read what it left.
"""

from __future__ import annotations

import pytest
import torch

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
