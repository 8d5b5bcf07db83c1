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

DEST_SENTINEL = {torch.uint8: 0xA5, torch.uint16: 0xA5A5}
INFO_SENTINEL = -99


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
    index_dtype: torch.dtype = torch.int32
    capture_dtype: torch.dtype = torch.int32
    full_range_values: bool = False  # int32 values far outside [0, E): exercises the wrap
    first_block_back: int = 0  # table starts this many blocks before the first needed one
    spare_cols: int = 1  # unmapped (-1) table columns after the last needed one
    spare_slots: int = 3  # slots no request maps: must stay poisoned
    pad_reqs: int = 0  # extra (CUDA-graph padding) entries past num_reqs in every input
    num_rows: int | None = None  # num_rows bound; None = capture rows
    extra_capture_rows: int = 5
    mutate: Callable[[dict], None] | None = None  # edits the built inputs (error cases)
    status: list[int] = field(default_factory=list)  # expected statuses; [] = all OK

    def __post_init__(self) -> None:
        if not self.status:
            self.status = [0] * len(self.reqs)


def build(case: Case, seed: int = 0, device: str | torch.device = "cpu") -> dict:
    """The case's inputs (``args``: gather_pack keyword arguments) and expected outputs."""
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

    first_block, cols = [], []
    for req in case.reqs:
        lo = req.start // block if req.start >= 0 else 0
        hi = (req.start + req.rows - 1) // block if req.rows > 0 and req.start >= 0 else lo - 1
        first_block.append(lo - case.first_block_back)
        cols.append(hi - lo + 1 + case.first_block_back if hi >= lo else 0)
    width = max(cols, default=0) + case.spare_cols
    num_slots = sum(cols) + case.spare_slots
    order = list(range(num_slots))
    rng.shuffle(order)
    table = torch.full((num_reqs + case.pad_reqs, width), -1, dtype=torch.int64)
    next_slot = 0
    for r, n in enumerate(cols):
        for j in range(n):
            table[r, j] = order[next_slot]
            next_slot += 1

    pad = case.pad_reqs
    inputs = {
        "capture": capture,
        "query_start_loc": torch.tensor(qsl + [qsl[-1]] * pad, dtype=torch.int64),
        "start_pos": torch.tensor([q.start for q in case.reqs] + [0] * pad, dtype=torch.int64),
        "first_block": torch.tensor(first_block + [0] * pad, dtype=torch.int64),
        "slot_table": table,
        "num_rejected": torch.tensor(
            [q.rejected for q in case.reqs] + [0] * pad, dtype=torch.int64
        ),
    }
    for name in ("query_start_loc", "start_pos", "first_block", "slot_table", "num_rejected"):
        inputs[name] = inputs[name].to(case.index_dtype)
    if case.mutate is not None:
        case.mutate(inputs)
    if not case.with_rejected:
        inputs["num_rejected"] = None

    dest = torch.full(
        (num_slots, block, model.num_layers, model.top_k), sentinel, dtype=torch.int32
    ).to(model.dtype)
    step_info = torch.full((num_reqs + pad, 3), INFO_SENTINEL, dtype=torch.int32)

    expected_dest = dest.clone()
    expected_info = step_info.clone()
    table = inputs["slot_table"].to(torch.int64)
    fb = inputs["first_block"].to(torch.int64)
    start = inputs["start_pos"].to(torch.int64)
    for r, req in enumerate(case.reqs):
        status = case.status[r]
        accepted = req.rows - req.rejected if case.with_rejected else req.rows
        expected_info[r] = torch.tensor(
            [int(start[r]), accepted if status == 0 else -1, status], dtype=torch.int32
        )
        if status != 0:
            continue
        for i in range(accepted):
            pos = int(start[r]) + i
            slot = int(table[r, pos // block - int(fb[r])])
            expected_dest[slot, pos % block] = capture[qsl[r] + i].to(model.dtype)

    args = dict(inputs, dest=dest, step_info=step_info, num_reqs=num_reqs, num_rows=case.num_rows)
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
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


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
    """Empty steps, CUDA-graph padding, optional inputs, dtypes."""
    many = [Req(1 + (i % 3), 17 * i, 1 if i % 3 == 2 else 0) for i in range(64)]
    return [
        Case("empty-R0", QWEN3_30B, 16, []),
        Case("empty-zero-rows", QWEN3_30B, 16, [Req(0, 5), Req(0, 0), Req(0, 33)]),
        Case("all-rejected", QWEN3_30B, 16, [Req(4, 10, 4), Req(2, 31, 2)]),
        Case("no-num-rejected", QWEN3_30B, 16, [Req(3, 14), Req(20, 0)], with_rejected=False),
        Case("graph-padded", QWEN3_30B, 16, [Req(2, 9), Req(1, 40)], pad_reqs=5, num_rows=64),
        Case("graph-padded-R0", QWEN3_30B, 16, [], pad_reqs=4, num_rows=32),
        Case("int64-index", KIMI_K2, 16, [Req(33, 20, 1), Req(1, 3)], index_dtype=torch.int64),
        Case("wrap-int32-u8", QWEN3_30B, 16, [Req(40, 9)], full_range_values=True),
        Case("wrap-int32-u16", KIMI_K2, 32, [Req(40, 9)], full_range_values=True),
        Case("u8-capture", GPT_OSS, 16, [Req(30, 2, 1)], capture_dtype=torch.uint8),
        Case("u16-capture-u8-dest", GPT_OSS, 16, [Req(30, 2, 1)], capture_dtype=torch.uint16),
        Case("u8-capture-u16-dest", KIMI_K2, 16, [Req(30, 2, 1)], capture_dtype=torch.uint8),
        Case("table-starts-early", QWEN3_30B, 16, [Req(30, 50)], first_block_back=2),
        Case("64req-varied", TINY, 16, many),
        # More table columns than one scan tile covers (row and request scans loop).
        Case("tiny-B1-600cols", TINY, 1, [Req(600, 5, 2), Req(7, 1)]),
        Case("B12-not-pow2", QWEN3_30B, 12, [Req(50, 7, 1), Req(1, 11), Req(13, 36)]),
    ]


def set_input(name: str, index, value) -> Callable[[dict], None]:
    def mutate(inputs: dict) -> None:
        inputs[name][index] = value

    return mutate


def error_cases() -> list[Case]:
    """Per-request failures: the failing request writes nothing, the others are unaffected."""
    three = [Req(20, 5), Req(4, 40, 1), Req(35, 70)]
    return [
        Case("rejected-negative", QWEN3_30B, 16, three, mutate=set_input("num_rejected", 1, -1),
             status=[0, 1, 0]),
        Case("rejected-over-rows", QWEN3_30B, 16, three, mutate=set_input("num_rejected", 2, 36),
             status=[0, 0, 1]),
        Case("block-before-table", QWEN3_30B, 16, three, mutate=set_input("first_block", 0, 1),
             status=[2, 0, 0]),
        Case("block-after-table", KIMI_K2, 16, three, spare_cols=0,
             mutate=set_input("first_block", 2, 3), status=[0, 0, 2]),
        Case("slot-minus-1-mid", QWEN3_30B, 16, three, mutate=set_input("slot_table", (2, 1), -1),
             status=[0, 0, 2]),
        Case("slot-past-arena", QWEN3_30B, 16, three, mutate=set_input("slot_table", (0, 0), 10**6),
             status=[2, 0, 0]),
        Case("start-negative", QWEN3_30B, 16, three, mutate=set_input("start_pos", 1, -3),
             status=[0, 2, 0]),
        # Only blocks of accepted rows matter: an unmapped block holding rejected rows is fine.
        Case("rejected-rows-unmapped", QWEN3_30B, 16, [Req(4, 14, 3)],
             mutate=set_input("slot_table", (0, 1), -1)),
        Case("rejected-all-bad-start", QWEN3_30B, 16, [Req(2, 0, 2), Req(3, 4)],
             mutate=set_input("start_pos", 0, -50)),
        Case("rows-past-bound", QWEN3_30B, 16, three, num_rows=30, status=[0, 0, 3]),
        Case("rows-one-past-bound", QWEN3_30B, 16, three, num_rows=58, status=[0, 0, 3]),
        Case("rows-at-bound", QWEN3_30B, 16, three, num_rows=59),
        Case("late-column-unmapped", TINY, 1, [Req(600, 5), Req(7, 1)],
             mutate=set_input("slot_table", (0, 580), -1), status=[2, 0]),
        Case("mixed-failures", KIMI_K2, 32, [Req(1, 9), Req(4, 60, 5), Req(50, 3), Req(2, 1)],
             mutate=set_input("slot_table", (2, 0), -1), status=[0, 1, 2, 0]),
    ]  # fmt: skip
