"""gather_alloc: the kernel takes each request's new slots from the queue itself.

Three implementations agree on drawn launch sequences: the Triton kernel (interpreter), its
torch reference (state for state: ring, records, heads, dest, step_info), and a plain model
in this file that keeps each request's blocks in a dict and hands out queue entries in batch
order (what the ring and the tagged records must amount to). Sequences cover fresh requests
taking indices their earlier owners left state in, rejected suffixes, prefix-hit starts,
prefill chunks, a queue that wraps, dry stock, every block size and both layouts.
"""

from __future__ import annotations

import random

import pytest
import torch
from gather_alloc_cases import Scenario, programs_in_order

from r3capture.kernels import Status
from r3capture.kernels.alloc_reference import gather_alloc_reference
from r3capture.kernels.gather_alloc import gather_alloc

SENTINEL = {torch.uint8: 0xA5, torch.uint16: 0xA5A5}


def _state(sc: Scenario, model_shape: tuple[int, int], dtype, rows_layout: bool, T: int):
    L, K = model_shape
    gen = torch.Generator().manual_seed(sc.rng.randrange(1 << 30))
    capture = torch.randint(0, 250, (T, L, K), generator=gen, dtype=torch.int32)
    capture[capture == 0xA5] = 1  # never the sentinel
    if rows_layout:
        dest = torch.full((T, L, K), SENTINEL[dtype], dtype=dtype)
    else:
        dest = torch.full((sc.num_slots, sc.block, L, K), SENTINEL[dtype], dtype=dtype)
    return dict(
        capture=capture,
        ring=torch.full((sc.num_indices, sc.ring_width), -1, dtype=torch.int64),
        records=torch.zeros((sc.num_indices, 2), dtype=torch.int64),
        queue=torch.full((sc.queue_size,), -1, dtype=torch.int32),
        heads=torch.zeros(4, dtype=torch.int64),
        dest=dest,
        step_info=torch.full((16, 4), -99, dtype=torch.int32),
    )


def _draw_step(sc: Scenario, max_rows: int, with_rejected: bool):
    """One launch's requests in a drawn batch order: ``(req_id, start, rows, rejected)``."""
    ids = list(sc.live)
    sc.rng.shuffle(ids)
    step, total = [], 0
    for req_id in ids[: sc.rng.randint(1, 6)]:
        request = sc.live[req_id]
        rows = sc.rng.choice([1, 1, 2, 3, sc.rng.randint(1, 3 * sc.block + 2)])
        rows = min(rows, max_rows - total)
        if rows <= 0:
            break
        rejected = sc.rng.randint(0, rows - 1) if with_rejected and sc.rng.random() < 0.4 else 0
        step.append((req_id, request.cursor, rows, rejected))
        total += rows
    return step


def _launch_args(sc: Scenario, step, T: int, with_fresh: bool):
    qsl, positions = [0], torch.zeros(T, dtype=torch.int64)
    for _, start, rows, _ in step:
        positions[qsl[-1] : qsl[-1] + rows] = torch.arange(start, start + rows)
        qsl.append(qsl[-1] + rows)
    fresh = [not sc.live[req_id].launched for req_id, *_ in step]
    return dict(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        positions=positions,
        request_index=torch.tensor([sc.live[r].index for r, *_ in step], dtype=torch.int64),
        num_rejected=torch.tensor([rej for *_, rej in step], dtype=torch.int32),
        fresh=torch.tensor(fresh) if with_fresh and any(fresh) else None,
        num_rows=qsl[-1],
    )


def _model_launch(sc: Scenario, step, args: dict, capture: torch.Tensor, dest_before):
    """What the launch must do, by the plain model: per request, its blocks without a slot
    take queue entries in batch order while the stock lasts; returns (expected step_info
    rows, expected dest) and moves the model on."""
    B = sc.block
    dest = dest_before.clone()
    info, offset = [], 0
    rows_layout = dest.dim() == 3
    qsl = args["query_start_loc"].tolist()
    for i, (req_id, start, rows, rejected) in enumerate(step):
        request = sc.live[req_id]
        accepted = rows - rejected
        blocks = range(start // B, (start + accepted - 1) // B + 1) if accepted > 0 else []
        new = [b for b in blocks if b not in request.blocks]
        if offset + len(new) > sc.stock:
            info.append((start, -1, int(Status.NO_STOCK), 0))
            offset += len(new)
            continue
        for k, block in enumerate(new):
            request.blocks[block] = sc.queue_model[sc.head + offset + k]
        offset += len(new)
        info.append((start, accepted, int(Status.OK), len(new)))
        for j in range(accepted):
            position, row = start + j, capture[qsl[i] + j]
            if rows_layout:
                dest[qsl[i] + j] = row.to(dest.dtype)
            else:
                dest[request.blocks[position // B], position % B] = row.to(dest.dtype)
        request.cursor = start + accepted
        request.launched = True
    sc.head += sum(taken for *_, taken in info)
    return info, dest


@pytest.mark.parametrize("block", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16], ids=["u8", "u16"])
@pytest.mark.parametrize("rows_layout", [False, True], ids=["slots", "rows"])
@pytest.mark.parametrize("seed", range(3))
def test_launch_sequences_match_the_reference_and_the_model(block, dtype, rows_layout, seed):
    T = 48
    sc = Scenario(
        block=block,
        num_indices=6,
        ring_width=T // block + 2,
        queue_size=3 * (T // block + 8),
        num_slots=3 * (T // block + 8) + 6 * (T // block + 4),
        rng=random.Random(seed * 1000 + block),
    )
    kernel = _state(sc, (3, 2), dtype, rows_layout, T)
    reference = {k: v.clone() for k, v in kernel.items()}
    sc.refill(kernel["queue"], sc.queue_size)
    reference["queue"].copy_(kernel["queue"])
    statuses = set()
    for _ in range(14):
        while len(sc.live) < 3:
            sc.admit()
        step = _draw_step(sc, T, with_rejected=True)
        # Keep the stock short now and then, so NO_STOCK comes up.
        if sc.rng.random() < 0.7:
            sc.refill(kernel["queue"], sc.rng.randint(0, 6))
            reference["queue"].copy_(kernel["queue"])
        sc.launch += 1
        args = _launch_args(sc, step, T, with_fresh=True)
        scalars = dict(launch=sc.launch, queue_tail=len(sc.queue_model))
        if rows_layout:
            scalars.update(hash_block=block, num_slots=sc.num_slots)
        expected_info, expected_dest = _model_launch(
            sc, step, args, kernel["capture"], kernel["dest"]
        )
        gather_alloc(**kernel, **args, **scalars, impl="triton")
        gather_alloc_reference(**reference, **args, **scalars)
        for name in kernel:
            assert torch.equal(kernel[name], reference[name]), (sc.launch, name)
        got = [tuple(r) for r in kernel["step_info"][: len(step)].tolist()]
        assert got == expected_info, sc.launch
        assert torch.equal(kernel["dest"], expected_dest), sc.launch
        assert int(kernel["heads"][(sc.launch + 1) % 2]) == sc.head
        statuses |= {status for _, _, status, _ in got}
        for req_id, *_ in step:  # a stock-starved request is dropped, like a failed step
            if not sc.live[req_id].launched or sc.rng.random() < 0.25:
                sc.finish(req_id)
        for req_id, *_ in step:
            if req_id in sc.live and expected_info[[s[0] for s in step].index(req_id)][2]:
                sc.finish(req_id)
    assert Status.OK in statuses


def test_a_fresh_request_ignores_what_its_index_held_before():
    """Index 2 held blocks 0-1 of another request; the new owner, fresh, starts at block 0
    again and takes new slots; without the flag it would have reused the old ones."""
    sc = Scenario(4, 4, 8, 16, 16, random.Random(0))
    state = _state(sc, (1, 1), torch.uint8, False, 16)
    sc.refill(state["queue"], 16)
    tail = len(sc.queue_model)
    index = torch.tensor([2])
    qsl = torch.tensor([0, 8], dtype=torch.int32)
    positions = torch.arange(16)
    gather_alloc(**state, query_start_loc=qsl, positions=positions, request_index=index,
                 launch=1, queue_tail=tail, num_rows=8, impl="triton")  # fmt: skip
    assert state["step_info"][0].tolist() == [0, 8, 0, 2]
    old_slots = sc.queue_model[:2]
    gather_alloc(**state, query_start_loc=qsl, positions=positions, request_index=index,
                 fresh=torch.tensor([True]), launch=2, queue_tail=tail, num_rows=8,
                 impl="triton")  # fmt: skip
    assert state["step_info"][0].tolist() == [0, 8, 0, 2]
    entries = state["ring"][2, :2].tolist()
    assert [e & 0xFFFFFFFF for e in entries] == sc.queue_model[2:4] != old_slots
    gather_alloc(**state, query_start_loc=qsl, positions=positions, request_index=index,
                 launch=3, queue_tail=tail, num_rows=8, impl="triton")  # fmt: skip
    assert state["step_info"][0].tolist() == [0, 8, 0, 0]  # its own blocks now


def test_dry_stock_fails_the_first_request_it_cannot_cover_and_every_later_one_needing_any():
    sc = Scenario(4, 4, 8, 16, 16, random.Random(1))
    state = _state(sc, (1, 1), torch.uint8, False, 24)
    sc.refill(state["queue"], 3)
    # Requests need 2, 2, 0 (no accepted rows) and 1 new blocks; the stock holds 3.
    qsl = torch.tensor([0, 8, 16, 17, 18], dtype=torch.int32)
    positions = torch.cat([torch.arange(8), torch.arange(8), torch.tensor([0, 0]), torch.zeros(6)])
    positions = positions.long()
    dest_before = state["dest"].clone()
    gather_alloc(
        **state, query_start_loc=qsl, positions=positions,
        request_index=torch.tensor([0, 1, 2, 3]), num_rejected=torch.tensor([0, 0, 1, 0]),
        launch=1, queue_tail=3, num_rows=18, impl="triton",
    )  # fmt: skip
    info = state["step_info"][:4].tolist()
    assert [row[2] for row in info] == [Status.OK, Status.NO_STOCK, Status.OK, Status.NO_STOCK]
    assert [row[3] for row in info] == [2, 0, 0, 0]
    assert int(state["heads"][0]) == 2
    assert state["records"][1].tolist() == [0, 0] and state["records"][3].tolist() == [0, 0]
    assert torch.equal(state["dest"][sc.queue_model[2]], dest_before[sc.queue_model[2]])


@pytest.mark.parametrize(
    "case, status",
    [("start-below-the-ring", Status.BAD_BLOCK), ("index-out-of-range", Status.BAD_INDEX),
     ("overwritten-entry", Status.BAD_BLOCK), ("queue-entry-past-the-arena", Status.BAD_BLOCK)],
)  # fmt: skip
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_requests_that_cannot_be_placed_fail_closed(case, status, impl):
    """Each case breaks request 1 only; request 0 is written, request 1 writes nothing."""
    B, D = 4, 8
    sc = Scenario(B, 4, D, 32, 32, random.Random(2))
    state = _state(sc, (1, 1), torch.uint8, False, 48)
    sc.refill(state["queue"], 32)
    kwargs = dict(impl="triton") if impl == "triton" else {}
    call = gather_alloc if impl == "triton" else gather_alloc_reference
    # Launches 1-2: index 1 captures blocks 0-11 (the ring keeps blocks 4-11).
    for launch, first_row in ((1, 0), (2, 24)):
        call(**state, query_start_loc=torch.tensor([0, 24], dtype=torch.int32),
             positions=torch.arange(first_row, first_row + 48), request_index=torch.tensor([1]),
             launch=launch, queue_tail=32, num_rows=24, **kwargs)  # fmt: skip
    assert state["step_info"][0].tolist() == [24, 24, Status.OK, 6]
    start, index = 48, 1
    if case == "start-below-the-ring":
        start = 12  # block 3: below hi - D + 1 = 4
    elif case == "index-out-of-range":
        index = 4
    elif case == "overwritten-entry":
        start = 44  # block 11, whose entry now names another block
        state["ring"][1, 11 % D] = (9 << 32) | 3
    else:
        state["queue"][13] = 10_000  # request 0 takes entry 12, request 1 entry 13
    positions = torch.cat([torch.tensor([0]), torch.arange(start, start + 3), torch.zeros(44)])
    before = {k: v.clone() for k, v in state.items()}
    call(**state, query_start_loc=torch.tensor([0, 1, 4], dtype=torch.int32),
         positions=positions.long(), request_index=torch.tensor([0, index]), launch=3,
         queue_tail=32, num_rows=4, **kwargs)  # fmt: skip
    info = state["step_info"][:2].tolist()
    assert info[0][1:3] == [1, Status.OK]
    assert info[1][1:3] == [-1, status]
    assert torch.equal(state["records"][1], before["records"][1])
    assert torch.equal(state["ring"][1], before["ring"][1])
    written = (state["dest"] != before["dest"]).sum().item()
    assert written == 1  # request 0's one row


@pytest.mark.parametrize("order", ["reversed", "shuffled"])
def test_program_order_does_not_change_a_launch(order):
    """Programs read each request's record while the request's own tile overwrites one: the
    tags make every order give the same state (the interpreter runs programs in turn; on a
    GPU they interleave, and each record is one int64 store)."""
    rng = random.Random(5)
    orders = {}

    def permutation(n):
        if n not in orders:
            perm = list(range(n))[::-1]
            if order == "shuffled":
                rng.shuffle(perm)
            orders[n] = perm
        return orders[n]

    results = []
    for shuffled in (False, True):
        sc = Scenario(4, 8, 16, 64, 96, random.Random(9))
        state = _state(sc, (2, 2), torch.uint8, False, 64)
        sc.refill(state["queue"], 64)
        with programs_in_order(permutation if shuffled else None):
            for _ in range(8):
                while len(sc.live) < 6:
                    sc.admit()
                step = _draw_step(sc, 64, with_rejected=True)
                sc.launch += 1
                args = _launch_args(sc, step, 64, with_fresh=True)
                _model_launch(sc, step, args, state["capture"], state["dest"])
                gather_alloc(**state, **args, launch=sc.launch, queue_tail=len(sc.queue_model),
                             impl="triton")  # fmt: skip
        results.append(state)
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]), name


def _valid_call():
    sc = Scenario(4, 4, 8, 16, 16, random.Random(3))
    state = _state(sc, (1, 1), torch.uint8, False, 16)
    return dict(
        **state, query_start_loc=torch.tensor([0, 2], dtype=torch.int32),
        positions=torch.arange(16), request_index=torch.tensor([1]), launch=1, queue_tail=0,
    )  # fmt: skip


BAD_CALLS = {
    "ring-int32": ("ring", lambda a: a["ring"].int(), "ring must be of dtype int64"),
    "ring-col-strided": ("ring", lambda a: a["ring"].t().contiguous().t(), "ring must be"),
    # The kernel reads a request's records at index * 2.
    "records-strided-rows": (
        "records",
        lambda a: torch.zeros(4, 4, dtype=torch.int64)[:, :2],
        "records must be \\[N, 2\\].*dense rows",
    ),
    "records-3-cols": (
        "records",
        lambda a: torch.zeros(4, 3, dtype=torch.int64),
        "records must be \\[N, 2\\]",
    ),
    "queue-2d": ("queue", lambda a: a["queue"][None], "queue must be 1-D"),
    "queue-strided": ("queue", lambda a: a["queue"].repeat_interleave(2)[::2], "queue must be"),
    "heads-2": ("heads", lambda a: torch.zeros(2, dtype=torch.int64), "heads must be \\[4\\]"),
    "info-3-cols": ("step_info", lambda a: a["step_info"][:, :3], "step_info must be \\[R, 4\\]"),
    "index-strided": (
        "request_index",
        lambda a: torch.tensor([1, 1, 1, 1])[::2],
        "request_index must be contig",
    ),
    "index-float": ("request_index", lambda a: torch.tensor([1.0]), "request_index must be of"),
    # [n, 1]: dense, with a unit stride, but not 1-D.
    "positions-column": ("positions", lambda a: a["positions"][:, None], "positions must be 1-D"),
    "rejected-strided": (
        "num_rejected",
        lambda a: torch.zeros(4, dtype=torch.int32)[::2],
        "num_rejected must be contig",
    ),
    "fresh-float": ("fresh", lambda a: torch.tensor([1.0]), "fresh must be of dtype"),
    "launch-zero": ("launch", lambda a: 0, "launch must be an int in \\[1,"),
    "tail-negative": ("queue_tail", lambda a: -1, "queue_tail must be an int >= 0"),
    "records-aliasing-ring": (
        "records",
        lambda a: a["ring"].view(-1)[: 2 * a["ring"].shape[0]].view(-1, 2),
        "ring must be memory apart from records",
    ),
}


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("bad", list(BAD_CALLS))
def test_malformed_calls_are_refused_by_name_before_any_write(bad, impl):
    name, make, message = BAD_CALLS[bad]
    args = _valid_call()
    args[name] = make(args)
    outputs = {k: args[k].clone() for k in ("ring", "records", "heads", "dest", "step_info")}
    call = gather_alloc if impl == "triton" else gather_alloc_reference
    extra = dict(impl="triton") if impl == "triton" else {}
    with pytest.raises(ValueError, match=message):
        call(**args, **extra)
    for key, before in outputs.items():
        if args[key].shape == before.shape:
            assert torch.equal(args[key], before), key


class _TaggedTensor(torch.Tensor):
    """A tensor subclass, as a framework wrapper might hand over."""


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_valid_arguments_of_other_types_take_the_checks_one_by_one_and_launch(impl):
    """The step check's one expression wants exact types; a tensor subclass, an int subclass
    or fresh flags go through every check in turn and launch like the usual call. A
    one-element index of stride 2 is dense, and launches too."""
    usual, unusual = _valid_call(), _valid_call()
    for args in (usual, unusual):
        args["queue"][:4] = torch.tensor([3, 1, 2, 0])
        args["queue_tail"] = 4
    unusual["positions"] = unusual["positions"].as_subclass(_TaggedTensor)
    unusual["num_reqs"] = type("Count", (int,), {})(1)
    unusual["fresh"] = torch.tensor([False])
    # One element of stride 2: dense to torch, so valid.
    unusual["request_index"] = torch.tensor([1, 7])[::2]
    assert unusual["request_index"].is_contiguous() and unusual["request_index"].stride() == (2,)
    extra = dict(impl="triton") if impl == "triton" else {}
    call = gather_alloc if impl == "triton" else gather_alloc_reference
    call(**usual, **extra)
    call(**unusual, **extra)
    for name in ("ring", "records", "heads", "dest", "step_info"):
        assert torch.equal(usual[name], unusual[name]), name
    assert usual["step_info"][0].tolist() == [0, 2, Status.OK, 1]


# Forms of a step's 1-D index tensor of n entries: MRV2's (the first two) and others.
_INDEX_FORMS = {
    "int32": lambda n: torch.arange(n, dtype=torch.int32),
    "int64": lambda n: torch.arange(n, dtype=torch.int64),
    "float": lambda n: torch.arange(n, dtype=torch.float32),
    "column": lambda n: torch.arange(n)[:, None],
    "strided": lambda n: torch.arange(2 * n)[::2],
    "scalar": lambda n: torch.tensor(n),
    "short": lambda n: torch.arange(n - 1),
    "meta": lambda n: torch.arange(n, device="meta"),
    "subclass": lambda n: torch.arange(n).as_subclass(_TaggedTensor),
    "list": lambda n: list(range(n)),
}
_STEP_TENSORS = {"query_start_loc": 3, "positions": 4, "request_index": 2, "num_rejected": 2}


def test_the_quick_device_test_passes_only_the_launch_device():
    """``step_tensors_pass`` reads no ``Tensor.device``: its test by ``device_index`` passes
    CPU tensors for a CPU launch only, never for a CUDA device's index or another device's
    (None), and refuses a meta tensor or a rejected-count tensor elsewhere for a CPU
    launch. (The CUDA side runs in test_gather_alloc_gpu.py.)"""
    from r3capture.kernels._alloc_checks import CPU_INDEX, _device_index, step_tensors_pass

    step = [torch.arange(n) for n in _STEP_TENSORS.values()]
    assert _device_index(torch.device("cpu")) == CPU_INDEX
    assert _device_index(torch.device("cuda", 1)) == 1
    assert _device_index(torch.device("meta")) is None
    assert step_tensors_pass(CPU_INDEX, *step, num_reqs=2, num_rows=4)
    for index in (0, 1, None):
        assert not step_tensors_pass(index, *step, num_reqs=2, num_rows=4)
    for at in range(4):
        moved = list(step)
        moved[at] = moved[at].to("meta")
        assert not step_tensors_pass(CPU_INDEX, *moved, num_reqs=2, num_rows=4)
    assert step_tensors_pass(CPU_INDEX, *step[:3], None, num_reqs=2, num_rows=4)


@pytest.mark.parametrize("form", list(_INDEX_FORMS))
@pytest.mark.parametrize("argument", list(_STEP_TENSORS))
def test_the_one_expression_accepts_only_what_the_full_check_accepts(argument, form):
    """``step_tensors_pass``, the launch's one-expression check, never passes a step tensor
    that the full check refuses, and passes Model Runner V2's forms (int32/int64, dense,
    1-D, long enough, on the device): 2 requests, 4 rows."""
    from r3capture.kernels._alloc_checks import (
        check_alloc_static_args,
        check_alloc_step_args,
        step_tensors_pass,
    )

    state = _valid_call()
    static = check_alloc_static_args(
        **{k: state[k] for k in ("capture", "ring", "records", "queue", "heads", "dest")},
        step_info=state["step_info"], hash_block=None, num_slots=None,
    )  # fmt: skip
    step = {name: torch.arange(n) for name, n in _STEP_TENSORS.items()}
    step[argument] = _INDEX_FORMS[form](_STEP_TENSORS[argument])
    fast = step_tensors_pass(static.device_index, *step.values(), num_reqs=2, num_rows=4)
    try:
        check_alloc_step_args(
            static, **step, fresh=None, num_reqs=2, num_rows=4, launch=1, queue_tail=0
        )
        accepted = True
    except ValueError:
        accepted = False
    assert accepted or not fast
    assert fast == (form in ("int32", "int64"))
