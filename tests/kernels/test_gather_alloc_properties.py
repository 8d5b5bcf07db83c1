"""gather_alloc on drawn input: it fails closed on any query_start_loc, refuses any malformed
argument by name without writing a byte, and reads every layout it accepts through its
strides.

The kernel runs under the Triton interpreter (conftest sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import pytest
import torch
from gather_alloc_cases import (
    DEST_SENTINEL,
    STATE,
    TINY,
    Case,
    Req,
    assert_state,
    build,
    clone_args,
    plain_launch,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from r3capture.kernels import Status, gather_alloc, gather_alloc_reference

BLOCK = 4
SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def steps_with_any_query_start_loc(draw):
    """A valid launch of 1-4 requests, then its query_start_loc replaced by drawn integers."""
    reqs = []
    for _ in range(draw(st.integers(1, 4))):
        rows = draw(st.integers(1, 6))
        reqs.append(Req(rows, draw(st.integers(0, 12)), draw(st.integers(0, rows)),
                        fresh=draw(st.booleans())))  # fmt: skip
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
    gather_alloc(**kernel, impl="triton")
    gather_alloc_reference(**reference)
    assert_state("kernel vs reference", kernel, reference)
    expected = plain_launch(clone_args(args), BLOCK, args["dest"].shape[0])
    assert_state("reference vs plain model", reference, expected)

    qsl = args["query_start_loc"].tolist()
    num_reqs = len(qsl) - 1
    info = kernel["step_info"][:num_reqs].tolist()
    if qsl[0] < 0 or any(b < a for a, b in zip(qsl, qsl[1:])):
        assert [status for _, _, status, _ in info] == [Status.BAD_ROWS] * num_reqs
    rejected = args["num_rejected"].tolist()
    written = 0
    for r, (start, accepted, status, _) in enumerate(info):
        if status != Status.OK:
            assert accepted == -1
            continue
        # OK promises every accepted row of r's range.
        assert accepted == qsl[r + 1] - qsl[r] - rejected[r] >= 0
        has_rows = qsl[r + 1] > qsl[r]
        assert start == (int(args["positions"][qsl[r]]) if has_rows else -1)
        written += accepted
    # ...and nothing else: every other element still holds the poison.
    dest = kernel["dest"]
    assert int((dest != DEST_SENTINEL[dest.dtype]).sum()) == written


def _valid_args() -> dict:
    reqs = [Req(5, 3, 1), Req(2, 9), Req(3, 0, fresh=True)]
    return build(Case("valid", TINY, BLOCK, reqs))["args"]


TENSOR_ARGS = ("capture", "query_start_loc", "positions", "request_index", "ring", "records",
               "queue", "heads", "dest", "step_info", "num_rejected", "fresh")  # fmt: skip
TENSOR_CORRUPTIONS = {
    "float": lambda t: t.double(),
    "one-more-dim": lambda t: t[None],
    "one-less-dim": lambda t: t[0],
    "meta-device": lambda t: t.to("meta"),
    "numpy": lambda t: t.numpy(),
    "list": lambda t: t.tolist(),
    "int8": lambda t: t.to(torch.int8),
}
SCALAR_CORRUPTIONS = {
    "num_reqs": [2.5, True, "1", -1, 10**9, [1]],
    "num_rows": [2.5, True, "1", -1, 10**9, [1]],
    "launch": [2.5, True, "1", -1, 0, 2**40, [1]],
    "queue_tail": [2.5, True, "1", -1, [1]],
}
# Moving the capture buffer moves the device every other tensor is checked against: the
# first tensor found on the wrong device is the one named.
NAMED_INSTEAD = {("capture", "meta-device"): "dest"}


@st.composite
def malformed_calls(draw):
    """(argument name, corruption, malformed arguments): one argument corrupted, the rest
    valid."""
    args = clone_args(_valid_args())
    if draw(st.booleans()):
        name = draw(st.sampled_from(TENSOR_ARGS))
        corruption = draw(st.sampled_from(sorted(TENSOR_CORRUPTIONS)))
        args[name] = TENSOR_CORRUPTIONS[corruption](args[name])
    else:
        name = draw(st.sampled_from(sorted(SCALAR_CORRUPTIONS)))
        corruption = "scalar"
        args[name] = draw(st.sampled_from(SCALAR_CORRUPTIONS[name]))
    return name, corruption, args


@SETTINGS
@given(call=malformed_calls(), impl=st.sampled_from(["triton", "reference"]))
def test_malformed_argument_is_named_and_nothing_is_written(call, impl):
    name, corruption, args = call
    outputs = {k: args[k].clone() for k in STATE if isinstance(args[k], torch.Tensor)}
    call_ = gather_alloc_reference if impl == "reference" else gather_alloc
    extra = {} if impl == "reference" else {"impl": impl}
    with pytest.raises((ValueError, TypeError)) as info:
        call_(**args, **extra)
    message = str(info.value)
    named = NAMED_INSTEAD.get((name, corruption), name)
    assert named in message, message
    for key, before in outputs.items():
        after = args[key]
        if after.device.type != "meta" and after.shape == before.shape:
            assert torch.equal(before, after), f"{name}: a refused call wrote {key}"


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
    strides, with the dense call's exact outputs (a strided records view once let the
    kernel read another request's records)."""
    name, layout, seed = call
    reqs = [Req(5, 3 + seed % 7, seed % 3), Req(2, 9, fresh=True), Req(3, seed % 13, 1)]
    built = build(Case("relaid", TINY, BLOCK, reqs), seed=seed)
    args = clone_args(built["args"])
    args[name] = LAYOUTS[layout][0](args[name])
    before = {k: args[k].clone() for k in STATE}
    call_ = gather_alloc_reference if impl == "reference" else gather_alloc
    extra = {} if impl == "reference" else {"impl": impl}
    try:
        call_(**args, **extra)
    except ValueError as refused:
        assert f"gather_alloc: {name} must" in str(refused), str(refused)
        for key, value in before.items():
            assert torch.equal(args[key], value), key
        return
    assert_state("relaid", args, built["expected"])


def test_strided_records_are_refused_by_name():
    """The case the property above found: records a view whose rows are 4 apart, which the
    kernel (reading index * 2) would have misread."""
    for impl in ("triton", "reference"):
        args = clone_args(_valid_args())
        args["records"] = _every_other_entry(args["records"])
        assert args["records"].stride() == (4, 1)
        call_ = gather_alloc_reference if impl == "reference" else gather_alloc
        extra = {} if impl == "reference" else {"impl": impl}
        with pytest.raises(ValueError, match="records must be \\[N, 2\\]"):
            call_(**args, **extra)
