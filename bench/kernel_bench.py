"""GPU microbenchmark of the capture kernel's step launch against vLLM 0.33.0's snapshot path.

For each model shape x step kind (decode with 1 to 512 requests, an 8192-token chunked
prefill, speculative decoding with k=3) it times, with ``triton.testing.do_bench``
(p50/p20/p80):
  r3capture-kernel   gather_alloc into device slots ``[S, B, L, K]`` (GPU time: HBM efficiency)
  r3capture-pinned   gather_alloc straight into the pinned host arena (and step_info), then
                     stream sync: the rows are on the host, block-aligned, nothing else to do
  r3capture-staging  gather_alloc into device staging ``[rows, L, K]`` in step-row order + one
                     async copy of the step's num_rows rows (and step_info) to pinned host
                     memory, then stream sync (placing the rows into the arena by the slots
                     the launch took is host work, not timed here)
  vllm-cast          buffer[:n].to(dtype), the GPU half of vLLM's path (GPU time)
  vllm               buffer[:n].to(dtype) + .to("cpu", non_blocking=True) of it and of
                     num_rejected + stream sync + per-request host slicing of accepted rows
and, as thread-CPU time of the launching thread alone (``host``; nothing waits inside it):
  r3capture-launch   the worker's launch: per-step argument checks + the compiled variant's
                     launch (through Triton's JIT on the first call only)
  vllm-cast-launch   the launch of vLLM's snapshot cast
  launch-stand-in    the one torch op that stands for either launch in ``bench/host_step``
                     on a CPU (``bench/stand_ins.py``): how far that stand-in is from both
and reports µs, effective GB/s, % of the measured HBM peak (a large device copy) and of the
measured PCIe peak (a large pinned D2H copy), the bytes that cross PCIe per step, and the
speedup over the vLLM provider timed the same way (``vllm-cast`` for GPU time, ``vllm`` for
wall time until the host may read the rows, ``vllm-cast-launch`` for host time).

The r3capture providers launch as the worker does (``aux_output/device_side.py``): each
through a ``GatherAllocLaunch`` built once over its own device state (a ring of block-tagged
slots ``[max_num_seqs, D]`` and two records per request index, the queue's heads) and
the free-slot queue in pinned host memory; each call checks the batch's device inputs
(``query_start_loc``, ``positions``, ``idx_mapping``, ``num_rejected``) and launches with a
new serial and the queue's tail. Every request of a timed step is new to its index (its
fresh flag set, pinned as the worker keeps them), so every launch takes every block of the
step from the queue: the most slot-taking work a step can do. The host's refill puts the
same slots back in the same order (the queue holds exactly the step's blocks), so every
launch takes the same slots and writes the same bytes.

Inputs are built as the worker's batch: every request has a distinct index below
``max_num_seqs`` (Model Runner V2's ``idx_mapping``), ``positions`` holds each row's token
position on the device, and the queue names distinct slots of a shuffled arena twice the
step's blocks.

Every configuration is gated on correctness before it is timed: the accepted rows of vLLM's
path, placed by the slots the queue hands out in batch order, give the expected arena,
staging and step_info; the torch reference and every r3capture provider's output (through
``gather_alloc``) must equal them byte for byte, with every other byte still poisoned. A
configuration that fails the gate gets no timings; after timing, what the timed launches
left (every launch writes the same bytes) is checked the same way, or the configuration's
timings are dropped. On a machine without CUDA only the gate runs (Triton interpreter,
scaled-down steps) and the script says that timings need a GPU, then exits 0.

    python -m bench.kernel_bench [--quick] [--out DIR]    (or: python -m bench.run kernel)

Rows follow ``bench.common.Result``: shape = [scheduled rows, L, K]; ``params`` carries the
model, step, timing kind (``gpu``: CUDA events around the launch; ``wall+sync``: until the
host may read the rows), bytes, bandwidths and the speedup over vLLM.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bench.models import MODELS, ModelShape

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # The kernels decide at import time whether they are interpreted.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from bench.common import (  # noqa: E402
    RESULTS_DIR,
    Result,
    machine_info,
    per_call_ns,
    write_results,
)
from bench.stand_ins import launch_stand_in  # noqa: E402
from r3capture.aux_output.sizing import ring_widths  # noqa: E402
from r3capture.kernels import (  # noqa: E402
    GatherAllocLaunch,
    can_write_host_directly,
    gather_alloc,
    gather_alloc_reference,
)

HASH_BLOCK = 16
DEPTH = 2  # steps in flight (vLLM's max_concurrent_batches under async scheduling)
QUANTILES = [0.5, 0.2, 0.8]  # do_bench wants a list
# host_cost: calls timed, untimed calls first, calls between two waits for the device.
HOST_CALLS, HOST_WARMUP, HOST_BATCH = 2000, 100, 50
# Poison for every output the kernel must write; no expert id equals it (see build_step).
DEST_SENTINEL = {torch.uint8: 0xFF, torch.uint16: 0xFFFF}
INFO_SENTINEL = -99


@dataclass(frozen=True)
class Sizes:
    """Engine limits and the size of each step kind."""

    max_tokens: int  # capture rows (max_num_batched_tokens)
    max_seqs: int  # most requests per step, and request indices (the ring's rows)
    decode_reqs: tuple[int, ...]  # requests of each decode step (one row each)
    prefill_chunks: int  # requests of the chunked prefill, max_tokens // chunks rows each
    spec_reqs: int  # requests of the speculative step, k + 1 = 4 rows each
    max_start: int  # token positions of first rows are drawn below this


GPU_SIZES = Sizes(8192, 512, (1, 16, 128, 512), 4, 256, 32_000)
# Without CUDA the gate runs under the Triton interpreter: the same kinds, smaller.
CPU_SIZES = Sizes(256, 16, (1, 16), 4, 16, 2_000)


def ring_width(max_tokens: int, block: int, depth: int = DEPTH) -> int:
    """The device ring's width D, as the worker sizes it (``sizing.ring_widths``)."""
    return ring_widths(max_tokens, block, depth)[1]


@dataclass(frozen=True)
class Request:
    rows: int  # scheduled rows this step
    start: int  # token position of the first row
    rejected: int = 0  # speculative rows rejected at the end


def step_kinds(sizes: Sizes) -> list[str]:
    return [f"decode-{n}" for n in sizes.decode_reqs] + ["prefill", "spec-k3"]


def make_step(kind: str, sizes: Sizes, rng: random.Random) -> tuple[list[Request], bool]:
    """Requests of one step, and whether the step has speculative (rejected) rows."""
    if kind.startswith("decode-"):
        n = int(kind.removeprefix("decode-"))
        return [Request(1, rng.randrange(0, sizes.max_start)) for _ in range(n)], False
    if kind == "prefill":
        # Chunked prefill: max_tokens rows in chunks, each starting anywhere in a block.
        chunk = sizes.max_tokens // sizes.prefill_chunks
        starts = [rng.randrange(0, sizes.max_start) for _ in range(sizes.prefill_chunks)]
        return [Request(chunk, s) for s in starts], False
    if kind == "spec-k3":
        # k=3 drafts, each accepted with p=0.5 until the first rejection: ~47% of rows kept.
        reqs = []
        for _ in range(sizes.spec_reqs):
            kept = 0
            while kept < 3 and rng.random() < 0.5:
                kept += 1
            reqs.append(Request(4, rng.randrange(0, sizes.max_start), 3 - kept))
        return reqs, True
    raise ValueError(f"unknown step kind {kind!r}")


@dataclass
class Step:
    """One engine step's kernel inputs, on ``device``, and the queue that feeds its blocks."""

    model: ModelShape
    kind: str
    block: int  # B
    reqs: list[Request]
    # capture, query_start_loc, positions, request_index (MRV2's idx_mapping), num_rejected
    # (None without speculation)
    inputs: dict[str, torch.Tensor | None]
    queue_slots: torch.Tensor  # int32 [Q] (host): the step's blocks' slots, in batch order
    num_slots: int  # S, slots of the arena
    num_indices: int  # N, request indices (the ring's rows)
    ring_width: int  # D

    @property
    def device(self) -> torch.device:
        return self.inputs["capture"].device

    @property
    def num_rows(self) -> int:
        return sum(r.rows for r in self.reqs)

    @property
    def accepted_rows(self) -> int:
        return sum(r.rows - r.rejected for r in self.reqs)

    @property
    def queue_size(self) -> int:
        return self.queue_slots.shape[0]

    @property
    def label(self) -> str:
        if self.kind.startswith("decode"):
            return f"decode {len(self.reqs)} req"
        if self.kind == "prefill":
            return f"prefill {self.num_rows} tok {len(self.reqs)} chunks"
        return f"spec k=3 {len(self.reqs)} req {100 * self.accepted_rows // self.num_rows}% acc"

    def _host_side(self, t: torch.Tensor) -> torch.Tensor:
        """Where the worker keeps the queue and the fresh flags: pinned host memory on a GPU."""
        return t.pin_memory() if self.device.type == "cuda" else t.clone()

    def new_state(self) -> dict[str, torch.Tensor]:
        """The kernel's state before the step's first launch: an empty ring, records and
        heads on the device, the queue (the step's slots) and the fresh flags host-side."""
        device = self.device
        return {
            "ring": torch.full(
                (self.num_indices, self.ring_width), -1, dtype=torch.int64, device=device
            ),  # fmt: skip
            "records": torch.zeros((self.num_indices, 2), dtype=torch.int64, device=device),
            "queue": self._host_side(self.queue_slots),
            "heads": torch.zeros(4, dtype=torch.int64, device=device),
            "fresh": self._host_side(torch.ones(len(self.reqs), dtype=torch.uint8)),
        }

    def alloc_args(self, dest: torch.Tensor, step_info: torch.Tensor, **inputs) -> dict:
        """gather_alloc arguments of the step's first launch writing ``dest`` (``[S, B, L, K]``
        slots or ``[>= num_rows, L, K]`` staging), over a new state; ``inputs`` replaces
        some."""
        args = {**self.inputs, **self.new_state(), **inputs}
        args.update(dest=dest, step_info=step_info, num_reqs=len(self.reqs),
                    num_rows=self.num_rows, launch=1, queue_tail=self.queue_size)  # fmt: skip
        if dest.dim() == 3:
            args.update(hash_block=self.block, num_slots=self.num_slots)
        return args

    def launcher(self, dest: torch.Tensor, step_info: torch.Tensor) -> Callable[[], None]:
        """The worker's hot path for this step into ``dest`` (slots or staging): a
        ``GatherAllocLaunch`` over a new state, validated here once, and a call that checks
        the batch's inputs and launches with the next serial and the refilled queue's tail
        (the same ``Q`` slots put back after each launch)."""
        x, state = self.inputs, self.new_state()
        rows_layout = dest.dim() == 3
        launch = GatherAllocLaunch(
            x["capture"], state["ring"], state["records"], state["queue"], state["heads"],
            dest, step_info, hash_block=self.block if rows_layout else None,
            num_slots=self.num_slots if rows_layout else None, impl="triton",
        )  # fmt: skip
        qsl, positions = x["query_start_loc"], x["positions"]
        index, rejected, fresh = x["request_index"], x["num_rejected"], state["fresh"]
        num_reqs, num_rows, size = len(self.reqs), self.num_rows, self.queue_size
        serial = 0

        def run() -> None:
            nonlocal serial
            serial += 1
            shape = launch.check_step(
                qsl, positions, index, rejected, None, launch=serial,
                queue_tail=serial * size, num_reqs=num_reqs, num_rows=num_rows,
            )  # fmt: skip
            launch.launch_checked(shape, qsl, positions, index, rejected, fresh)

        return run

    def new_output(self, what: str, place: str) -> torch.Tensor:
        """A poisoned ``slots``/``rows``/``info`` output on ``place``: device | pinned | cpu."""
        L, K = self.model.num_layers, self.model.top_k
        dtype, fill = self.model.dtype, DEST_SENTINEL[self.model.dtype]
        if what == "slots":
            shape = (self.num_slots, self.block, L, K)
        elif what == "rows":
            shape = (self.inputs["capture"].shape[0], L, K)
        else:
            shape, dtype, fill = (len(self.reqs), 4), torch.int32, INFO_SENTINEL
        out = torch.full(shape, fill, dtype=torch.int32).to(dtype)
        if place == "pinned":
            return out.pin_memory()
        return out.to(self.device) if place == "device" else out


def build_step(
    model: ModelShape,
    kind: str,
    *,
    sizes: Sizes,
    device: str | torch.device,
    seed: int,
    block: int = HASH_BLOCK,
) -> Step:
    """One step of ``kind`` with the worker's inputs (see the module docstring)."""
    rng = random.Random(seed)
    reqs, speculative = make_step(kind, sizes, rng)
    num_reqs = len(reqs)
    if sum(r.rows for r in reqs) > sizes.max_tokens or num_reqs > sizes.max_seqs:
        raise ValueError(f"{kind}: {num_reqs} requests or their rows exceed {sizes}")
    gen = torch.Generator().manual_seed(seed)
    shape = (sizes.max_tokens, model.num_layers, model.top_k)
    capture = torch.randint(0, model.num_experts, shape, generator=gen, dtype=torch.int32)
    # No id may equal the poison, or a missing write could pass unseen.
    capture[capture == DEST_SENTINEL[model.dtype]] -= 1

    rows = np.array([r.rows for r in reqs], dtype=np.int64)
    accepted = rows - np.array([r.rejected for r in reqs], dtype=np.int64)
    starts = np.array([r.start for r in reqs], dtype=np.int64)
    qsl = np.concatenate([[0], np.cumsum(rows)])
    num_rows = int(qsl[-1])
    # Rows past the step are padding: no position there is ever read.
    positions = np.full(sizes.max_tokens, -1, dtype=np.int64)
    positions[:num_rows] = np.repeat(starts - qsl[:-1], rows) + np.arange(num_rows)
    # The blocks of each request's accepted rows, all new (every request is fresh).
    num_blocks = (starts + accepted - 1) // block - starts // block + 1
    width = ring_width(sizes.max_tokens, block)
    assert (num_blocks <= width).all(), "a request wider than the ring"
    index = np.array(rng.sample(range(sizes.max_seqs), num_reqs), dtype=np.int64)
    # An arena twice the step's blocks, shuffled: slots are distinct, never in request order.
    total = int(num_blocks.sum())
    num_slots = 2 * total
    queue_slots = np.array(rng.sample(range(num_slots), total), dtype=np.int32)

    def int32(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values.astype(np.int32))

    inputs = {
        "capture": capture,
        "query_start_loc": int32(qsl),
        "positions": torch.from_numpy(positions),
        "request_index": torch.from_numpy(index),
        "num_rejected": int32(np.array([r.rejected for r in reqs])) if speculative else None,
    }
    inputs = {k: v.to(device) if v is not None else None for k, v in inputs.items()}
    return Step(model, kind, block, reqs, inputs, torch.from_numpy(queue_slots), num_slots,
                sizes.max_seqs, width)  # fmt: skip


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def vllm_host_rows(step: Step) -> list[np.ndarray]:
    """vLLM 0.33.0's path: narrow snapshot of every scheduled row, D2H, host slicing."""
    n = step.num_rows
    snapshot = step.inputs["capture"][:n].to(step.model.dtype)
    host = snapshot.to("cpu", non_blocking=True)
    rejected = step.inputs["num_rejected"]
    rejected_host = rejected.to("cpu", non_blocking=True) if rejected is not None else None
    _synchronize(step.device)
    rows = host.numpy()
    qsl = np.cumsum([0] + [r.rows for r in step.reqs])
    rej = rejected_host.numpy() if rejected_host is not None else np.zeros(len(step.reqs), int)
    return [rows[qsl[i] : qsl[i + 1] - int(rej[i])] for i in range(len(step.reqs))]


def copy_staging(step: Step, staging, info, host_rows, host_info) -> None:
    """The staging provider's copies after its kernel: one async copy of num_rows rows (and
    step_info) into pinned host memory. The caller synchronizes."""
    n = step.num_rows
    host_rows[:n].copy_(staging[:n], non_blocking=True)
    host_info.copy_(info, non_blocking=True)


def expected_outputs(step: Step, host_rows: list[np.ndarray]) -> dict[str, np.ndarray]:
    """``slots`` [S, B, L, K], ``rows`` [T, L, K] and ``info`` [R, 4] the gather must leave:
    vLLM's accepted rows placed by the slots the queue hands out in batch order (or in
    step-row order), poison elsewhere."""
    model, block = step.model, step.block
    L, K = model.num_layers, model.top_k
    sentinel = DEST_SENTINEL[model.dtype]
    slots = np.full((step.num_slots * block, L, K), sentinel, dtype=model.np_dtype)
    rows = np.full((step.inputs["capture"].shape[0], L, K), sentinel, dtype=model.np_dtype)
    info = np.zeros((len(step.reqs), 4), dtype=np.int32)
    queue = step.queue_slots.numpy().astype(np.int64)
    first_row, taken = 0, 0
    for r, (req, accepted) in enumerate(zip(step.reqs, host_rows)):
        pos = req.start + np.arange(len(accepted))
        first = req.start // block
        num_blocks = (req.start + len(accepted) - 1) // block - first + 1
        slot = queue[taken + pos // block - first]
        slots[slot * block + pos % block] = accepted
        rows[first_row : first_row + len(accepted)] = accepted
        info[r] = (req.start, len(accepted), 0, num_blocks)
        first_row += req.rows
        taken += num_blocks
    return {"slots": slots.reshape(step.num_slots, block, L, K), "rows": rows, "info": info}


def _differs(what: str, actual: torch.Tensor, expected: np.ndarray) -> str | None:
    a = actual.cpu().contiguous().view(torch.uint8).numpy().reshape(-1)
    e = np.ascontiguousarray(expected).view(np.uint8).reshape(-1)
    if a.shape != e.shape:
        return f"{what}: {a.size} bytes, expected {e.size}"
    diff = np.flatnonzero(a != e)
    if diff.size == 0:
        return None
    return f"{what}: {diff.size} of {a.size} bytes differ, first at byte {int(diff[0])}"


def compare(expected: dict[str, np.ndarray], left: dict[str, dict[str, torch.Tensor]]) -> list[str]:
    """What differs between ``expected`` and each implementation's outputs (``left[name]``:
    ``slots``/``rows``/``info`` tensors it wrote)."""
    problems = []
    for name, outputs in left.items():
        for what, tensor in outputs.items():
            problems.append(_differs(f"{name} {what}", tensor, expected[what]))
    return [p for p in problems if p is not None]


def gate(step: Step) -> str | None:
    """None when every implementation leaves exactly the expected bytes, else what differed."""
    expected = expected_outputs(step, vllm_host_rows(step))
    problems = []

    def check(name: str, outputs: dict[str, torch.Tensor]) -> None:
        problems.extend(compare(expected, {name: outputs}))

    host_inputs = {k: v.cpu() for k, v in step.inputs.items() if v is not None}
    for what, name in (("slots", "reference"), ("rows", "reference staging")):
        # A new state each: a second launch 1 on the same one is refused (BAD_LAUNCH).
        host_state = {k: v.cpu() for k, v in step.new_state().items()}
        dest, info = step.new_output(what, "cpu"), step.new_output("info", "cpu")
        gather_alloc_reference(**step.alloc_args(dest, info, **host_inputs, **host_state))
        check(name, {what: dest, "info": info})

    slots, info = step.new_output("slots", "device"), step.new_output("info", "device")
    gather_alloc(**step.alloc_args(slots, info), impl="triton")
    _synchronize(step.device)
    check("r3capture-kernel", {"slots": slots, "info": info})
    if can_write_host_directly(step.device):
        slots, info = step.new_output("slots", "pinned"), step.new_output("info", "pinned")
        gather_alloc(**step.alloc_args(slots, info), impl="triton")
        _synchronize(step.device)
        check("r3capture-pinned", {"slots": slots, "info": info})
    host_place = "pinned" if step.device.type == "cuda" else "cpu"
    staging, info = step.new_output("rows", "device"), step.new_output("info", "device")
    host_rows, host_info = step.new_output("rows", host_place), step.new_output("info", host_place)
    gather_alloc(**step.alloc_args(staging, info), impl="triton")
    copy_staging(step, staging, info, host_rows, host_info)
    _synchronize(step.device)
    check("r3capture-staging", {"rows": host_rows, "info": host_info})
    return "; ".join(problems) if problems else None


def _bench(fn: Callable[[], object]) -> tuple[float, float, float]:
    p50, p20, p80 = triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=QUANTILES)
    return p50 * 1e3, p20 * 1e3, p80 * 1e3  # ms -> us


def host_cost(
    fn: Callable[[], object], device: torch.device, calls: int = HOST_CALLS
) -> tuple[float, float, float]:
    """What one call of ``fn`` costs the calling thread, in thread-CPU µs (p50, p20, p80):
    the host work of a launch, none of the device's. Nothing waits inside the timing; the
    device drains every ``HOST_BATCH`` calls outside it, so the launch queue never fills."""
    samples = per_call_ns(
        fn, lambda: _synchronize(device), calls=calls, warmup=HOST_WARMUP, batch=HOST_BATCH
    )
    p50, p20, p80 = np.percentile(samples, [50, 20, 80]) / 1e3
    return float(p50), float(p20), float(p80)


def _copy_gbps(dst: torch.Tensor, src: torch.Tensor, bytes_moved: int) -> float:
    ms = triton.testing.do_bench(lambda: dst.copy_(src, non_blocking=True), quantiles=[0.5])
    ms = ms[0] if isinstance(ms, list) else ms
    return bytes_moved / (ms * 1e-3) / 1e9


def measure_peaks() -> dict[str, float]:
    """Measured HBM (device copy, read + write) and PCIe (pinned D2H) bandwidth, GB/s."""
    n, m = 1 << 30, 256 << 20
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    hbm = _copy_gbps(torch.empty_like(src), src, 2 * n)
    pcie = _copy_gbps(torch.empty(m, dtype=torch.uint8, pin_memory=True), src[:m], m)
    torch.cuda.empty_cache()
    return {"hbm_gbps": hbm, "pcie_gbps": pcie}


# Which vLLM provider each provider is compared with (timed the same way).
_BASELINE = {"gpu": "vllm-cast", "wall+sync": "vllm", "host": "vllm-cast-launch"}


def bench_step(step: Step, peaks: dict[str, float]) -> tuple[list[Result], str | None]:
    """Times every provider on a step that passed the gate (needs CUDA): the rows, or none
    and what differed when the outputs the timed launches left are not the expected ones."""
    model = step.model
    row_in = model.row_elems * 4  # int32 capture
    row_out = model.row_elems * model.dtype.itemsize
    acc, sched = step.accepted_rows, step.num_rows
    info_bytes = len(step.reqs) * 4 * 4
    # Every launch reads the pinned queue (the step's blocks) and fresh flags over PCIe.
    host_reads = step.queue_size * 4 + len(step.reqs)
    stream = torch.cuda.current_stream()

    # Each r3capture provider: a launcher built once, outside the timing, as the worker does.
    slots, info = step.new_output("slots", "device"), step.new_output("info", "device")
    to_slots = step.launcher(slots, info)
    staging, staging_info = step.new_output("rows", "device"), step.new_output("info", "device")
    to_staging = step.launcher(staging, staging_info)
    host_rows, host_info = step.new_output("rows", "pinned"), step.new_output("info", "pinned")
    left = {
        "r3capture-kernel": {"slots": slots, "info": info},
        "r3capture-staging": {"rows": host_rows, "info": host_info},
    }
    direct = can_write_host_directly(step.device)
    if direct:
        arena, arena_info = step.new_output("slots", "pinned"), step.new_output("info", "pinned")
        to_arena = step.launcher(arena, arena_info)
        left["r3capture-pinned"] = {"slots": arena, "info": arena_info}

    def r3_pinned():
        to_arena()
        stream.synchronize()

    def r3_staging():
        to_staging()
        copy_staging(step, staging, staging_info, host_rows, host_info)
        stream.synchronize()

    capture = step.inputs["capture"]
    providers = [
        # name, fn, timing, HBM bytes, PCIe bytes
        ("r3capture-kernel", to_slots, "gpu", acc * (row_in + row_out), host_reads),
        ("r3capture-pinned", r3_pinned, "wall+sync", acc * row_in,
         acc * row_out + info_bytes + host_reads),
        ("r3capture-staging", r3_staging, "wall+sync", acc * (row_in + row_out) + sched * row_out,
         sched * row_out + info_bytes + host_reads),
        ("vllm-cast", lambda: capture[:sched].to(model.dtype), "gpu", sched * (row_in + row_out),
         0),
        ("vllm", lambda: vllm_host_rows(step), "wall+sync", sched * (row_in + 2 * row_out),
         sched * row_out),
        # What each side's launch costs the thread that launches the forward (host_step's
        # launch stand-in stands for both on a CPU, bench/stand_ins.py).
        ("r3capture-launch", to_slots, "host", 0, 0),
        ("vllm-cast-launch", lambda: capture[:sched].to(model.dtype), "host", 0, 0),
        ("launch-stand-in", launch_stand_in, "host", 0, 0),
    ]  # fmt: skip
    if not direct:
        print("this GPU cannot write pinned host memory directly: no r3capture-pinned timings")
        providers = [p for p in providers if p[0] != "r3capture-pinned"]
    rows = []
    for name, fn, timing, hbm_bytes, pcie_bytes in providers:
        p50, p20, p80 = host_cost(fn, step.device) if timing == "host" else _bench(fn)
        seconds = p50 * 1e-6
        hbm_gbps = hbm_bytes / seconds / 1e9
        pcie_gbps = pcie_bytes / seconds / 1e9
        rows.append(
            Result(
                bench="kernel",
                op="gather_alloc",
                shape=[sched, model.num_layers, model.top_k],
                dtype=str(model.dtype).removeprefix("torch."),
                provider=name,
                p50=p50,
                p20=p20,
                p80=p80,
                unit="us",
                **machine_info(),
                params={
                    "model": model.name,
                    "step": step.label,
                    "timing": timing,
                    "accepted_rows": acc,
                    "hbm_bytes": hbm_bytes,
                    "hbm_gbps": hbm_gbps,
                    "hbm_pct_of_peak": 100 * hbm_gbps / peaks["hbm_gbps"],
                    "pcie_bytes": pcie_bytes,
                    "pcie_gbps": pcie_gbps,
                    "pcie_pct_of_peak": 100 * pcie_gbps / peaks["pcie_gbps"],
                    "gate": "byte-equal",
                },
            )
        )
    # Every launch writes the same bytes: what the timed launches left must be the gate's.
    torch.cuda.synchronize()
    problems = compare(expected_outputs(step, vllm_host_rows(step)), left)
    if problems:
        return [], "; ".join(problems)
    p50_of = {r.provider: r.p50 for r in rows}
    for r in rows:
        baseline = _BASELINE[r.params["timing"]]
        r.params["vs_vllm"] = baseline
        r.params["speedup_vs_vllm"] = p50_of[baseline] / r.p50
    return rows, None


def _figure(rows: list[Result]):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    labels = list(dict.fromkeys(f"{r.params['model']} {r.params['step']}" for r in rows))
    providers = list(dict.fromkeys(r.provider for r in rows))
    p50 = {(f"{r.params['model']} {r.params['step']}", r.provider): r.p50 for r in rows}
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 0.9), 5))
    width = 0.8 / len(providers)
    for j, provider in enumerate(providers):
        heights = [p50.get((label, provider), np.nan) for label in labels]
        ax.bar(np.arange(len(labels)) + j * width, heights, width, label=provider)
    ax.set_xticks(np.arange(len(labels)) + 0.4 - width / 2)
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("p50 µs per step (log)")
    ax.set_title(f"gather_alloc vs vLLM snapshot path — {rows[0].machine}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def run(
    quick: bool = False,
    out: Path | None = None,
    *,
    models: tuple[ModelShape, ...] | None = None,
    sizes: Sizes | None = None,
) -> tuple[list[Result], list[str]]:
    """Timing rows (empty without CUDA) and the configurations that failed the gate (or the
    check of what the timed launches left)."""
    if models is None:
        models = MODELS[:1] + MODELS[2:3] if quick else MODELS
    if sizes is None:
        sizes = GPU_SIZES if HAS_CUDA else CPU_SIZES
    device = "cuda" if HAS_CUDA else "cpu"
    failures = []
    steps = []
    for i, model in enumerate(models):
        for j, kind in enumerate(step_kinds(sizes)):
            step = build_step(model, kind, sizes=sizes, device=device, seed=100 * i + j)
            problem = gate(step)
            label = f"{model.name:14s} {step.label:28s}"
            print(f"gate {label} rows {step.accepted_rows:5d}/{step.num_rows:5d}: "
                  f"{'byte-equal' if problem is None else 'MISMATCH: ' + problem}")  # fmt: skip
            if problem is None:
                steps.append((label, step))
            else:
                failures.append(label)
    if failures:
        print(f"no timings for {len(failures)} configuration(s) that failed the gate: {failures}")
    if not HAS_CUDA:
        print(
            "kernel_bench: no CUDA device here; the correctness gate ran (Triton interpreter, "
            "scaled-down steps) but timings need a GPU: run bench/gpu_check.sh on one."
        )
        return [], failures
    peaks = measure_peaks()
    print(
        f"measured peaks: HBM {peaks['hbm_gbps']:.0f} GB/s, PCIe D2H {peaks['pcie_gbps']:.1f} GB/s"
    )
    rows = []
    for label, step in steps:
        step_rows, problem = bench_step(step, peaks)
        if problem is not None:
            print(f"timed {label}: MISMATCH after timing, timings dropped: {problem}")
            failures.append(label)
        rows.extend(step_rows)
        for r in step_rows:
            q = r.params
            print(f"{q['model']:14s} {q['step']:28s} {r.provider:18s} p50 {r.p50:9.1f} us  "
                  f"HBM {q['hbm_gbps']:7.1f} GB/s ({q['hbm_pct_of_peak']:5.1f}%)  "
                  f"PCIe {q['pcie_bytes'] / 1e6:7.3f} MB {q['pcie_gbps']:6.1f} GB/s "
                  f"({q['pcie_pct_of_peak']:5.1f}%)  x{q['speedup_vs_vllm']:.2f} "
                  f"vs {q['vs_vllm']}")  # fmt: skip
    if out is not None and rows:
        paths = write_results("kernel_bench", rows, figure=_figure(rows), out_dir=out,
                              extra={"peaks_gbps": peaks, "sizes": vars(sizes)})  # fmt: skip
        print("wrote", ", ".join(str(p) for p in paths))
    return rows, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two models only")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    args = parser.parse_args(argv)
    _, failures = run(quick=args.quick, out=args.out)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
