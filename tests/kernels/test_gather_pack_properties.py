"""gather_pack on drawn input: it fails closed on any query_start_loc, and refuses any
malformed argument by name without writing a byte.

The kernel runs under the Triton interpreter (conftest sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import pytest
import torch
from gather_pack_cases import DEST_SENTINEL, TINY, Case, Req, assert_same_bytes, build, clone_args
from hypothesis import given, settings
from hypothesis import strategies as st

from r3capture.kernels import Status, gather_pack, gather_pack_reference

BLOCK = 4
SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def steps_with_any_query_start_loc(draw):
    """A valid step of 1-4 requests, then its query_start_loc replaced by drawn integers."""
    reqs = []
    for _ in range(draw(st.integers(1, 4))):
        rows = draw(st.integers(1, 6))
        reqs.append(Req(rows, draw(st.integers(0, 12)), draw(st.integers(0, rows))))
    built = build(Case("drawn", TINY, BLOCK, reqs), seed=draw(st.integers(0, 99)))
    total = sum(r.rows for r in reqs)
    qsl = draw(st.lists(st.integers(-2, total + 3), min_size=len(reqs) + 1, max_size=len(reqs) + 1))
    if draw(st.booleans()):
        qsl.sort()  # monotone but with requests' ranges moved: still must not lie
    args = built["args"]
    args["query_start_loc"] = torch.tensor(qsl, dtype=args["query_start_loc"].dtype)
    return args


@SETTINGS
@given(args=steps_with_any_query_start_loc())
def test_any_query_start_loc_kernel_equals_reference_and_ok_means_written(args):
    kernel, reference = clone_args(args), clone_args(args)
    gather_pack(**kernel, impl="triton")
    gather_pack_reference(**reference)
    assert_same_bytes("dest", kernel["dest"], reference["dest"])
    assert_same_bytes("step_info", kernel["step_info"], reference["step_info"])

    qsl = args["query_start_loc"].tolist()
    num_reqs = len(qsl) - 1
    info = kernel["step_info"][:num_reqs].tolist()
    if qsl[0] < 0 or any(b < a for a, b in zip(qsl, qsl[1:])):
        assert [status for *_, status in info] == [Status.BAD_ROWS] * num_reqs
    dest, capture = kernel["dest"], args["capture"]
    slot_table, rejected = args["slot_table"], args["num_rejected"].tolist()
    width = slot_table.shape[1]
    written = 0
    for r, (start, accepted, status) in enumerate(info):
        if status != Status.OK:
            assert accepted == -1
            continue
        # OK promises every accepted row of r's range, at its position's slot.
        assert accepted == qsl[r + 1] - qsl[r] - rejected[r] >= 0
        has_rows = qsl[r + 1] > qsl[r]
        assert start == (int(args["positions"][qsl[r]]) if has_rows else -1)
        row = int(args["table_row"][r])
        for i in range(accepted):
            position = start + i
            slot = int(slot_table[row, (position // BLOCK) % width])
            assert int(dest[slot, position % BLOCK, 0, 0]) == int(capture[qsl[r] + i, 0, 0])
        written += accepted
    # ...and nothing else: every other element still holds the poison.
    assert int((dest != DEST_SENTINEL[dest.dtype]).sum()) == written


def _valid_args() -> dict:
    return build(Case("valid", TINY, BLOCK, [Req(5, 3, 1), Req(2, 9)]))["args"]


TENSOR_ARGS = ("capture", "query_start_loc", "positions", "table_row", "slot_table",
               "block_window", "dest", "step_info", "num_rejected")  # fmt: skip
TENSOR_CORRUPTIONS = {
    "float": lambda t: t.double(),
    "one-more-dim": lambda t: t[None],
    "one-less-dim": lambda t: t[0],
    "meta-device": lambda t: t.to("meta"),
    "numpy": lambda t: t.numpy(),
    "list": lambda t: t.tolist(),
    "int8": lambda t: t.to(torch.int8),
}
SCALAR_CORRUPTIONS = [2.5, True, "1", -1, 10**9, [1]]


@st.composite
def malformed_calls(draw):
    """(argument name, malformed arguments): one argument corrupted, the rest valid."""
    args = clone_args(_valid_args())
    if draw(st.booleans()):
        name = draw(st.sampled_from(TENSOR_ARGS))
        corruption = draw(st.sampled_from(sorted(TENSOR_CORRUPTIONS)))
        args[name] = TENSOR_CORRUPTIONS[corruption](args[name])
    else:
        name = draw(st.sampled_from(["num_reqs", "num_rows"]))
        args[name] = draw(st.sampled_from(SCALAR_CORRUPTIONS))
    return name, args


# Moving the capture buffer moves the device every other tensor is checked against: the
# first tensor found on the wrong device is the one named.
NAMED_INSTEAD = {("capture", "meta-device"): "query_start_loc"}


@SETTINGS
@given(call=malformed_calls(), impl=st.sampled_from(["triton", "reference"]))
def test_malformed_argument_is_named_and_nothing_is_written(call, impl):
    name, args = call
    dest, step_info = args["dest"], args["step_info"]
    outputs = [t.clone() for t in (dest, step_info) if isinstance(t, torch.Tensor)]
    with pytest.raises((ValueError, TypeError)) as info:
        gather_pack(**args, impl=impl)
    message = str(info.value)
    assert name in message or any(
        other in message for (arg, _), other in NAMED_INSTEAD.items() if arg == name
    ), message
    still = [t for t in (dest, step_info) if isinstance(t, torch.Tensor)]
    for before, after in zip(outputs, still):
        if after.device.type != "meta":
            assert torch.equal(before, after), f"{name}: a refused call wrote its outputs"


def _every_other_entry(t: torch.Tensor) -> torch.Tensor:
    """The same values with every dim-0 stride doubled (a view that skips entries)."""
    return t.repeat_interleave(2, dim=0)[::2]


def _every_other_column(t: torch.Tensor) -> torch.Tensor:
    return t.repeat_interleave(2, dim=-1)[..., ::2]


def _inner_transposed(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


# Each keeps the tensor's values and changes only its layout.
LAYOUTS = {
    "every-other-entry": (_every_other_entry, 1),
    "every-other-column": (_every_other_column, 2),
    "inner-transposed": (_inner_transposed, 2),
}


@st.composite
def relaid_calls(draw):
    """(argument name, layout name, seed): one tensor argument of a valid call laid out anew."""
    layout = draw(st.sampled_from(sorted(LAYOUTS)))
    min_dim = LAYOUTS[layout][1]
    names = [n for n in TENSOR_ARGS if _valid_args()[n].dim() >= min_dim]
    return draw(st.sampled_from(names)), layout, draw(st.integers(0, 99))


@SETTINGS
@given(call=relaid_calls(), impl=st.sampled_from(["triton", "reference"]))
def test_any_layout_of_an_argument_is_read_as_laid_out_or_refused_by_name(call, impl):
    """Strided and non-contiguous views of every tensor argument: the call either refuses the
    argument by name before writing a byte, or reads and writes every tensor through its
    strides, with the dense call's exact outputs (a strided ``table_row`` once sent one
    request's rows into another's slot)."""
    name, layout, seed = call
    reqs = [Req(5, 3 + seed % 7, seed % 3), Req(2, 9), Req(3, seed % 13, 1)]
    built = build(Case("relaid", TINY, BLOCK, reqs), seed=seed)
    args = clone_args(built["args"])
    args[name] = LAYOUTS[layout][0](args[name])
    dest, step_info = args["dest"], args["step_info"]
    dest_before, info_before = dest.clone(), step_info.clone()
    try:
        gather_pack(**args, impl=impl)
    except ValueError as refused:
        assert f"gather_pack: {name} must" in str(refused), str(refused)
        assert torch.equal(dest, dest_before) and torch.equal(step_info, info_before)
        return
    assert_same_bytes("dest", dest, built["expected_dest"])
    assert_same_bytes("step_info", step_info, built["expected_info"])


def test_a_strided_table_row_is_refused_by_name():
    """The case the property above found: two requests, ``table_row`` a view with stride 2."""
    args = clone_args(_valid_args())
    wide = torch.stack([args["table_row"], args["table_row"].flip(0)], dim=1).flatten()
    args["table_row"] = wide[::2]
    assert torch.equal(args["table_row"], _valid_args()["table_row"])
    for impl in ("triton", "reference"):
        with pytest.raises(ValueError, match="table_row must be contiguous"):
            gather_pack(**clone_args(args) | {"table_row": wide[::2]}, impl=impl)
