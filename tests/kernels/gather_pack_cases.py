"""Step scenarios for the gather-pack kernel, shared by the CPU (interpreter) and GPU tests.

A case describes one engine step as requests (scheduled rows, first token position, rejected
rows); ``build`` turns it into the kernel's tensors the way the host would (one distinct slot
per hash block a request's scheduled rows touch), poisons every output with a sentinel, and
computes the expected outputs with plain per-row Python loops, independently of both the
kernel and the torch reference.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from r3capture.kernels import GatherPackLaunch

DEST_SENTINEL = {torch.uint8: 0xA5, torch.uint16: 0xA5A5}
INFO_SENTINEL = -99
# What a new step changes: every input the kernel reads. A graph replays a step only through
# these tensors (and the outputs), so each must be rewritten in place.
STEP_INPUTS = ("capture", "query_start_loc", "positions", "table_row", "slot_table",
               "block_window", "num_rejected")  # fmt: skip


@dataclass(frozen=True)
class Model:
    name: str
    num_layers: int
    top_k: int
    num_experts: int

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8 if self.num_experts <= 256 else torch.uint16


TINY = Model("L1K1", 1, 1, 8)
QWEN3_30B = Model("qwen3-48x8", 48, 8, 128)
KIMI_K2 = Model("kimi-61x8", 61, 8, 384)
GPT_OSS = Model("gptoss-36x4", 36, 4, 128)
# Rows wider than the models above, so that a kernel tile holds fewer rows and requests
# (``_tile_config``): two per tile, and one.
WIDE_2K = Model("wide-40x32", 40, 32, 512)
WIDE_8K = Model("wide-65x64", 65, 64, 512)


@dataclass(frozen=True)
class Req:
    rows: int  # scheduled rows this step
    start: int  # token position of the first row
    rejected: int = 0  # speculative rows rejected at the end


@dataclass
class Case:
    id: str
    model: Model
    block: int  # hash block size B
    reqs: list[Req]
    with_rejected: bool = True
    rows_layout: bool = False  # dest is [rows, L, K] staging instead of [S, B, L, K] slots
    index_dtype: torch.dtype = torch.int32
    capture_dtype: torch.dtype = torch.int32
    full_range_values: bool = False  # int32 values far outside [0, E): exercises the wrap
    window_back: int = 0  # the window starts this many blocks before the first needed block
    window_ahead: int = 1  # mapped blocks past the last needed one
    ring_width: int | None = None  # W; None = the widest window + 1
    extra_table_rows: int = 2  # table rows no request uses
    spare_slots: int = 3  # slots no request maps: must stay poisoned
    arena_slots: int | None = None  # S; None = the slots the windows map + spare_slots
    pad_reqs: int = 0  # extra (CUDA-graph padding) entries past num_reqs in every input
    num_rows: int | None = None  # num_rows bound; None = capture rows
    extra_capture_rows: int = 5
    mutate: Callable[[dict], None] | None = None  # edits the built inputs (error cases)
    status: list[int] = field(default_factory=list)  # expected statuses; [] = all OK

    def __post_init__(self) -> None:
        if not self.status:
            self.status = [0] * len(self.reqs)


def build(case: Case, seed: int = 0, device: str | torch.device = "cpu") -> dict:
    """The case's inputs (``args``: gather_pack keyword arguments) and expected outputs.

    Built the way the worker does it: each request owns one row of a ring slot table and a
    window of hash blocks ``lo ..= hi`` (its row of ``block_window``) covering its scheduled
    rows, every block of the window mapped to a distinct slot; ``positions`` holds each row's
    token position.
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    model, block = case.model, case.block
    num_reqs = len(case.reqs)
    qsl = [0]
    for req in case.reqs:
        qsl.append(qsl[-1] + req.rows)
    num_step_rows = qsl[-1]
    cap_rows = max(num_step_rows + case.extra_capture_rows, case.num_rows or 0)

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
    windows = []
    for r, req in enumerate(case.reqs):
        positions[qsl[r] : qsl[r + 1]] = torch.arange(req.start, req.start + req.rows)
        first = max(req.start, 0) // block
        last = (max(req.start, 0) + max(req.rows, 1) - 1) // block
        windows.append((first - case.window_back, last + case.window_ahead))
    width = case.ring_width or max((hi - lo + 1 for lo, hi in windows), default=0) + 1
    num_table_rows = num_reqs + case.extra_table_rows
    table_rows = list(range(num_table_rows))
    rng.shuffle(table_rows)
    mapped = sum(min(hi - lo + 1, width) for lo, hi in windows)
    num_slots = case.arena_slots if case.arena_slots is not None else mapped + case.spare_slots
    assert num_slots >= mapped, f"{case.id}: {mapped} mapped blocks, {num_slots} slots"
    order = list(range(num_slots))
    rng.shuffle(order)
    table = torch.full((num_table_rows, width), -1, dtype=torch.int64)
    # Rows no request uses keep the empty window [0, -1].
    block_window = torch.tensor([[0, -1]] * num_table_rows, dtype=torch.int64)
    taken = 0
    for r, (lo, hi) in enumerate(windows):
        block_window[table_rows[r]] = torch.tensor([lo, hi])
        for b in range(max(lo, hi - width + 1), hi + 1):
            table[table_rows[r], b % width] = order[taken]
            taken += 1

    pad = case.pad_reqs
    inputs = {
        "capture": capture,
        "query_start_loc": torch.tensor(qsl + [qsl[-1]] * pad, dtype=torch.int64),
        "positions": positions,
        "table_row": torch.tensor(table_rows[:num_reqs] + [0] * pad, dtype=torch.int64),
        "slot_table": table,
        "block_window": block_window,
        "num_rejected": torch.tensor(
            [q.rejected for q in case.reqs] + [0] * pad, dtype=torch.int64
        ),
    }
    for name in ("query_start_loc", "table_row", "slot_table", "block_window",
                 "num_rejected"):  # fmt: skip
        inputs[name] = inputs[name].to(case.index_dtype)
    if case.mutate is not None:
        case.mutate(inputs)
    if not case.with_rejected:
        inputs["num_rejected"] = None

    if case.rows_layout:
        dest_shape = (cap_rows, model.num_layers, model.top_k)
    else:
        dest_shape = (num_slots, block, model.num_layers, model.top_k)
    dest = torch.full(dest_shape, sentinel, dtype=torch.int32).to(model.dtype)
    step_info = torch.full((num_reqs + pad, 3), INFO_SENTINEL, dtype=torch.int32)

    expected_dest = dest.clone()
    expected_info = step_info.clone()
    table = inputs["slot_table"].to(torch.int64)
    rows_of = inputs["table_row"].to(torch.int64)
    qsl_now = inputs["query_start_loc"].to(torch.int64).tolist()
    positions = inputs["positions"].to(torch.int64)
    for r, req in enumerate(case.reqs):
        status = case.status[r]
        accepted = req.rows - req.rejected if case.with_rejected else req.rows
        begin = qsl_now[r]
        start = int(positions[begin]) if status != 3 and qsl_now[r + 1] > begin else -1
        expected_info[r] = torch.tensor(
            [start, accepted if status == 0 else -1, status], dtype=torch.int32
        )
        if status != 0:
            continue
        for i in range(accepted):
            pos = start + i
            value = capture[begin + i].to(model.dtype)
            if case.rows_layout:
                expected_dest[begin + i] = value
            else:
                slot = int(table[int(rows_of[r]), (pos // block) % width])
                expected_dest[slot, pos % block] = value

    args = dict(inputs, dest=dest, step_info=step_info, num_reqs=num_reqs, num_rows=case.num_rows)
    if case.rows_layout:
        args.update(hash_block=block, num_slots=num_slots)
    return {
        "args": {k: _to(v, device) for k, v in args.items()},
        "expected_dest": expected_dest,
        "expected_info": expected_info,
    }


def assert_same_bytes(what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Byte-for-byte equality (expert ids have no tolerance), naming the first differences."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    a = actual.cpu().contiguous().view(torch.uint8).flatten()
    e = expected.cpu().contiguous().view(torch.uint8).flatten()
    diff = (a != e).nonzero().flatten()
    assert diff.numel() == 0, (
        f"{what}: {diff.numel()} of {a.numel()} bytes differ, first at byte offsets "
        f"{diff[:8].tolist()}: got {a[diff[:8]].tolist()}, expected {e[diff[:8]].tolist()}"
    )


def _to(value, device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def clone_args(args: dict) -> dict:
    """A copy of every tensor argument; pinned host tensors stay pinned (``clone`` alone
    returns pageable memory, which a CUDA kernel cannot be given as ``dest``)."""
    return {k: _clone(v) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def _clone(t: torch.Tensor) -> torch.Tensor:
    return t.clone().pin_memory() if t.device.type == "cpu" and t.is_pinned() else t.clone()


def _decode(n: int, rng: random.Random, block: int) -> list[Req]:
    # Starts at a block's first and last row, and anywhere, over long contexts.
    picks = [0, block - 1, block, 3 * block - 1]
    return [Req(1, picks[i] if i < len(picks) else rng.randrange(0, 4000)) for i in range(n)]


def _spec(n: int, k: int, rng: random.Random) -> list[Req]:
    reqs = [Req(k + 1, rng.randrange(0, 2000), i % (k + 1)) for i in range(n)]
    return reqs


def step_kinds(block: int) -> dict[str, list[Req]]:
    rng = random.Random(block)
    return {
        "decode-1req": [Req(1, 37)],
        "decode-64req": _decode(64, rng, block),
        # Chunks that start mid-block and span several blocks, and one block-aligned chunk.
        "prefill-chunked": [Req(150, 45), Req(2 * block, 0), Req(block + 3, 3 * block + 5)],
        "spec-k3": _spec(24, 3, rng),
        "mixed": [Req(1, 100), Req(61, 7), *_spec(5, 3, rng), Req(1, 5), Req(40, 64, 2)],
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
        # Windows that end at the block of the last accepted row (no block mapped ahead),
        # with rows ending exactly on a block boundary, from position 0 and from mid-block.
        Case("window-ends-at-last-block", QWEN3_30B, 16, [Req(16, 0), Req(8, 24)],
             window_ahead=0),
        Case("int64-index", KIMI_K2, 16, [Req(33, 20, 1), Req(1, 3)], index_dtype=torch.int64),
        Case("wrap-int32-u8", QWEN3_30B, 16, [Req(40, 9)], full_range_values=True),
        Case("wrap-int32-u16", KIMI_K2, 32, [Req(40, 9)], full_range_values=True),
        Case("u8-capture", GPT_OSS, 16, [Req(30, 2, 1)], capture_dtype=torch.uint8),
        Case("u16-capture-u8-dest", GPT_OSS, 16, [Req(30, 2, 1)], capture_dtype=torch.uint16),
        Case("u8-capture-u16-dest", KIMI_K2, 16, [Req(30, 2, 1)], capture_dtype=torch.uint8),
        Case("window-starts-early", QWEN3_30B, 16, [Req(30, 50)], window_back=2),
        # A ring exactly as wide as the window, whose blocks wrap around it.
        Case("ring-tight-wrap", QWEN3_30B, 16, [Req(70, 1000), Req(3, 37)], window_ahead=0,
             ring_width=6),
        Case("64req-varied", TINY, 16, many),
        # More table columns than one scan tile covers (row and request scans loop).
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
    """``(case, seed)`` of the step a CUDA graph captures, then of each step it replays: the
    same request count, row bound, ring and arena shapes, and everything else different (rows
    per request, starts, rejections, hence query_start_loc, positions, table rows, windows,
    ring contents and capture rows)."""
    steps = [
        [Req(1, 17), Req(40, 45), Req(4, 99, 2)],
        [Req(30, 3), Req(1, 250), Req(4, 31, 3)],
        # A request with no rows, and a window that wraps around the ring (columns 7..11 % 8).
        [Req(0, 5), Req(50, 16 * 7 + 15, 1), Req(2, 1000)],
    ]
    cases = [
        Case(f"graph-step{i}", QWEN3_30B, 16, reqs, rows_layout=rows_layout, ring_width=8,
             arena_slots=40, pad_reqs=2, num_rows=64)
        for i, reqs in enumerate(steps)
    ]  # fmt: skip
    # The captured step comes back last with new contents (another seed).
    return [(cases[0], 1), (cases[1], 2), (cases[2], 3), (cases[0], 4)]


def load_step(static: dict, fresh: dict) -> set[str]:
    """Write a step's arguments into the tensors a graph captured (``static``): same shapes,
    same host-side values (those are baked into the graph), new contents. Returns the names
    of the tensors whose contents changed."""
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
    """The worker's path for ``gather_pack`` keyword arguments: a ``GatherPackLaunch`` over
    the static ones, and a call that passes the per-step ones (read from ``args`` now, so
    tensors replaced in ``args`` later are not seen)."""
    launch = GatherPackLaunch(
        args["capture"], args["table_row"], args["slot_table"], args["block_window"],
        args["dest"], args["step_info"], hash_block=args.get("hash_block"),
        num_slots=args.get("num_slots"), impl=impl,
    )  # fmt: skip
    qsl, positions, rejected = args["query_start_loc"], args["positions"], args["num_rejected"]
    num_reqs, num_rows = args["num_reqs"], args["num_rows"]
    return lambda: launch(qsl, positions, rejected, num_reqs=num_reqs, num_rows=num_rows)


def set_input(name: str, index, value) -> Callable[[dict], None]:
    def mutate(inputs: dict) -> None:
        inputs[name][index] = value

    return mutate


def move_window(r: int, end: int, delta: int) -> Callable[[dict], None]:
    """Move the low (``end=0``) or high (``end=1``) end of request r's block window."""

    def mutate(inputs: dict) -> None:
        inputs["block_window"][int(inputs["table_row"][r]), end] += delta

    return mutate


def _widen_window_to_ring(r: int) -> Callable[[dict], None]:
    """Make request r's block window span ``ring_width + 1`` blocks (hi - lo == width)."""

    def mutate(inputs: dict) -> None:
        row = int(inputs["table_row"][r])
        window = inputs["block_window"]
        window[row, 1] = window[row, 0] + inputs["slot_table"].shape[1]

    return mutate


def error_cases() -> list[Case]:
    """Per-request failures: the failing request writes nothing, the others are unaffected."""
    three = [Req(20, 5), Req(4, 40, 1), Req(35, 70)]
    return [
        Case("rejected-negative", QWEN3_30B, 16, three, mutate=set_input("num_rejected", 1, -1),
             status=[0, 1, 0]),
        Case("rejected-over-rows", QWEN3_30B, 16, three, mutate=set_input("num_rejected", 2, 36),
             status=[0, 0, 1]),
        # A negative count "accepts" a row past the request's own, into a block whose slot
        # is bad: the rejected-count status still wins over the block status.
        Case("rejected-negative-over-bad-block", QWEN3_30B, 16, [Req(4, 12, -1), Req(3, 40)],
             mutate=_unmap_block(0, 1), status=[1, 0]),
        Case("block-below-window", QWEN3_30B, 16, three, mutate=move_window(0, 0, 1),
             status=[2, 0, 0]),
        Case("block-above-window", KIMI_K2, 16, three, window_ahead=0,
             mutate=move_window(2, 1, -1), status=[0, 0, 2]),
        Case("window-wider-than-ring", QWEN3_30B, 16, three,
             mutate=move_window(1, 1, 100), status=[0, 2, 0]),
        # The boundaries: a window of ring_width + 1 blocks would alias a column; slot
        # num_slots is one past the arena (``three`` maps 9 blocks).
        Case("window-one-past-ring", QWEN3_30B, 16, three, mutate=_widen_window_to_ring(1),
             status=[0, 2, 0]),
        Case("slot-at-arena-end", QWEN3_30B, 16, three, arena_slots=9,
             mutate=_set_block(0, 0, 9), status=[2, 0, 0]),
        Case("table-row-past-table", QWEN3_30B, 16, three,
             mutate=set_input("table_row", 1, 10**6), status=[0, 2, 0]),
        Case("table-row-negative", QWEN3_30B, 16, three,
             mutate=set_input("table_row", 2, -1), status=[0, 0, 2]),
        # Read as a Python index, the negative row would name request 0's own row, whose
        # window and slots fit request 1's rows exactly.
        Case("table-row-negative-aliases-a-live-row", QWEN3_30B, 16, [Req(3, 40), Req(3, 40)],
             mutate=_alias_row_from_the_end(1, 0), status=[0, 2]),
        Case("slot-minus-1-mid", QWEN3_30B, 16, three, mutate=_unmap_block(2, 1),
             status=[0, 0, 2]),
        Case("slot-past-arena", QWEN3_30B, 16, three, mutate=_set_block(0, 0, 10**6),
             status=[2, 0, 0]),
        Case("start-negative", QWEN3_30B, 16, three, mutate=set_input("positions", 20, -3),
             status=[0, 2, 0]),
        # A negative start fails even where the clamped range lies inside the window.
        Case("start-negative-in-window", QWEN3_30B, 16, [Req(3, 0), Req(2, 40)],
             mutate=set_input("positions", 0, -3), status=[2, 0]),
        # ... and where the negative positions' ring column (a one-column ring) is live.
        Case("start-negative-ring-of-one", QWEN3_30B, 16, [Req(3, 0), Req(2, 40)],
             window_ahead=0, ring_width=1, mutate=set_input("positions", 0, -3),
             status=[2, 0]),
        # The bad block holds only the request's last accepted row.
        Case("bad-block-holds-only-last-row", QWEN3_30B, 16, [Req(17, 0), Req(2, 40)],
             mutate=_unmap_block(0, 1), status=[2, 0]),
        # Only the last accepted row lies past the window, and its ring column still holds
        # a live slot: the window check alone must catch it.
        Case("last-row-alone-past-window", QWEN3_30B, 16, [Req(17, 0), Req(2, 40)],
             window_ahead=0, mutate=move_window(0, 1, -1), status=[2, 0]),
        # One-row blocks: a request at position 0 whose window starts at block 1, while the
        # ring column of block 0 still holds a live slot.
        Case("block-below-window-B1-at-0", TINY, 1, [Req(3, 0), Req(2, 9)],
             mutate=move_window(0, 0, 1), status=[2, 0]),
        # Only blocks of accepted rows matter: an unmapped block holding rejected rows is fine.
        Case("rejected-rows-unmapped", QWEN3_30B, 16, [Req(4, 14, 3)], window_ahead=0,
             mutate=_unmap_block(0, 1)),
        Case("rejected-all-bad-start", QWEN3_30B, 16, [Req(2, 0, 2), Req(3, 4)],
             mutate=set_input("positions", 0, -50)),
        Case("rows-past-bound", QWEN3_30B, 16, three, num_rows=30, status=[0, 0, 3]),
        Case("rows-one-past-bound", QWEN3_30B, 16, three, num_rows=58, status=[0, 0, 3]),
        Case("rows-at-bound", QWEN3_30B, 16, three, num_rows=59),
        Case("late-column-unmapped", TINY, 1, [Req(600, 5), Req(7, 1)],
             mutate=_unmap_block(0, 580), status=[2, 0]),
        # 600 columns scan in two loads of 512: a bad slot in the first must not be
        # forgotten by the second.
        Case("early-column-unmapped", TINY, 1, [Req(600, 5), Req(7, 1)],
             mutate=_unmap_block(0, 20), status=[2, 0]),
        # Qwen3's rows tile by 8: each tile rescans the slot range of every request it holds,
        # from that request's first row in the tile, wherever it lies (mid-tile, the tile's
        # last row, or a request's last row alone at a tile's start). Each failing block
        # lies in another tile than the rows that must stay unwritten.
        Case("bad-slot-request-starts-mid-tile", QWEN3_30B, 16, [Req(3, 0), Req(30, 10)],
             mutate=_unmap_block(1, 2), status=[0, 2]),
        Case("bad-slot-request-starts-at-tile-end", QWEN3_30B, 16, [Req(7, 0), Req(30, 10)],
             mutate=_unmap_block(1, 2), status=[0, 2]),
        Case("bad-slot-request-ends-alone-in-tile", QWEN3_30B, 16, [Req(9, 8), Req(5, 0)],
             mutate=_unmap_block(0, 0), status=[2, 0]),
        # A failing request in one-row tiles, between requests that write.
        Case("bad-slot-in-one-row-tiles", WIDE_8K, 16, [Req(2, 3), Req(3, 14), Req(1, 9)],
             mutate=_unmap_block(1, 1), status=[0, 2, 0]),
        Case("mixed-failures", KIMI_K2, 32, [Req(1, 9), Req(4, 60, 5), Req(50, 3), Req(2, 1)],
             mutate=_unmap_block(2, 0), status=[0, 1, 2, 0]),
        # A query_start_loc that decreases anywhere or starts below 0 fails the whole step.
        Case("qsl-decreasing", QWEN3_30B, 16, [Req(8, 0), Req(4, 20)],
             mutate=set_input("query_start_loc", 2, 4), status=[3, 3]),
        Case("qsl-dip-mid", QWEN3_30B, 16, [Req(5, 0), Req(3, 20), Req(5, 40)],
             mutate=set_input("query_start_loc", 2, 3), status=[3, 3, 3]),
        Case("qsl-dip-by-one", QWEN3_30B, 16, [Req(5, 0), Req(3, 20), Req(5, 40)],
             mutate=set_input("query_start_loc", 2, 4), status=[3, 3, 3]),
        Case("qsl-negative-start", QWEN3_30B, 16, [Req(3, 0), Req(3, 20)],
             mutate=set_input("query_start_loc", 0, -2), status=[3, 3]),
        Case("qsl-decreasing-rows-layout", QWEN3_30B, 16, [Req(8, 0), Req(4, 20)],
             rows_layout=True, mutate=set_input("query_start_loc", 2, 4), status=[3, 3]),
    ]  # fmt: skip


def _block_column(inputs: dict, r: int, block: int) -> tuple[int, int]:
    """(table row, ring column) of hash block ``block`` of request ``r``."""
    table = inputs["slot_table"]
    return int(inputs["table_row"][r]), block % table.shape[1]


def _set_block(r: int, block_offset: int, value: int) -> Callable[[dict], None]:
    """Map the ``block_offset``-th block of request r's window to slot ``value``."""

    def mutate(inputs: dict) -> None:
        block = int(inputs["block_window"][int(inputs["table_row"][r]), 0]) + block_offset
        row, col = _block_column(inputs, r, block)
        inputs["slot_table"][row, col] = value

    return mutate


def _unmap_block(r: int, block_offset: int) -> Callable[[dict], None]:
    return _set_block(r, block_offset, -1)


def _alias_row_from_the_end(r: int, other: int) -> Callable[[dict], None]:
    """Give request r the negative table row that, counted from the end of the table as a
    Python index, is request ``other``'s row."""

    def mutate(inputs: dict) -> None:
        num_table_rows = inputs["slot_table"].shape[0]
        inputs["table_row"][r] = int(inputs["table_row"][other]) - num_table_rows

    return mutate
