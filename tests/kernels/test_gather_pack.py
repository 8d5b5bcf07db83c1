"""gather_pack: Triton kernel (interpreter on CPU) vs torch reference vs per-row expectation.

Every output is poisoned first, so an unwritten row or a stray write fails byte-equality.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch
from gather_pack_cases import (
    DEST_SENTINEL,
    INFO_SENTINEL,
    QWEN3_30B,
    TINY,
    Case,
    Req,
    assert_same_bytes,
    build,
    clone_args,
    error_cases,
    special_cases,
    standard_cases,
)

from r3capture.kernels import (
    GatherPackLaunch,
    Status,
    can_write_host_directly,
    gather_pack,
    gather_pack_reference,
)

GP_MODULE = sys.modules["r3capture.kernels.gather_pack"]


def run(impl: str, args: dict, copy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    if copy:
        args = clone_args(args)
    if impl == "reference":
        gather_pack_reference(**args)
    else:
        gather_pack(**args, impl=impl)
    return args["dest"], args["step_info"]


def check_case(case: Case, seed: int = 0) -> dict:
    built = build(case, seed=seed)
    args = built["args"]
    k_dest, k_info = run("triton", args)
    r_dest, r_info = run("reference", args)
    assert_same_bytes("reference dest vs expected", r_dest, built["expected_dest"])
    assert_same_bytes("reference step_info vs expected", r_info, built["expected_info"])
    assert_same_bytes("kernel dest vs reference", k_dest, r_dest)
    assert_same_bytes("kernel step_info vs reference", k_info, r_info)
    return built


def written_elements(built: dict) -> int:
    dest = built["args"]["dest"]
    return int((built["expected_dest"] != DEST_SENTINEL[dest.dtype]).sum())


@pytest.mark.parametrize("case", standard_cases() + special_cases(), ids=lambda c: c.id)
def test_matches_reference_and_expected(case: Case) -> None:
    built = check_case(case)
    # The expectation itself must write exactly the accepted rows, each element once.
    accepted = sum(q.rows - (q.rejected if case.with_rejected else 0) for q in case.reqs)
    row_elems = case.model.num_layers * case.model.top_k
    assert written_elements(built) == accepted * row_elems


@pytest.mark.parametrize("case", error_cases(), ids=lambda c: c.id)
def test_failing_request_writes_nothing(case: Case) -> None:
    built = check_case(case)
    assert built["expected_info"][: len(case.reqs), 2].tolist() == case.status
    for r, status in enumerate(case.status):
        assert (built["expected_info"][r, 1] == -1) == (status != 0)


def test_statuses_are_the_contract_codes() -> None:
    assert [int(s) for s in Status] == [0, 1, 2, 3, 4, 5]
    names = ["OK", "BAD_REJECTED", "BAD_BLOCK", "BAD_ROWS", "BAD_INDEX", "NO_STOCK"]
    assert [s.name for s in Status] == names


def test_info_rows_past_num_reqs_untouched() -> None:
    built = check_case(Case("pad", QWEN3_30B, 16, [Req(2, 3)], pad_reqs=3))
    assert bool((built["expected_info"][1:] == INFO_SENTINEL).all())


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_a_table_without_rows_fails_every_request_that_writes(impl: str) -> None:
    args = clone_args(_valid_args())
    args["slot_table"] = args["slot_table"][:0]
    args["block_window"] = args["block_window"][:0]
    dest_before = args["dest"].clone()
    dest, info = run(impl, args, copy=False)
    # Request 0 keeps 4 of its 5 rows, request 1 all 40: both need blocks the table lacks.
    assert info[:2, 2].tolist() == [Status.BAD_BLOCK, Status.BAD_BLOCK]
    assert info[:2, 1].tolist() == [-1, -1]
    assert torch.equal(dest, dest_before)


def _valid_args() -> dict:
    args = build(Case("valid", QWEN3_30B, 16, [Req(5, 3, 1), Req(1, 40)]))["args"]
    return dict(args, hash_block=None, num_slots=None)


def _replace(name: str, fn):
    def edit(args: dict) -> None:
        args[name] = fn(args[name])

    return edit


def _overlapping_slots(t: torch.Tensor) -> torch.Tensor:
    """Slots one row apart: slot s+1 starts inside slot s."""
    return t.as_strided(t.shape, (t[0, 0].numel(), *t.stride()[1:]))


META = torch.device("meta")
BAD_CALLS = {
    "capture-2d": (_replace("capture", lambda t: t[:, 0]), "capture must be 3-D"),
    "capture-float": (_replace("capture", lambda t: t.float()), "capture must be of dtype"),
    "capture-int64": (_replace("capture", lambda t: t.long()), "capture must be of dtype"),
    "capture-strided": (
        _replace("capture", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)),
        "capture must be contiguous",
    ),
    "dest-int32": (_replace("dest", lambda t: t.int()), "dest must be of dtype"),
    "dest-wrong-LK": (_replace("dest", lambda t: t[:, :, :3]), "dest must be \\[S, B, 48, 8\\]"),
    "dest-B0": (_replace("dest", lambda t: t[:, :0]), "positive block size"),
    "dest-strided-rows": (_replace("dest", lambda t: t[:, ::2]), "dest must be contiguous"),
    "dest-other-device": (_replace("dest", lambda t: t.to(META)), "dest must be on the capture"),
    "dest-2d": (_replace("dest", lambda t: t[0, 0]), "dest must be \\[S, B, 48, 8\\] slots"),
    # Slots that share memory would let one request's rows land in another's slot.
    "dest-expanded-slots": (
        _replace("dest", lambda t: t[:1].expand(t.shape)),
        "dest must be of non-overlapping slots",
    ),
    "dest-overlapping-slots": (
        _replace("dest", _overlapping_slots),
        "dest must be of non-overlapping slots",
    ),
    "hash-block-mismatch": (
        _replace("hash_block", lambda v: 8),
        "hash_block must be None or dest.shape\\[1\\] \\(16\\)",
    ),
    "num-slots-past-dest": (
        _replace("num_slots", lambda v: 10**6),
        "num_slots must be None or an int in \\[0, 7\\]",
    ),
    "dest-not-tensor": (
        _replace("dest", lambda t: t.numpy()),
        "dest must be \\[S, B, 48, 8\\] slots or \\[rows, 48, 8\\] staging; got 'ndarray'",
    ),
    "dest-two-expanded-slots": (
        _replace("dest", lambda t: t[:1].expand(2, *t.shape[1:])),
        "dest must be of non-overlapping slots",
    ),
    # Only a CUDA capture may write host memory (pinned); here the capture is elsewhere.
    "capture-other-device": (
        _replace("capture", lambda t: t.to(META)),
        "dest must be on the capture's device \\(meta\\)",
    ),
    "qsl-2d": (_replace("query_start_loc", lambda t: t[None]), "query_start_loc must be 1-D"),
    "qsl-int16": (_replace("query_start_loc", lambda t: t.short()), "query_start_loc must be of"),
    "qsl-empty": (_replace("query_start_loc", lambda t: t[:0]), "query_start_loc must be of len"),
    "qsl-device": (
        _replace("query_start_loc", lambda t: t.to(META)),
        "query_start_loc must be on the capture",
    ),
    "positions-short": (_replace("positions", lambda t: t[:3]), "positions must be of length"),
    "positions-float": (_replace("positions", lambda t: t.float()), "positions must be of dtype"),
    # The kernel reads these as dense arrays: a strided view would feed it other entries.
    "positions-strided": (
        _replace("positions", lambda t: t.repeat_interleave(2)[::2]),
        "positions must be contiguous",
    ),
    "qsl-strided": (
        _replace("query_start_loc", lambda t: t.repeat_interleave(2)[::2]),
        "query_start_loc must be contiguous",
    ),
    "rejected-strided": (
        _replace("num_rejected", lambda t: t.repeat_interleave(2)[::2]),
        "num_rejected must be contiguous",
    ),
    "table-row-short": (_replace("table_row", lambda t: t[:1]), "table_row must be of length"),
    "window-float": (_replace("block_window", lambda t: t.float()), "block_window must be of"),
    "window-1d": (_replace("block_window", lambda t: t[:, 0]), "block_window must be 2-D"),
    "window-rows": (
        _replace("block_window", lambda t: t[:1]),
        "block_window must be \\[N, 2\\] \\(N = 4 table rows\\)",
    ),
    "window-col-strided": (
        _replace("block_window", lambda t: t.t().contiguous().t()),
        "block_window must be \\[N, 2\\] .*dense rows",
    ),
    "rejected-short": (_replace("num_rejected", lambda t: t[:1]), "num_rejected must be of len"),
    "rejected-float": (_replace("num_rejected", lambda t: t.float()), "num_rejected must be of"),
    "table-1d": (_replace("slot_table", lambda t: t[0]), "slot_table must be 2-D"),
    "table-zero-width": (_replace("slot_table", lambda t: t[:, :0]), "ring width W >= 1"),
    "table-col-strided": (
        _replace("slot_table", lambda t: t.t().contiguous().t()),
        "slot_table must be contiguous along dim 1",
    ),
    "info-int64": (_replace("step_info", lambda t: t.long()), "step_info must be of dtype"),
    "info-short": (
        _replace("step_info", lambda t: t[:1]),
        "step_info must be \\[R, 3\\] with R >= num_reqs \\(2\\)",
    ),
    "info-other-device": (
        _replace("step_info", lambda t: t.to(META)),
        "step_info must be on the capture's device",
    ),
    "capture-strided-rows": (
        _replace("capture", lambda t: t[::2]),
        "capture must be contiguous",
    ),
    # [rows, 1]: long enough and dense, but the kernel reads positions as a 1-D array.
    "positions-2d": (_replace("positions", lambda t: t[:, None]), "positions must be 1-D"),
    # Two columns: the narrowest ring whose column stride the kernel relies on.
    "table-two-col-strided": (
        _replace("slot_table", lambda t: t[:, :2].t().contiguous().t()),
        "slot_table must be contiguous along dim 1",
    ),
    "info-col-strided": (
        _replace("step_info", lambda t: torch.zeros(t.shape[0], 6, dtype=t.dtype)[:, ::2]),
        "step_info must be of non-overlapping rows, contiguous along dim 1",
    ),
    # Each of these passes every other term of the step check's one expression, so the
    # expression's own term for it is what stops the launch.
    "qsl-not-tensor": (
        _replace("query_start_loc", lambda t: t.numpy()),
        "query_start_loc must be a torch.Tensor",
    ),
    "qsl-column": (
        _replace("query_start_loc", lambda t: t[:, None]),
        "query_start_loc must be 1-D",
    ),
    "qsl-short-for-num-reqs": (
        _replace("query_start_loc", lambda t: t[:2]),
        "num_reqs must be an int in \\[0, 1\\]",
    ),
    "positions-not-tensor": (
        _replace("positions", lambda t: t.numpy()),
        "positions must be a torch.Tensor",
    ),
    "positions-device": (
        _replace("positions", lambda t: t.to(META)),
        "positions must be on the capture's device",
    ),
    "rejected-not-tensor": (
        _replace("num_rejected", lambda t: t.numpy()),
        "num_rejected must be a torch.Tensor",
    ),
    "rejected-column": (
        _replace("num_rejected", lambda t: t[:, None]),
        "num_rejected must be 1-D",
    ),
    "rejected-device": (
        _replace("num_rejected", lambda t: t.to(META)),
        "num_rejected must be on the capture's device",
    ),
    "info-4-cols": (
        _replace("step_info", lambda t: torch.zeros(t.shape[0], 4, dtype=t.dtype)),
        "step_info must be \\[R, 3\\]",
    ),
    "info-overlapping-rows": (
        _replace("step_info", lambda t: t[:1].expand(t.shape)),
        "step_info must be of non-overlapping rows",
    ),
    "num-reqs-too-big": (
        _replace("num_reqs", lambda v: 3),
        "num_reqs must be an int in \\[0, 2\\]",
    ),
    "num-reqs-negative": (_replace("num_reqs", lambda v: -1), "num_reqs must be an int"),
    "num-reqs-bool": (_replace("num_reqs", lambda v: True), "num_reqs must be an int"),
    "num-rows-past-capture": (_replace("num_rows", lambda v: 10**6), "num_rows must be an int"),
    "num-rows-float": (_replace("num_rows", lambda v: 3.0), "num_rows must be an int"),
    "capture-not-tensor": (_replace("capture", lambda t: t.numpy()), "capture must be a torch"),
    "capture-no-layers": (
        _replace("capture", lambda t: torch.zeros(t.shape[0], 0, t.shape[2], dtype=t.dtype)),
        "capture must be non-empty in L and K",
    ),
    "capture-no-experts": (
        _replace("capture", lambda t: torch.zeros(t.shape[0], t.shape[1], 0, dtype=t.dtype)),
        "capture must be non-empty in L and K",
    ),
    "table-row-other-device": (
        _replace("table_row", lambda t: t.to(META)),
        "table_row must be on the capture's device",
    ),
    "table-other-device": (
        _replace("slot_table", lambda t: t.to(META)),
        "slot_table must be on the capture's device",
    ),
    "window-other-device": (
        _replace("block_window", lambda t: t.to(META)),
        "block_window must be on the capture's device",
    ),
    # The kernel's per-request results written over rows it gathers from or writes to.
    "info-in-dest": (
        lambda args: args.update(step_info=_int32_rows_in(args["dest"], args["step_info"])),
        "step_info must be memory apart from dest and capture",
    ),
    "info-in-capture": (
        lambda args: args.update(step_info=_int32_rows_in(args["capture"], args["step_info"])),
        "step_info must be memory apart from dest and capture",
    ),
}


def _int32_rows_in(owner: torch.Tensor, step_info: torch.Tensor) -> torch.Tensor:
    """A ``step_info``-shaped int32 tensor over the first bytes of ``owner``'s memory."""
    nbytes = step_info.numel() * 4
    return owner.reshape(-1).view(torch.uint8)[:nbytes].view(torch.int32).view(step_info.shape)


ROWS_BAD_CALLS = {
    "rows-no-hash-block": (_replace("hash_block", lambda v: None), "hash_block must be an int"),
    "rows-float-num-slots": (_replace("num_slots", lambda v: 2.0), "num_slots must be an int"),
    "rows-dest-short": (_replace("dest", lambda t: t[:2]), "dest must be \\[rows >= num_rows"),
    "rows-dest-expanded": (
        _replace("dest", lambda t: t[:1].expand(t.shape)),
        "dest must be of non-overlapping rows",
    ),
}


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_dest_in_capture_memory_is_rejected(impl: str) -> None:
    case = Case("alias", QWEN3_30B, 16, [Req(5, 3)], capture_dtype=torch.uint8)
    args = clone_args(build(case)["args"])
    capture = args["capture"]
    args["dest"] = capture.view(capture.shape[0], 1, *capture.shape[1:])
    with pytest.raises(ValueError, match="dest must be memory apart from capture's"):
        run(impl, args, copy=False)


def _valid_rows_args() -> dict:
    case = Case("valid-rows", QWEN3_30B, 16, [Req(5, 3, 1), Req(1, 40)], rows_layout=True)
    return build(case)["args"]


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("bad", list(ROWS_BAD_CALLS), ids=str)
def test_malformed_rows_layout_calls_raise_naming_the_argument(bad: str, impl: str) -> None:
    edit, message = ROWS_BAD_CALLS[bad]
    args = clone_args(_valid_rows_args())
    edit(args)
    with pytest.raises(ValueError, match=message):
        run(impl, args, copy=False)


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("bad", list(BAD_CALLS), ids=str)
def test_malformed_calls_raise_naming_the_argument(bad: str, impl: str) -> None:
    edit, message = BAD_CALLS[bad]
    args = clone_args(_valid_args())
    edit(args)
    with pytest.raises(ValueError, match=message):
        run(impl, args, copy=False)  # a copy could make strided views contiguous


class _TaggedTensor(torch.Tensor):
    """A tensor subclass, as a framework wrapper might hand over."""


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("rows_layout", [False, True], ids=["slots", "rows"])
@pytest.mark.parametrize("with_rejected", [True, False], ids=["rejected", "no-rejected"])
def test_valid_arguments_of_subclass_types_still_launch(
    impl: str, rows_layout: bool, with_rejected: bool
) -> None:
    # The step check's one expression wants exact types; what it does not recognise goes
    # through every check one by one, and valid values of other types pass (num_rejected
    # None included).
    reqs = [Req(5, 3, 1), Req(1, 40)]
    case = Case(
        "subclass", QWEN3_30B, 16, reqs, rows_layout=rows_layout, with_rejected=with_rejected
    )
    built = build(case)
    args = clone_args(built["args"])
    args["positions"] = args["positions"].as_subclass(_TaggedTensor)
    args["num_reqs"] = type("Count", (int,), {})(args["query_start_loc"].shape[0] - 1)
    run(impl, args, copy=False)
    assert_same_bytes("dest", args["dest"], built["expected_dest"])
    assert_same_bytes("step_info", args["step_info"], built["expected_info"])


def test_a_refusal_describes_the_argument_it_got() -> None:
    args = clone_args(_valid_args())
    args["positions"] = args["positions"][:3]
    with pytest.raises(ValueError) as refused:
        gather_pack_reference(**args)
    assert str(refused.value) == (
        "gather_pack: positions must be of length >= num_rows (11); "
        "got shape (3,), dtype torch.int64, device cpu, stride (1,)"
    )


def _with_strides(t: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """``t``'s elements under ``strides``, which may differ from ``t``'s only in size-1 dims
    (whose stride never moves an index): the same tensor, laid out as a view may leave it."""
    assert all(a == b for a, b, n in zip(t.stride(), strides, t.shape) if n != 1)
    return t.as_strided(t.shape, strides)


def _edge_of_explicit_sizes() -> dict:
    # Blocks of 4 rows: more slots (8) than rows per slot, so the bound on num_slots is S.
    built = build(Case("explicit", QWEN3_30B, 4, [Req(5, 3, 1), Req(1, 40)]))
    dest = built["args"]["dest"]
    assert dest.shape[0] > dest.shape[1]
    built["args"].update(hash_block=dest.shape[1], num_slots=dest.shape[0])
    return built


def _edge_of_size_one_dims() -> dict:
    # L = K = 1: the capture's and the slots' trailing dims may carry any stride.
    built = build(Case("size-one", TINY, 16, [Req(5, 3, 1), Req(20, 40)]))
    args = built["args"]
    args["capture"] = _with_strides(args["capture"], (1, 3, 5))
    args["dest"] = _with_strides(args["dest"], (16, 1, 7, 9))
    return built


def _edge_of_single_entries() -> dict:
    # One request inside one block, no block mapped ahead, a ring one block wide: one slot,
    # one ring column, one step_info row, each of whose dims may carry any stride (nothing
    # can overlap).
    case = Case("single", QWEN3_30B, 16, [Req(4, 17, 1)], window_ahead=0, ring_width=1,
                spare_slots=0)  # fmt: skip
    built = build(case)
    args = built["args"]
    assert args["dest"].shape[0] == args["slot_table"].shape[1] == args["step_info"].shape[0] == 1
    args["dest"] = _with_strides(args["dest"], (0, *args["dest"].stride()[1:]))
    args["slot_table"] = _with_strides(args["slot_table"], (1, 5))
    args["step_info"] = _with_strides(args["step_info"], (0, 1))
    return built


VALID_EDGES = {
    "explicit-hash-block-and-num-slots": _edge_of_explicit_sizes,
    "size-one-dims-of-any-stride": _edge_of_size_one_dims,
    "single-slot-column-and-request-of-any-stride": _edge_of_single_entries,
}


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("edge", list(VALID_EDGES), ids=str)
def test_valid_calls_at_the_edges_of_the_checks_launch(edge: str, impl: str) -> None:
    built = VALID_EDGES[edge]()
    args = dict(built["args"])  # the edge's own views: a copy could change their strides
    run(impl, args, copy=False)
    assert_same_bytes("dest", args["dest"], built["expected_dest"])
    assert_same_bytes("step_info", args["step_info"], built["expected_info"])


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("rows_layout", [False, True], ids=["slots", "rows"])
def test_an_arena_without_slots_fails_every_request_that_writes(
    impl: str, rows_layout: bool
) -> None:
    # The third request writes nothing (all its rows rejected): it stays OK.
    reqs = [Req(5, 3, 1), Req(1, 40), Req(2, 20, 2)]
    built = build(Case("no-slots", QWEN3_30B, 16, reqs, rows_layout=rows_layout))
    args = clone_args(built["args"])
    if rows_layout:
        args["num_slots"] = 0
    else:
        args["dest"] = args["dest"][:0]
    dest_before = args["dest"].clone()
    run(impl, args, copy=False)
    assert args["step_info"][:, 1:].tolist() == [[-1, Status.BAD_BLOCK]] * 2 + [[0, Status.OK]]
    assert torch.equal(args["dest"], dest_before)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_a_slot_past_2_gib_of_arena_is_addressed_in_64_bits(impl: str) -> None:
    # The worker's slot table is int32; slot * slot size (in elements) overflows int32 past
    # 2**31 elements of arena (5.6M tokens of Qwen3-30B-A3B, 4.4M of Kimi-K2), so the
    # offset must be formed in 64 bits.
    built = build(Case("far-slot", QWEN3_30B, 16, [Req(5, 3)]))
    args = clone_args(built["args"])
    slot_elems = 16 * QWEN3_30B.num_layers * QWEN3_30B.top_k
    far = 2**31 // slot_elems + 1
    assert args["slot_table"].dtype == torch.int32 and far * slot_elems > 2**31
    # Only the two slots checked are initialized: the rest stays untouched virtual memory.
    args["dest"] = torch.empty((far + 1, *args["dest"].shape[1:]), dtype=torch.uint8)
    args["dest"][far - 1 :].zero_()
    table_row = int(args["table_row"][0])
    args["slot_table"][table_row] = -1
    args["slot_table"][table_row, 0] = far
    run(impl, args, copy=False)
    assert args["step_info"][0].tolist() == [3, 5, Status.OK]
    expected = torch.zeros_like(args["dest"][far])
    expected[3:8] = args["capture"][:5].to(torch.uint8)
    assert_same_bytes("far slot", args["dest"][far], expected)
    assert not args["dest"][far - 1].any()


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("qsl_entries", [1, 3], ids=["qsl-of-no-request", "qsl-of-two"])
def test_zero_requests_and_rows_are_valid_counts_of_any_int_type(
    impl: str, qsl_entries: int
) -> None:
    # Int subclasses skip the step check's one expression: each count is checked on its own.
    count = type("Count", (int,), {})
    args = clone_args(_valid_args())
    args["query_start_loc"] = args["query_start_loc"][:qsl_entries]
    args.update(num_reqs=count(0), num_rows=count(0))
    dest_before, info_before = args["dest"].clone(), args["step_info"].clone()
    run(impl, args, copy=False)
    assert torch.equal(args["dest"], dest_before)
    assert torch.equal(args["step_info"], info_before)


def test_unknown_impl_is_rejected() -> None:
    with pytest.raises(ValueError, match="impl must be"):
        gather_pack(**_valid_args(), impl="cuda")


class _RecordingKernel:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def __getitem__(self, grid):
        return lambda **kwargs: self.calls.append(("triton", grid))


def test_auto_picks_triton_under_interpreter_and_reference_without(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(GP_MODULE, "_gather_pack_kernel", _RecordingKernel(calls))
    gather_pack(**clone_args(_valid_args()))
    assert [c[0] for c in calls] == ["triton"]
    monkeypatch.setattr(GP_MODULE, "_interpreting", lambda: False)
    args = clone_args(_valid_args())
    gather_pack(**args)
    assert len(calls) == 1  # CPU tensors, no interpreter: the reference ran instead
    assert args["step_info"][:, 2].tolist() == [0, 0]


def test_reference_impl_never_launches_the_kernel_even_under_the_interpreter(
    monkeypatch,
) -> None:
    calls = []
    monkeypatch.setattr(GP_MODULE, "_gather_pack_kernel", _RecordingKernel(calls))
    monkeypatch.setattr(GP_MODULE, "_interpreting", lambda: True)
    args = clone_args(_valid_args())
    gather_pack(**args, impl="reference")
    assert calls == []
    assert args["step_info"][:, 2].tolist() == [0, 0]


def test_prepared_launch_checks_only_per_step_arguments_and_matches_one_shot() -> None:
    built = build(Case("plan", QWEN3_30B, 16, [Req(5, 3, 1), Req(1, 40), Req(20, 60, 2)]))
    args = clone_args(built["args"])
    launch = GatherPackLaunch(
        args["capture"], args["table_row"], args["slot_table"], args["block_window"],
        args["dest"], args["step_info"], impl="triton",
    )  # fmt: skip
    qsl, positions = args["query_start_loc"], args["positions"]
    launch(qsl, positions, args["num_rejected"], num_reqs=3, num_rows=args["num_rows"])
    assert_same_bytes("prepared dest", args["dest"], built["expected_dest"])
    assert_same_bytes("prepared step_info", args["step_info"], built["expected_info"])
    with pytest.raises(ValueError, match="num_reqs must be an int in \\[0, 3\\]"):
        launch(qsl, positions, num_reqs=4)
    with pytest.raises(ValueError, match="positions must be of length >= num_rows"):
        launch(qsl, positions[:2], num_reqs=3, num_rows=26)
    with pytest.raises(ValueError, match="num_rejected must be of dtype"):
        launch(qsl, positions, args["num_rejected"].float(), num_reqs=3)
    with pytest.raises(ValueError, match="query_start_loc must be 1-D"):
        launch(qsl[None], positions, num_reqs=3)
    with pytest.raises(ValueError, match="query_start_loc must be a torch.Tensor"):
        launch(qsl.numpy(), positions)  # without num_reqs, nothing to count it from
    with pytest.raises(ValueError, match="query_start_loc must be 1-D"):
        launch(qsl[0], positions)
    # Without num_reqs, every request query_start_loc holds: the same writes again.
    args["dest"].copy_(built["args"]["dest"])
    args["step_info"].copy_(built["args"]["step_info"])
    launch(qsl, positions, args["num_rejected"], num_rows=args["num_rows"])
    assert_same_bytes("prepared dest, all requests", args["dest"], built["expected_dest"])
    assert_same_bytes("prepared step_info, all requests", args["step_info"], built["expected_info"])


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setattr(GP_MODULE, "_interpreting", lambda: False)
    with pytest.raises(ValueError, match="needs a CUDA capture or TRITON_INTERPRET=1"):
        gather_pack(**clone_args(_valid_args()), impl="triton")


def test_kernel_module_does_not_import_the_reference() -> None:
    tree = ast.parse(Path(GP_MODULE.__file__).read_text())
    top_level = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    names = [getattr(n, "module", None) or n.names[0].name for n in top_level]
    assert not any("reference" in name for name in names), names


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_no_direct_host_writes_without_cuda() -> None:
    assert can_write_host_directly() is False
    assert can_write_host_directly("cuda:0") is False


def test_driver_enum_values_match_the_cuda_header_triton_ships() -> None:
    # A wrong value asks the driver another question: attribute 2 (the memory type, 1 for
    # host memory) once stood in for the device pointer, and kernels stored to address 1.
    import re

    import triton

    from r3capture.kernels import _device

    header = Path(triton.__file__).parent / "backends/nvidia/include/cuda.h"
    text = header.read_text()
    for name in (
        "CU_POINTER_ATTRIBUTE_DEVICE_POINTER",
        "CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING",
        "CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY",
    ):
        (value,) = re.findall(rf"\b{name}\s*=\s*(\d+)", text)
        assert getattr(_device, "_" + name) == int(value), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_a_host_tensor_without_a_driver_is_passed_as_itself() -> None:
    # No driver to map it: the launcher keeps the tensor, and Triton's own launcher decides.
    from r3capture.kernels._device import kernel_address

    tensor = torch.zeros(8, dtype=torch.int32)
    assert kernel_address(tensor) is tensor


def test_an_empty_step_info_may_sit_anywhere_but_a_used_one_must_be_writable() -> None:
    # PyTorch never pins an empty tensor, so an empty step_info "in pinned host memory" for a
    # CUDA capture is an unpinned CPU tensor (the H200 run of 2026-12-04 failed on it). It
    # admits no request, so nothing ever writes it; one with rows must still be reachable.
    from r3capture.kernels._common import GatherPackArgumentError, check_static_args

    def on_meta(shape, dtype=torch.int32):
        return torch.zeros(shape, dtype=dtype, device="meta")  # a device other than the CPU

    args = dict(
        capture=on_meta((8, 2, 2)),
        table_row=on_meta(4),
        slot_table=on_meta((5, 4)),
        block_window=on_meta((5, 2)),
        dest=on_meta((4, 4, 2, 2), torch.uint8),
        hash_block=None,
        num_slots=None,
    )
    empty = torch.zeros((0, 3), dtype=torch.int32)
    assert check_static_args(**args, step_info=empty).max_requests == 0
    with pytest.raises(GatherPackArgumentError, match="step_info must be on the capture's"):
        check_static_args(**args, step_info=torch.zeros((2, 3), dtype=torch.int32))
