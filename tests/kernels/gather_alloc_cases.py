"""Launch scenarios for the capture kernel (``gather_alloc``), shared by the CPU (interpreter)
and GPU tests.

A case describes one engine step as requests (scheduled rows, first token position,
rejected rows, the blocks the request already holds, whether its index is new to it);
``build`` turns it into the kernel's tensors the way the worker's state would stand before
the launch (each held block in the request's ring row with a distinct slot, its record
tagged by an earlier launch, free slots in the queue from a head that may wrap), poisons
every output with a sentinel, and computes every expected output and state update with
``plain_launch``: per-request, per-row Python loops, independent of both the kernel and the
torch reference.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from bench.models import ModelShape as Model
from r3capture.kernels import GatherAllocLaunch, Status
from r3capture.kernels._alloc_checks import (
    BLOCK_LIMIT,
    HEAD_SERIAL,
    RECORD_HI_BITS,
    RECORD_SHARED,
)

DEST_SENTINEL = {torch.uint8: 0xA5, torch.uint16: 0xA5A5}
INFO_SENTINEL = -99
LAUNCH = 6  # the serial of every case's launch; earlier launches left the state
# What a new step changes: every input and every piece of state the kernel reads. A graph
# replays a launch only through these tensors (and the outputs), so each must be rewritten
# in place.
STEP_INPUTS = ("capture", "query_start_loc", "positions", "request_index", "num_rejected",
               "ring", "records", "queue", "heads")  # fmt: skip
STATE = ("ring", "records", "heads", "dest", "step_info")  # what a launch may write
_HI_MASK = (1 << RECORD_HI_BITS) - 1
_SLOT_MASK = (1 << 32) - 1


TINY = Model("L1K1", 1, 1, 8)
QWEN3_30B = Model("qwen3-48x8", 48, 8, 128)
KIMI_K2 = Model("kimi-61x8", 61, 8, 384)
GPT_OSS = Model("gptoss-36x4", 36, 4, 128)
# Rows wider than the models above, so that a kernel tile holds fewer rows and requests
# (``_launch._tile_config``): two per tile, and one.
WIDE_2K = Model("wide-40x32", 40, 32, 512)
WIDE_8K = Model("wide-65x64", 65, 64, 512)


@dataclass(frozen=True)
class Req:
    rows: int  # scheduled rows this step
    start: int  # token position of the first row
    rejected: int = 0  # speculative rows rejected at the end
    # The last block the request holds a slot for; None: every block before its start
    # (what earlier launches left), -1: none.
    held: int | None = None
    fresh: bool = False  # new to its index, whose former owner left a ring row and records


@dataclass
class Case:
    id: str
    model: Model
    block: int  # hash block size B
    reqs: list[Req]
    with_rejected: bool = True
    rows_layout: bool = False  # dest is [rows, L, K] staging instead of [S, B, L, K] slots
    index_dtype: torch.dtype = torch.int32  # query_start_loc, num_rejected
    request_index_dtype: torch.dtype = torch.int64  # MRV2's idx_mapping
    capture_dtype: torch.dtype = torch.int32
    full_range_values: bool = False  # int32 values far outside [0, E): exercises the wrap
    ring_width: int | None = None  # D; None = the widest step + 2
    extra_indices: int = 2  # request indices no request uses
    stock: int | None = None  # free slots in the queue; None = what the step needs + 2
    queue_size: int | None = None  # Q; None = stock + 3
    head: int = 5  # entries taken before this launch (the queue wraps past Q)
    spare_slots: int = 3  # slots nothing names: must stay poisoned
    arena_slots: int | None = None  # S; None = the slots the state names + spare_slots
    pad_reqs: int = 0  # extra (CUDA-graph padding) entries past num_reqs in every input
    num_rows: int | None = None  # num_rows bound; None = capture rows
    extra_capture_rows: int = 5
    mutate: Callable[[dict], None] | None = None  # edits the built inputs (error cases)
    status: list[int] = field(default_factory=list)  # expected statuses; [] = all OK

    def __post_init__(self) -> None:
        if not self.status:
            self.status = [0] * len(self.reqs)


@dataclass
class Request:
    """A request of a launch sequence, as its host sees it."""

    index: int
    cursor: int  # next position to capture
    blocks: dict[int, int] = field(default_factory=dict)  # block -> slot
    launched: bool = False
    rows: dict[int, int] = field(default_factory=dict)  # position -> value of placed rows


@dataclass
class Scenario:
    """The host's side of a launch sequence: MRV2's request indices (last freed, first
    taken), the free slots, the queue (``queue_model``: every entry ever put), the live
    requests."""

    block: int
    num_indices: int
    ring_width: int
    queue_size: int
    num_slots: int
    rng: random.Random
    free_indices: list[int] = field(default_factory=list)
    free_slots: list[int] = field(default_factory=list)
    live: dict[str, Request] = field(default_factory=dict)
    queue_model: list[int] = field(default_factory=list)  # every entry ever put
    head: int = 0
    launch: int = 0
    next_id: int = 0

    def __post_init__(self) -> None:
        self.free_indices = list(range(self.num_indices))
        self.free_slots = list(range(self.num_slots))
        self.rng.shuffle(self.free_slots)

    def refill(self, queue: torch.Tensor, count: int) -> None:
        count = min(count, len(self.free_slots), self.queue_size - self.stock)
        for _ in range(count):
            slot = self.free_slots.pop()
            queue[len(self.queue_model) % self.queue_size] = slot
            self.queue_model.append(slot)

    @property
    def stock(self) -> int:
        return len(self.queue_model) - self.head

    def admit(self, index: int | None = None) -> str | None:
        """A new request on the next free index, or (a faulty engine) on ``index``."""
        if index is None and not self.free_indices:
            return None
        start = self.rng.choice([0, 0, self.block * self.rng.randrange(0, 6), 7])
        req_id = f"r{self.next_id}"
        self.live[req_id] = Request(self.free_indices.pop() if index is None else index, start)
        self.next_id += 1
        return req_id

    def finish(self, req_id: str, *, frees_index: bool = True) -> None:
        request = self.live.pop(req_id)
        if frees_index:
            self.free_indices.append(request.index)  # MRV2: last freed, first taken
        self.free_slots.extend(request.blocks.values())


def _held(req: Req, block: int) -> int:
    if req.held is not None:
        return req.held
    return (req.start - 1) // block if req.start > 0 else -1


def build(case: Case, seed: int = 0, device: str | torch.device = "cpu") -> dict:
    """The case's keyword arguments for ``gather_alloc`` (``args``) and what the launch must
    leave (``expected``: ``dest``, ``step_info``, ``ring``, ``records``, ``heads``)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    model, block = case.model, case.block
    num_reqs = len(case.reqs)
    qsl = [0]
    for req in case.reqs:
        qsl.append(qsl[-1] + req.rows)
    cap_rows = max(qsl[-1] + case.extra_capture_rows, case.num_rows or 0)

    shape = (cap_rows, model.num_layers, model.top_k)
    if case.full_range_values:
        capture = torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=torch.int64)
    else:
        capture = torch.randint(0, model.num_experts, shape, generator=gen, dtype=torch.int64)
    sentinel = DEST_SENTINEL[model.dtype]
    # Never let a real value equal the sentinel: a missing write must always show.
    hits_sentinel = (capture & (0xFF if model.dtype == torch.uint8 else 0xFFFF)) == sentinel
    capture = torch.where(hits_sentinel, capture + 1, capture).to(torch.int32)
    capture = capture.to(case.capture_dtype)

    # Padding rows carry garbage positions: nothing may read them.
    positions = torch.full((cap_rows,), -7, dtype=torch.int64)
    spans = []  # per request: (first block, last block) of its scheduled rows
    for r, req in enumerate(case.reqs):
        positions[qsl[r] : qsl[r + 1]] = torch.arange(req.start, req.start + req.rows)
        first = max(req.start, 0) // block
        spans.append((first, (max(req.start, 0) + max(req.rows, 1) - 1) // block))
    width = case.ring_width or max((hi - lo + 1 for lo, hi in spans), default=0) + 2
    num_indices = num_reqs + case.extra_indices
    indices = rng.sample(range(num_indices), num_indices)

    # Held blocks (the ring keeps the last ``width``), a former owner's blocks for a fresh
    # request, and the blocks the step needs from the queue: each its own slot.
    his = [-1 if req.fresh else _held(req, block) for req in case.reqs]
    # The last block each index's ring row and records hold: a fresh request's former
    # owner's, past the request's own blocks.
    tops = [last + 3 if req.fresh else hi for req, (_, last), hi in zip(case.reqs, spans, his)]
    named = sum(min(top + 1, width) for top in tops)
    needed = sum(max(0, last - max(first, hi + 1) + 1) for (first, last), hi in zip(spans, his))
    stock = case.stock if case.stock is not None else needed + 2
    queue_size = case.queue_size or stock + 3
    num_slots = case.arena_slots
    if num_slots is None:
        num_slots = named + stock + case.spare_slots
    assert num_slots >= named + stock, f"{case.id}: {named + stock} slots named, {num_slots}"
    order = list(range(num_slots))
    rng.shuffle(order)
    ring = torch.full((num_indices, width), -1, dtype=torch.int64)
    records = torch.zeros((num_indices, 2), dtype=torch.int64)
    taken = 0
    for index, top in zip(indices, tops):
        for b in range(max(0, top - width + 1), top + 1):
            ring[index, b % width] = (b << 32) | order[taken]
            taken += 1
        # The record of the launch that last grew it, and an older one in the other half.
        newer, older = (LAUNCH - 2) << RECORD_HI_BITS, (LAUNCH - 4) << RECORD_HI_BITS
        which = rng.randrange(2)
        records[index, which] = newer | (top + 1)
        records[index, 1 - which] = older | max(0, top - 1)
    queue = torch.full((queue_size,), -1, dtype=torch.int32)
    for k in range(stock):
        queue[(case.head + k) % queue_size] = order[taken]
        taken += 1
    heads = torch.tensor([-1, -1, LAUNCH - 1, 0], dtype=torch.int64)
    heads[LAUNCH % 2] = case.head

    pad = case.pad_reqs
    inputs = {
        "capture": capture,
        "query_start_loc": torch.tensor(qsl + [qsl[-1]] * pad, dtype=case.index_dtype),
        "positions": positions,
        "request_index": torch.tensor(
            indices[:num_reqs] + [0] * pad, dtype=case.request_index_dtype
        ),
        "num_rejected": torch.tensor(
            [q.rejected for q in case.reqs] + [0] * pad, dtype=case.index_dtype
        ),
        "fresh": torch.tensor([q.fresh for q in case.reqs] + [False] * pad, dtype=torch.uint8),
        "ring": ring,
        "records": records,
        "queue": queue,
        "heads": heads,
    }
    if case.mutate is not None:
        case.mutate(inputs)
    if not case.with_rejected:
        inputs["num_rejected"] = None
    if not any(q.fresh for q in case.reqs):
        inputs["fresh"] = None

    if case.rows_layout:
        dest_shape = (cap_rows, model.num_layers, model.top_k)
    else:
        dest_shape = (num_slots, block, model.num_layers, model.top_k)
    dest = torch.full(dest_shape, sentinel, dtype=torch.int32).to(model.dtype)
    step_info = torch.full((num_reqs + pad, 4), INFO_SENTINEL, dtype=torch.int32)
    args = dict(
        inputs, dest=dest, step_info=step_info, num_reqs=num_reqs, num_rows=case.num_rows,
        launch=LAUNCH, queue_tail=case.head + stock,
    )  # fmt: skip
    if case.rows_layout:
        args.update(hash_block=block, num_slots=num_slots)
    expected = plain_launch(clone_args(args), block, num_slots)
    return {"args": {k: _to(v, device) for k, v in args.items()}, "expected": expected}


def plain_launch(args: dict, block: int, num_slots: int) -> dict[str, torch.Tensor]:
    """What one launch leaves in ``args`` (CPU tensors, changed in place and returned by
    name), by per-request and per-row loops over the kernel's contract."""
    B = block
    capture, dest, info = args["capture"], args["dest"], args["step_info"]
    ring, records, queue, heads = args["ring"], args["records"], args["queue"], args["heads"]
    qsl = args["query_start_loc"].tolist()
    positions = args["positions"].tolist()
    num_reqs = args["num_reqs"] if args["num_reqs"] is not None else len(qsl) - 1
    row_limit = args["num_rows"] if args["num_rows"] is not None else capture.shape[0]
    rejected = args["num_rejected"].tolist() if args["num_rejected"] is not None else None
    fresh = args["fresh"].tolist() if args["fresh"] is not None else None
    index = args["request_index"].tolist()
    launch, width, size = args["launch"], ring.shape[1], queue.shape[0]
    head = int(heads[launch % 2])
    available = args["queue_tail"] - head
    rows_layout = dest.dim() == 3
    out = {name: args[name] for name in STATE}
    if num_reqs == 0:
        return out
    if int(heads[HEAD_SERIAL]) != launch - 1:
        info[:num_reqs] = torch.tensor([-1, -1, int(Status.BAD_LAUNCH), 0], dtype=torch.int32)
        return out
    sane = qsl[0] >= 0 and all(b >= a for a, b in zip(qsl[:num_reqs], qsl[1 : num_reqs + 1]))

    in_range = [i for i in index[:num_reqs] if 0 <= i < ring.shape[0]]
    plans = []
    for r in range(num_reqs):
        begin, end = qsl[r], qsl[r + 1]
        n = end - begin
        rej = rejected[r] if rejected is not None else 0
        accepted = n - rej
        bad_rows = not sane or end > row_limit
        start = positions[begin] if not bad_rows and n > 0 else -1
        bad_rejected = not bad_rows and (rej < 0 or rej > n)
        idx = index[r]
        idx_ok = 0 <= idx < ring.shape[0]
        bad_index = not bad_rows and not bad_rejected and not idx_ok
        is_fresh = bool(fresh[r]) if fresh is not None else False
        hi, use = -1, None
        if idx_ok:  # a fresh request only picks the record it overwrites
            tags = [int(records[idx, h]) >> RECORD_HI_BITS for h in (0, 1)]
            valid = [tag < launch for tag in tags]
            if valid[0] and (not valid[1] or tags[0] >= tags[1]):
                use = 0
            elif valid[1]:
                use = 1
            if use is not None and not is_fresh:
                hi = (int(records[idx, use]) & _HI_MASK) - 1
        shared_before = hi == RECORD_SHARED - 1
        shared = idx_ok and in_range.count(idx) > 1
        needs = not (bad_rows or bad_rejected or bad_index or shared_before) and accepted > 0
        first = max(start, 0) // B
        last = (max(start, 0) + accepted - 1) // B
        bad_range = needs and (
            start < 0 or last - first >= width or last >= BLOCK_LIMIT
            or (first <= hi and first < hi - width + 1)
        )  # fmt: skip
        new_first = max(first, hi + 1)
        new = max(last - new_first + 1, 0) if needs and not bad_range else 0
        plans.append(dict(
            begin=begin, start=start, accepted=accepted, idx=idx, idx_ok=idx_ok, fresh=is_fresh,
            hi=hi, overwrite=1 if use == 0 else 0, needs=needs, first=first, last=last,
            new_first=new_first, new=new, bad_rows=bad_rows, bad_rejected=bad_rejected,
            bad_index=bad_index, shared=shared, shared_before=shared_before,
            bad_range=bad_range,
        ))  # fmt: skip

    off = 0
    taken = 0
    for p in plans:
        p["off"] = off
        off += p["new"]
        p["no_stock"] = p["new"] > 0 and off > available
        if not p["no_stock"]:
            taken += p["new"]
        slots = {}
        bad_slot = False
        if p["needs"] and not p["bad_range"] and not p["no_stock"]:
            for b in range(p["first"], p["last"] + 1):
                if b < p["new_first"]:
                    entry = int(ring[p["idx"], b % width])
                    slot = entry & _SLOT_MASK
                    bad_slot |= (entry >> 32) != b
                else:
                    slot = int(queue[(head + p["off"] + b - p["new_first"]) % size])
                bad_slot |= not 0 <= slot < num_slots
                slots[b] = slot
        p["slots"] = slots
        if p["bad_rows"]:
            status = Status.BAD_ROWS
        elif p["bad_rejected"]:
            status = Status.BAD_REJECTED
        elif p["bad_index"]:
            status = Status.BAD_INDEX
        elif p["shared"] or p["shared_before"]:
            status = Status.SHARED_INDEX
        elif p["bad_range"]:
            status = Status.BAD_BLOCK
        elif p["no_stock"]:
            status = Status.NO_STOCK
        elif bad_slot:
            status = Status.BAD_BLOCK
        else:
            status = Status.OK
        p["status"] = int(status)

    for r, p in enumerate(plans):
        ok = p["status"] == Status.OK
        info[r] = torch.tensor([p["start"], p["accepted"] if ok else -1, p["status"],
                                0 if p["no_stock"] else p["new"]], dtype=torch.int32)  # fmt: skip
        if ok:
            for i in range(p["accepted"]):
                pos = p["start"] + i
                value = capture[p["begin"] + i].to(dest.dtype)
                if rows_layout:
                    dest[p["begin"] + i] = value
                else:
                    dest[p["slots"][pos // B], pos % B] = value
            for b in range(p["new_first"], p["new_first"] + p["new"]):
                ring[p["idx"], b % width] = (b << 32) | p["slots"][b]
        grown = ok and p["new"] > 0
        if p["idx_ok"] and (grown or p["fresh"] or p["shared"]):
            top = RECORD_SHARED - 1 if p["shared"] else p["last"] if grown else p["hi"]
            records[p["idx"], p["overwrite"]] = (launch << RECORD_HI_BITS) | (top + 1)
    heads[(launch + 1) % 2] = head + taken
    heads[HEAD_SERIAL] = launch
    return out


def statuses(expected: dict, num_reqs: int) -> list[int]:
    return expected["step_info"][:num_reqs, 2].tolist()


def assert_same_bytes(what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Byte-for-byte equality (expert ids have no tolerance), naming the first differences."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    # A contiguous copy: ``contiguous()`` keeps the odd strides of size-1 dims.
    dense = torch.contiguous_format
    a = actual.cpu().clone(memory_format=dense).view(torch.uint8).flatten()
    e = expected.cpu().clone(memory_format=dense).view(torch.uint8).flatten()
    diff = (a != e).nonzero().flatten()
    assert diff.numel() == 0, (
        f"{what}: {diff.numel()} of {a.numel()} bytes differ, first at byte offsets "
        f"{diff[:8].tolist()}: got {a[diff[:8]].tolist()}, expected {e[diff[:8]].tolist()}"
    )


def assert_state(what: str, args: dict, expected: dict) -> None:
    """Every tensor a launch may write equals ``expected``'s, byte for byte."""
    for name in STATE:
        assert_same_bytes(f"{what} {name}", args[name], expected[name])


def _to(value, device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def clone_args(args: dict) -> dict:
    """A copy of every tensor argument; pinned host tensors stay pinned (``clone`` alone
    returns pageable memory, which a CUDA kernel cannot be given)."""
    return {k: _clone(v) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def _clone(t: torch.Tensor) -> torch.Tensor:
    return t.clone().pin_memory() if t.device.type == "cpu" and t.is_pinned() else t.clone()


def _decode(n: int, rng: random.Random, block: int) -> list[Req]:
    # Starts at a block's first and last row (a new block, a held one), and anywhere.
    picks = [0, block - 1, block, 3 * block - 1]
    return [Req(1, picks[i] if i < len(picks) else rng.randrange(0, 4000)) for i in range(n)]


def _spec(n: int, k: int, rng: random.Random) -> list[Req]:
    return [Req(k + 1, rng.randrange(0, 2000), i % (k + 1)) for i in range(n)]


def step_kinds(block: int) -> dict[str, list[Req]]:
    rng = random.Random(block)
    return {
        "decode-1req": [Req(1, 37)],
        "decode-64req": _decode(64, rng, block),
        # Chunks that start mid-block and span several blocks, one block-aligned chunk, and
        # a new request's first chunk.
        "prefill-chunked": [
            Req(150, 45),
            Req(2 * block, 0),
            Req(block + 3, 3 * block + 5),
            Req(20, 0, fresh=True),
        ],  # fmt: skip
        "spec-k3": _spec(24, 3, rng),
        "mixed": [
            Req(1, 100),
            Req(61, 7),
            *_spec(5, 3, rng),
            Req(1, 5, fresh=True),
            Req(40, 64, 2),
        ],  # fmt: skip
        "prefill-480": [Req(480, 3 * block + 7)],
    }


def standard_cases(models=(TINY, QWEN3_30B, KIMI_K2), blocks=(16, 32)) -> list[Case]:
    cases = []
    for model in models:
        for block in blocks:
            for kind, reqs in step_kinds(block).items():
                cases.append(Case(f"{model.name}-B{block}-{kind}", model, block, reqs))
    return cases


def special_cases() -> list[Case]:
    """Empty steps, CUDA-graph padding, optional inputs, dtypes, layouts, ring wrap."""
    many = [Req(1 + (i % 3), 17 * i, 1 if i % 3 == 2 else 0) for i in range(64)]
    return [
        Case("empty-R0", QWEN3_30B, 16, []),
        Case("empty-zero-rows", QWEN3_30B, 16, [Req(0, 5), Req(0, 0), Req(0, 33)]),
        Case("all-rejected", QWEN3_30B, 16, [Req(4, 10, 4), Req(2, 31, 2)]),
        Case("no-num-rejected", QWEN3_30B, 16, [Req(3, 14), Req(20, 0)], with_rejected=False),
        Case("graph-padded", QWEN3_30B, 16, [Req(2, 9), Req(1, 40)], pad_reqs=5, num_rows=64),
        Case("graph-padded-R0", QWEN3_30B, 16, [], pad_reqs=4, num_rows=32),
        # Requests that already hold every block they write, and one that holds more.
        Case("nothing-new", QWEN3_30B, 16, [Req(3, 17, held=1), Req(5, 40, held=4)]),
        Case("int64-index", KIMI_K2, 16, [Req(33, 20, 1), Req(1, 3)], index_dtype=torch.int64),
        Case("int32-request-index", KIMI_K2, 16, [Req(33, 20, 1), Req(1, 3)],
             request_index_dtype=torch.int32),
        Case("wrap-int32-u8", QWEN3_30B, 16, [Req(40, 9)], full_range_values=True),
        Case("wrap-int32-u16", KIMI_K2, 32, [Req(40, 9)], full_range_values=True),
        Case("u8-capture", GPT_OSS, 16, [Req(30, 2, 1)], capture_dtype=torch.uint8),
        Case("u16-capture-u8-dest", GPT_OSS, 16, [Req(30, 2, 1)], capture_dtype=torch.uint16),
        Case("u8-capture-u16-dest", KIMI_K2, 16, [Req(30, 2, 1)], capture_dtype=torch.uint8),
        # A ring exactly as wide as the step's widest request, whose blocks wrap around it.
        Case("ring-tight-wrap", QWEN3_30B, 16, [Req(70, 1000), Req(3, 37)], ring_width=5),
        # The queue wraps inside the step's entries.
        Case("queue-wraps", QWEN3_30B, 16, [Req(40, 9), Req(33, 0, fresh=True)], head=11,
             queue_size=12),
        Case("64req-varied", TINY, 16, many),
        # More ring columns than one check tile covers (the slot checks loop).
        Case("tiny-B1-600cols", TINY, 1, [Req(600, 5, 2), Req(7, 1)]),
        Case("B12-not-pow2", QWEN3_30B, 12, [Req(50, 7, 1), Req(1, 11), Req(13, 36)]),
        Case("rows-layout-mixed", QWEN3_30B, 16, [Req(40, 7, 2), Req(1, 3), Req(4, 20, 1)],
             rows_layout=True),
        Case("rows-layout-kimi", KIMI_K2, 16, [Req(17, 30), Req(5, 2, 4)], rows_layout=True),
        Case("rows-layout-padded", QWEN3_30B, 16, [Req(2, 9), Req(1, 40)], rows_layout=True,
             pad_reqs=3, num_rows=40),
        # Staging rows with one row per hash block: the smallest hash_block a call may name.
        Case("rows-layout-B1", TINY, 1, [Req(3, 5, 1), Req(2, 0)], rows_layout=True),
        # More requests than rows: request tiles, not row tiles, must size the grid.
        Case("more-requests-than-rows", QWEN3_30B, 16,
             [Req(0, 5 * i) for i in range(19)] + [Req(1, 3)], num_rows=1),
        # Tiles of two rows, and of one row and one request.
        Case("tile-of-2-rows", WIDE_2K, 16, [Req(5, 14, 1), Req(1, 40), Req(3, 7), Req(0, 2)]),
        Case("tile-of-1-row", WIDE_8K, 16, [Req(3, 14, 1), Req(1, 40), Req(2, 31)]),
    ]  # fmt: skip


def graph_script(rows_layout: bool = False) -> list[tuple[Case, int]]:
    """``(case, seed)`` of the launch a CUDA graph captures, then of each launch it replays:
    the same request count, row bound, serial, queue tail, ring, queue and arena shapes, and
    everything else different (rows per request, starts, rejections, hence query_start_loc,
    positions, request indices, the state the ring, records, queue and heads hold, and the
    capture rows)."""
    steps = [
        [Req(1, 17), Req(40, 45), Req(4, 99, 2)],
        [Req(30, 3), Req(1, 250), Req(4, 31, 3)],
        # A request with no rows, and blocks that wrap around the ring (columns 7..11 % 8).
        [Req(0, 5), Req(50, 16 * 7 + 15, 1), Req(2, 1000)],
    ]
    cases = [
        Case(f"graph-step{i}", QWEN3_30B, 16, reqs, rows_layout=rows_layout, ring_width=8,
             stock=12 - 4 * i, queue_size=16, head=3 + 4 * i, arena_slots=48, pad_reqs=2,
             num_rows=64, extra_indices=3)
        for i, reqs in enumerate(steps)
    ]  # fmt: skip
    # The captured launch comes back last with new contents (another seed).
    return [(cases[0], 1), (cases[1], 2), (cases[2], 3), (cases[0], 4)]


def load_step(static: dict, fresh: dict) -> set[str]:
    """Write a launch's arguments into the tensors a graph captured (``static``): same
    shapes, same host-side values (those are baked into the graph), new contents. Returns
    the names of the tensors whose contents changed."""
    assert static.keys() == fresh.keys()
    changed = set()
    for name, value in fresh.items():
        if isinstance(value, torch.Tensor):
            assert static[name].shape == value.shape and static[name].dtype == value.dtype, name
            if not torch.equal(static[name], value.to(static[name].device)):
                changed.add(name)
            static[name].copy_(value)
        else:
            assert static[name] == value, f"{name}: captured {static[name]}, step has {value}"
    return changed


def prepared_launch(args: dict, impl: str = "auto") -> Callable[[], None]:
    """The worker's path for ``gather_alloc`` keyword arguments: a ``GatherAllocLaunch`` over
    the static ones, and a call that checks and passes the per-step ones (read from ``args``
    now, so tensors replaced in ``args`` later are not seen)."""
    launch = GatherAllocLaunch(
        args["capture"], args["ring"], args["records"], args["queue"], args["heads"],
        args["dest"], args["step_info"], hash_block=args.get("hash_block"),
        num_slots=args.get("num_slots"), impl=impl,
    )  # fmt: skip
    step = [args[name] for name in ("query_start_loc", "positions", "request_index",
                                    "num_rejected", "fresh")]  # fmt: skip
    scalars = {name: args[name] for name in ("launch", "queue_tail", "num_reqs", "num_rows")}
    return lambda: launch(*step, **scalars)


@contextlib.contextmanager
def programs_in_order(order: Callable[[int], list[int]] | None) -> Iterator[None]:
    """Run the interpreter's programs of every launch in ``order(grid_size)``'s order (None:
    its own)."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    original = builder.set_grid_idx
    if order is not None:
        builder.set_grid_idx = lambda x, y, z: original(order(builder.grid_dim[0])[x], y, z)
    try:
        yield
    finally:
        builder.set_grid_idx = original


def set_input(name: str, index, value) -> Callable[[dict], None]:
    def mutate(inputs: dict) -> None:
        inputs[name][index] = value

    return mutate


def _set_ring(r: int, block: int, entry: int) -> Callable[[dict], None]:
    """Overwrite the ring entry of request r's ``block`` with ``entry``."""

    def mutate(inputs: dict) -> None:
        ring = inputs["ring"]
        ring[int(inputs["request_index"][r]), block % ring.shape[1]] = entry

    return mutate


def _queue_entry(k: int, value: int) -> Callable[[dict], None]:
    """Set the k-th queue entry this launch hands out (from its head)."""

    def mutate(inputs: dict) -> None:
        head = int(inputs["heads"][LAUNCH % 2])
        queue = inputs["queue"]
        queue[(head + k) % queue.shape[0]] = value

    return mutate


def error_cases() -> list[Case]:
    """Per-request failures: the failing request writes nothing, the others are unaffected."""
    three = [Req(20, 5), Req(4, 40, 1), Req(35, 70)]
    return [
        Case("rejected-negative", QWEN3_30B, 16, three, mutate=set_input("num_rejected", 1, -1),
             status=[0, 1, 0]),
        Case("rejected-over-rows", QWEN3_30B, 16, three, mutate=set_input("num_rejected", 2, 36),
             status=[0, 0, 1]),
        # A negative count "accepts" a row past the request's own: the rejected-count
        # status wins over any block status.
        Case("rejected-negative-over-bad-block", QWEN3_30B, 16, [Req(4, 12, -1), Req(3, 40)],
             mutate=_set_ring(0, 0, -1), status=[1, 0]),
        Case("index-past-ring", QWEN3_30B, 16, three,
             mutate=set_input("request_index", 1, 10**6), status=[0, 4, 0]),
        Case("index-negative", QWEN3_30B, 16, three, mutate=set_input("request_index", 2, -1),
             status=[0, 0, 4]),
        # Read as a Python index, -1 would name the last ring row, whose state fits.
        Case("index-negative-aliases-a-live-row", QWEN3_30B, 16, [Req(3, 40), Req(3, 40)],
             extra_indices=0, mutate=_alias_index_from_the_end(1, 0), status=[0, 4]),
        # A start below what the ring keeps (blocks hi - D + 1 .. hi).
        Case("start-below-the-ring", QWEN3_30B, 16, [Req(3, 160), Req(2, 40)], ring_width=4,
             mutate=set_input("positions", 0, 16), status=[2, 0]),
        # A step wider than the ring.
        Case("rows-wider-than-ring", QWEN3_30B, 16, [Req(3, 16), Req(90, 40)], ring_width=5,
             status=[0, 2]),
        # An old block whose ring entry names another block, or no slot, or one past the
        # arena; the bad entry holds only the request's last accepted row.
        Case("ring-entry-of-another-block", QWEN3_30B, 16, three,
             mutate=_set_ring(2, 4, (12 << 32) | 0), status=[0, 0, 2]),
        Case("ring-entry-empty", QWEN3_30B, 16, [Req(17, 32, held=3), Req(2, 40)],
             mutate=_set_ring(0, 3, -1), status=[2, 0]),
        Case("ring-slot-past-arena", QWEN3_30B, 16, [Req(3, 17), Req(2, 40)],
             mutate=_set_ring(0, 1, (1 << 32) | 10**6), status=[2, 0]),
        # A new block's queue entry outside the arena; the next request's entry is fine.
        Case("queue-entry-past-arena", QWEN3_30B, 16, [Req(3, 16), Req(2, 32)],
             mutate=_queue_entry(0, 10**6), status=[2, 0]),
        Case("queue-entry-negative", QWEN3_30B, 16, [Req(3, 16), Req(2, 32)],
             mutate=_queue_entry(1, -1), status=[0, 2]),
        # Dry stock: the first request the queue cannot cover fails, and every later one
        # that needs a block; one that needs none still writes.
        Case("no-stock", QWEN3_30B, 16, [Req(17, 16), Req(40, 32), Req(1, 17), Req(1, 64)],
             stock=3, status=[0, 5, 0, 5]),
        Case("start-negative", QWEN3_30B, 16, three, mutate=set_input("positions", 20, -3),
             status=[0, 2, 0]),
        Case("rejected-rows-in-no-block", QWEN3_30B, 16, [Req(4, 14, 3)], stock=0),
        Case("rejected-all-bad-start", QWEN3_30B, 16, [Req(2, 0, 2), Req(3, 4)],
             mutate=set_input("positions", 0, -50)),
        Case("rows-past-bound", QWEN3_30B, 16, three, num_rows=30, status=[0, 0, 3]),
        Case("rows-one-past-bound", QWEN3_30B, 16, three, num_rows=58, status=[0, 0, 3]),
        Case("rows-at-bound", QWEN3_30B, 16, three, num_rows=59),
        # Bad entries early and late in a 600-block range: the checks loop in tiles.
        Case("late-column-bad", TINY, 1, [Req(600, 5, held=604), Req(7, 1)], ring_width=700,
             mutate=_set_ring(0, 585, -1), status=[2, 0]),
        Case("early-column-bad", TINY, 1, [Req(600, 5, held=604), Req(7, 1)], ring_width=700,
             mutate=_set_ring(0, 25, -1), status=[2, 0]),
        # Qwen3's rows tile by 8: each tile rechecks the slots of every request it holds,
        # from that request's first row in the tile, wherever it lies.
        Case("bad-slot-request-starts-mid-tile", QWEN3_30B, 16, [Req(3, 0), Req(30, 10)],
             mutate=_set_ring(1, 0, -1), status=[0, 2]),
        Case("bad-slot-request-ends-alone-in-tile", QWEN3_30B, 16, [Req(9, 8), Req(5, 0)],
             mutate=_set_ring(0, 0, -1), status=[2, 0]),
        Case("bad-slot-in-one-row-tiles", WIDE_8K, 16, [Req(2, 3), Req(3, 20), Req(1, 9)],
             mutate=_set_ring(1, 1, -1), status=[0, 2, 0]),
        Case("mixed-failures", KIMI_K2, 32, [Req(1, 9), Req(4, 60, 5), Req(50, 40), Req(2, 1)],
             mutate=_set_ring(2, 1, -1), status=[0, 1, 2, 0]),
        # A query_start_loc that decreases anywhere or starts below 0 fails the whole step.
        Case("qsl-decreasing", QWEN3_30B, 16, [Req(8, 0), Req(4, 20)],
             mutate=set_input("query_start_loc", 2, 4), status=[3, 3]),
        Case("qsl-dip-mid", QWEN3_30B, 16, [Req(5, 0), Req(3, 20), Req(5, 40)],
             mutate=set_input("query_start_loc", 2, 3), status=[3, 3, 3]),
        Case("qsl-negative-start", QWEN3_30B, 16, [Req(3, 0), Req(3, 20)],
             mutate=set_input("query_start_loc", 0, -2), status=[3, 3]),
        Case("qsl-decreasing-rows-layout", QWEN3_30B, 16, [Req(8, 0), Req(4, 20)],
             rows_layout=True, mutate=set_input("query_start_loc", 2, 4), status=[3, 3]),
    ]  # fmt: skip


def _alias_index_from_the_end(r: int, other: int) -> Callable[[dict], None]:
    """Give request r the negative index that, counted from the end of the ring as a Python
    index, is request ``other``'s row."""

    def mutate(inputs: dict) -> None:
        num_indices = inputs["ring"].shape[0]
        inputs["request_index"][r] = int(inputs["request_index"][other]) - num_indices

    return mutate
