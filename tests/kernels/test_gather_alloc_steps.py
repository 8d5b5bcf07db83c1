"""gather_alloc on single launches: the Triton kernel (interpreter on CPU) vs the torch
reference vs the plain per-row model of ``gather_alloc_cases``, over every step kind, model
shape, dtype, layout and failure; and the launcher's argument checks.

Every output is poisoned first, so an unwritten row or a stray write fails byte-equality;
the state a launch writes (ring, records, heads) is compared too.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch
from gather_alloc_cases import (
    DEST_SENTINEL,
    INFO_SENTINEL,
    QWEN3_30B,
    STATE,
    TINY,
    Case,
    Req,
    assert_same_bytes,
    assert_state,
    build,
    clone_args,
    error_cases,
    special_cases,
    standard_cases,
    statuses,
)

from r3capture.kernels import (
    GatherAllocLaunch,
    KernelArgumentError,
    Status,
    can_write_host_directly,
    gather_alloc,
    gather_alloc_reference,
)

GA_MODULE = sys.modules["r3capture.kernels.gather_alloc"]


def run(impl: str, args: dict, copy: bool = True) -> dict:
    if copy:
        args = clone_args(args)
    if impl == "reference":
        gather_alloc_reference(**args)
    else:
        gather_alloc(**args, impl=impl)
    return args


def check_case(case: Case, seed: int = 0) -> dict:
    built = build(case, seed=seed)
    args, expected = built["args"], built["expected"]
    kernel = run("triton", args)
    reference = run("reference", args)
    assert_state("reference vs expected", reference, expected)
    assert_state("kernel vs reference", kernel, reference)
    return built


def written_elements(built: dict) -> int:
    dest = built["expected"]["dest"]
    return int((dest != DEST_SENTINEL[dest.dtype]).sum())


@pytest.mark.parametrize("case", standard_cases() + special_cases(), ids=lambda c: c.id)
def test_matches_reference_and_expected(case: Case) -> None:
    built = check_case(case)
    assert statuses(built["expected"], len(case.reqs)) == case.status
    # The expectation itself must write exactly the accepted rows, each element once.
    accepted = sum(q.rows - (q.rejected if case.with_rejected else 0) for q in case.reqs)
    row_elems = case.model.num_layers * case.model.top_k
    assert written_elements(built) == accepted * row_elems


@pytest.mark.parametrize("case", error_cases(), ids=lambda c: c.id)
def test_failing_request_writes_nothing(case: Case) -> None:
    built = check_case(case)
    info = built["expected"]["step_info"]
    assert statuses(built["expected"], len(case.reqs)) == case.status
    written = 0
    for r, (req, status) in enumerate(zip(case.reqs, case.status)):
        assert (info[r, 1] == -1) == (status != 0)
        if status == 0:
            written += req.rows - (req.rejected if case.with_rejected else 0)
    row_elems = case.model.num_layers * case.model.top_k
    assert written_elements(built) == written * row_elems


def test_statuses_are_the_contract_codes() -> None:
    assert [int(s) for s in Status] == [0, 1, 2, 3, 4, 5, 6, 7]
    names = ["OK", "BAD_REJECTED", "BAD_BLOCK", "BAD_ROWS", "BAD_INDEX", "NO_STOCK",
             "BAD_LAUNCH", "SHARED_INDEX"]  # fmt: skip
    assert [s.name for s in Status] == names


def test_info_rows_past_num_reqs_untouched() -> None:
    built = check_case(Case("pad", QWEN3_30B, 16, [Req(2, 3)], pad_reqs=3))
    assert bool((built["expected"]["step_info"][1:] == INFO_SENTINEL).all())


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


def _int32_rows_in(owner: torch.Tensor, step_info: torch.Tensor) -> torch.Tensor:
    """A ``step_info``-shaped int32 tensor over the first bytes of ``owner``'s memory."""
    nbytes = step_info.numel() * 4
    return owner.reshape(-1).view(torch.uint8)[:nbytes].view(torch.int32).view(step_info.shape)


META = torch.device("meta")
# The checks of the capture, the destination and the per-step inputs (the state's own are
# in test_gather_alloc.py).
BAD_CALLS = {
    "capture-2d": (_replace("capture", lambda t: t[:, 0]), "capture must be 3-D"),
    "capture-float": (_replace("capture", lambda t: t.float()), "capture must be of dtype"),
    "capture-int64": (_replace("capture", lambda t: t.long()), "capture must be of dtype"),
    "capture-strided": (
        _replace("capture", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)),
        "capture must be contiguous",
    ),
    "capture-strided-rows": (_replace("capture", lambda t: t[::2]), "capture must be contiguous"),
    "capture-not-tensor": (_replace("capture", lambda t: t.numpy()), "capture must be a torch"),
    "capture-no-layers": (
        _replace("capture", lambda t: torch.zeros(t.shape[0], 0, t.shape[2], dtype=t.dtype)),
        "capture must be non-empty in L and K",
    ),
    "capture-no-experts": (
        _replace("capture", lambda t: torch.zeros(t.shape[0], t.shape[1], 0, dtype=t.dtype)),
        "capture must be non-empty in L and K",
    ),
    # Only a CUDA capture may write host memory (pinned); here the capture is elsewhere.
    "capture-other-device": (
        _replace("capture", lambda t: t.to(META)),
        "dest must be on the capture's device \\(meta\\)",
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
    "dest-not-tensor": (
        _replace("dest", lambda t: t.numpy()),
        "dest must be \\[S, B, 48, 8\\] slots or \\[rows, 48, 8\\] staging; got 'ndarray'",
    ),
    "hash-block-mismatch": (
        _replace("hash_block", lambda v: 8),
        "hash_block must be None or dest.shape\\[1\\] \\(16\\)",
    ),
    "num-slots-past-dest": (
        _replace("num_slots", lambda v: 10**6),
        "num_slots must be None or an int in \\[0, ",
    ),
    "qsl-2d": (_replace("query_start_loc", lambda t: t[None]), "query_start_loc must be 1-D"),
    "qsl-int16": (_replace("query_start_loc", lambda t: t.short()), "query_start_loc must be of"),
    "qsl-empty": (_replace("query_start_loc", lambda t: t[:0]), "query_start_loc must be of len"),
    "qsl-device": (
        _replace("query_start_loc", lambda t: t.to(META)),
        "query_start_loc must be on the capture",
    ),
    "qsl-strided": (
        _replace("query_start_loc", lambda t: t.repeat_interleave(2)[::2]),
        "query_start_loc must be contiguous",
    ),
    "qsl-not-tensor": (
        _replace("query_start_loc", lambda t: t.numpy()),
        "query_start_loc must be a torch.Tensor",
    ),
    "qsl-short-for-num-reqs": (
        _replace("query_start_loc", lambda t: t[:2]),
        "num_reqs must be an int in \\[0, 1\\]",
    ),
    "positions-short": (_replace("positions", lambda t: t[:3]), "positions must be of length"),
    "positions-float": (_replace("positions", lambda t: t.float()), "positions must be of dtype"),
    # The kernel reads these as dense arrays: a strided view would feed it other entries.
    "positions-strided": (
        _replace("positions", lambda t: t.repeat_interleave(2)[::2]),
        "positions must be contiguous",
    ),
    "positions-2d": (_replace("positions", lambda t: t[:, None]), "positions must be 1-D"),
    "positions-not-tensor": (
        _replace("positions", lambda t: t.numpy()),
        "positions must be a torch.Tensor",
    ),
    "positions-device": (
        _replace("positions", lambda t: t.to(META)),
        "positions must be on the capture's device",
    ),
    "index-short": (_replace("request_index", lambda t: t[:1]), "request_index must be of len"),
    "index-device": (
        _replace("request_index", lambda t: t.to(META)),
        "request_index must be on the capture's device",
    ),
    "rejected-strided": (
        _replace("num_rejected", lambda t: t.repeat_interleave(2)[::2]),
        "num_rejected must be contiguous",
    ),
    "rejected-short": (_replace("num_rejected", lambda t: t[:1]), "num_rejected must be of len"),
    "rejected-float": (_replace("num_rejected", lambda t: t.float()), "num_rejected must be of"),
    "rejected-not-tensor": (
        _replace("num_rejected", lambda t: t.numpy()),
        "num_rejected must be a torch.Tensor",
    ),
    "rejected-column": (_replace("num_rejected", lambda t: t[:, None]), "num_rejected must be 1-D"),
    "rejected-device": (
        _replace("num_rejected", lambda t: t.to(META)),
        "num_rejected must be on the capture's device",
    ),
    "info-int64": (_replace("step_info", lambda t: t.long()), "step_info must be of dtype"),
    "info-short": (_replace("step_info", lambda t: t[:1]), "num_reqs must be an int in \\[0, 1\\]"),
    "info-other-device": (
        _replace("step_info", lambda t: t.to(META)),
        "step_info must be on the capture's device",
    ),
    "info-col-strided": (
        _replace("step_info", lambda t: torch.zeros(t.shape[0], 8, dtype=t.dtype)[:, ::2]),
        "step_info must be of non-overlapping rows, contiguous along dim 1",
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
    # The kernel's per-request results written over rows it gathers from or writes to.
    "info-in-dest": (
        lambda args: args.update(step_info=_int32_rows_in(args["dest"], args["step_info"])),
        "step_info must be memory apart from dest",
    ),
    "info-in-capture": (
        lambda args: args.update(step_info=_int32_rows_in(args["capture"], args["step_info"])),
        "step_info must be memory apart from capture",
    ),
}

ROWS_BAD_CALLS = {
    "rows-no-hash-block": (_replace("hash_block", lambda v: None), "hash_block must be an int"),
    "rows-float-num-slots": (_replace("num_slots", lambda v: 2.0), "num_slots must be an int"),
    "rows-dest-short": (_replace("dest", lambda t: t[:2]), "dest must be \\[rows >= num_rows"),
    "rows-dest-expanded": (
        _replace("dest", lambda t: t[:1].expand(t.shape)),
        "dest must be of non-overlapping rows",
    ),
}


def _refused_without_a_write(impl: str, args: dict, message: str) -> None:
    outputs = {k: args[k].clone() for k in STATE if isinstance(args[k], torch.Tensor)}
    with pytest.raises(KernelArgumentError, match=message):
        run(impl, args, copy=False)  # a copy could make strided views contiguous
    for name, before in outputs.items():
        after = args[name]
        if after.device.type != "meta" and after.shape == before.shape:
            assert torch.equal(after, before), f"a refused call wrote {name}"


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("bad", list(BAD_CALLS), ids=str)
def test_malformed_calls_raise_naming_the_argument(bad: str, impl: str) -> None:
    edit, message = BAD_CALLS[bad]
    args = clone_args(_valid_args())
    edit(args)
    _refused_without_a_write(impl, args, message)


def _valid_rows_args() -> dict:
    case = Case("valid-rows", QWEN3_30B, 16, [Req(5, 3, 1), Req(1, 40)], rows_layout=True)
    return build(case)["args"]


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("bad", list(ROWS_BAD_CALLS), ids=str)
def test_malformed_rows_layout_calls_raise_naming_the_argument(bad: str, impl: str) -> None:
    edit, message = ROWS_BAD_CALLS[bad]
    args = clone_args(_valid_rows_args())
    edit(args)
    _refused_without_a_write(impl, args, message)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_dest_in_capture_memory_is_rejected(impl: str) -> None:
    case = Case("alias", QWEN3_30B, 16, [Req(5, 3)], capture_dtype=torch.uint8)
    args = clone_args(build(case)["args"])
    capture = args["capture"]
    args["dest"] = capture.view(capture.shape[0], 1, *capture.shape[1:])
    with pytest.raises(ValueError, match="dest must be memory apart from capture's"):
        run(impl, args, copy=False)


def test_a_refusal_describes_the_argument_it_got() -> None:
    args = clone_args(_valid_args())
    args["positions"] = args["positions"][:3]
    with pytest.raises(KernelArgumentError) as refused:
        gather_alloc_reference(**args)
    assert refused.value.argument == "positions"
    assert str(refused.value) == (
        "gather_alloc: positions must be of length >= num_rows (11); "
        "got shape (3,), dtype torch.int64, device cpu, stride (1,)"
    )


def _with_strides(t: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """``t``'s elements under ``strides``, which may differ from ``t``'s only in size-1 dims
    (whose stride never moves an index): the same tensor, laid out as a view may leave it."""
    assert all(a == b for a, b, n in zip(t.stride(), strides, t.shape) if n != 1)
    return t.as_strided(t.shape, strides)


def _edge_of_explicit_sizes() -> dict:
    built = build(Case("explicit", QWEN3_30B, 4, [Req(5, 3, 1), Req(1, 40)]))
    dest = built["args"]["dest"]
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
    # One request inside one held block, a ring one block wide, one step_info row: each of
    # their size-1 dims may carry any stride (nothing can overlap).
    case = Case("single", QWEN3_30B, 16, [Req(4, 17, 1)], ring_width=1, extra_indices=0)
    built = build(case)
    args = built["args"]
    assert args["ring"].shape == (1, 1) and args["step_info"].shape[0] == 1
    args["ring"] = _with_strides(args["ring"], (1, 5))
    args["step_info"] = _with_strides(args["step_info"], (0, 1))
    return built


VALID_EDGES = {
    "explicit-hash-block-and-num-slots": _edge_of_explicit_sizes,
    "size-one-dims-of-any-stride": _edge_of_size_one_dims,
    "single-column-and-request-of-any-stride": _edge_of_single_entries,
}


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("edge", list(VALID_EDGES), ids=str)
def test_valid_calls_at_the_edges_of_the_checks_launch(edge: str, impl: str) -> None:
    built = VALID_EDGES[edge]()
    args = dict(built["args"])  # the edge's own views: a copy could change their strides
    run(impl, args, copy=False)
    assert_state("edge", args, built["expected"])


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
    assert args["step_info"][:, 1:3].tolist() == [[-1, Status.BAD_BLOCK]] * 2 + [[0, Status.OK]]
    assert torch.equal(args["dest"], dest_before)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_a_slot_past_2_gib_of_arena_is_addressed_in_64_bits(impl: str) -> None:
    # Slot * slot size (in elements) overflows int32 past 2**31 elements of arena (5.6M
    # tokens of Qwen3-30B-A3B), so the offset must be formed in 64 bits.
    built = build(Case("far-slot", QWEN3_30B, 16, [Req(5, 3)]))
    args = clone_args(built["args"])
    slot_elems = 16 * QWEN3_30B.num_layers * QWEN3_30B.top_k
    far = 2**31 // slot_elems + 1
    assert far * slot_elems > 2**31
    # Only the two slots checked are initialized: the rest stays untouched virtual memory.
    args["dest"] = torch.empty((far + 1, *args["dest"].shape[1:]), dtype=torch.uint8)
    args["dest"][far - 1 :].zero_()
    index = int(args["request_index"][0])
    args["ring"][index, 0] = far  # block 0 (held: the request starts at position 3)
    run(impl, args, copy=False)
    assert args["step_info"][0].tolist() == [3, 5, Status.OK, 0]
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
    before = {name: args[name].clone() for name in STATE}
    run(impl, args, copy=False)
    for name in STATE:
        assert torch.equal(args[name], before[name]), name


def test_unknown_impl_is_rejected() -> None:
    with pytest.raises(ValueError, match="impl must be"):
        gather_alloc(**_valid_args(), impl="cuda")


class _RecordingKernel:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def __getitem__(self, grid):
        return lambda **kwargs: self.calls.append(("triton", grid))


def test_auto_picks_triton_under_interpreter_and_reference_without(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(GA_MODULE, "_gather_alloc_kernel", _RecordingKernel(calls))
    gather_alloc(**clone_args(_valid_args()))
    assert [c[0] for c in calls] == ["triton"]
    monkeypatch.setattr(GA_MODULE, "_interpreting", lambda: False)
    args = clone_args(_valid_args())
    gather_alloc(**args)
    assert len(calls) == 1  # CPU tensors, no interpreter: the reference ran instead
    assert args["step_info"][:2, 2].tolist() == [0, 0]


def test_reference_impl_never_launches_the_kernel_even_under_the_interpreter(
    monkeypatch,
) -> None:
    calls = []
    monkeypatch.setattr(GA_MODULE, "_gather_alloc_kernel", _RecordingKernel(calls))
    monkeypatch.setattr(GA_MODULE, "_interpreting", lambda: True)
    args = clone_args(_valid_args())
    gather_alloc(**args, impl="reference")
    assert calls == []
    assert args["step_info"][:2, 2].tolist() == [0, 0]


def test_prepared_launch_checks_only_per_step_arguments_and_matches_one_shot() -> None:
    case = Case("plan", QWEN3_30B, 16, [Req(5, 3, 1), Req(1, 40), Req(20, 60, 2)])
    built = build(case)
    args = clone_args(built["args"])
    launch = GatherAllocLaunch(
        args["capture"], args["ring"], args["records"], args["queue"], args["heads"],
        args["dest"], args["step_info"], impl="triton",
    )  # fmt: skip
    qsl, positions, index = args["query_start_loc"], args["positions"], args["request_index"]
    scalars = dict(launch=args["launch"], queue_tail=args["queue_tail"])
    launch(qsl, positions, index, args["num_rejected"], num_reqs=3, **scalars)
    assert_state("prepared", args, built["expected"])
    with pytest.raises(ValueError, match="num_reqs must be an int in \\[0, 3\\]"):
        launch(qsl, positions, index, num_reqs=4, **scalars)
    with pytest.raises(ValueError, match="positions must be of length >= num_rows"):
        launch(qsl, positions[:2], index, num_reqs=3, num_rows=26, **scalars)
    with pytest.raises(ValueError, match="num_rejected must be of dtype"):
        launch(qsl, positions, index, args["num_rejected"].float(), num_reqs=3, **scalars)
    with pytest.raises(ValueError, match="query_start_loc must be 1-D"):
        launch(qsl[None], positions, index, num_reqs=3, **scalars)
    with pytest.raises(ValueError, match="query_start_loc must be a torch.Tensor"):
        launch(qsl.numpy(), positions, index, **scalars)  # nothing to count it from
    with pytest.raises(ValueError, match="query_start_loc must be 1-D"):
        launch(qsl[0], positions, index, **scalars)
    # Without num_reqs, every request query_start_loc holds: the same writes again, from
    # the state the launch started from.
    fresh = clone_args(built["args"])
    for name in ("ring", "records", "heads", "dest", "step_info"):
        args[name].copy_(fresh[name])
    launch(qsl, positions, index, args["num_rejected"], **scalars)
    assert_state("prepared, all requests", args, built["expected"])


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setattr(GA_MODULE, "_interpreting", lambda: False)
    with pytest.raises(ValueError, match="needs a CUDA capture or TRITON_INTERPRET=1"):
        gather_alloc(**clone_args(_valid_args()), impl="triton")


def test_kernel_module_does_not_import_the_reference() -> None:
    tree = ast.parse(Path(GA_MODULE.__file__).read_text())
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
    from r3capture.kernels._alloc_checks import check_alloc_static_args

    def on_meta(shape, dtype=torch.int64):
        return torch.zeros(shape, dtype=dtype, device="meta")  # a device other than the CPU

    args = dict(
        capture=on_meta((8, 2, 2), torch.int32),
        ring=on_meta((5, 4)),
        records=on_meta((5, 2)),
        queue=on_meta(8, torch.int32),
        heads=on_meta(4),
        dest=on_meta((4, 4, 2, 2), torch.uint8),
        hash_block=None,
        num_slots=None,
    )
    empty = torch.zeros((0, 4), dtype=torch.int32)
    assert check_alloc_static_args(**args, step_info=empty).max_requests == 0
    with pytest.raises(KernelArgumentError, match="step_info must be on the capture's"):
        check_alloc_static_args(**args, step_info=torch.zeros((2, 4), dtype=torch.int32))
