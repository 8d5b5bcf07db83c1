"""GPU microbenchmark of the gather-pack step kernel against vLLM 0.33.0's snapshot path.

For each model shape x step kind it times, with ``triton.testing.do_bench`` (p50/p20/p80):
  r3capture-kernel   gather_pack into device staging (GPU time: HBM efficiency)
  r3capture-pinned   gather_pack straight into a pinned host arena, then stream sync (the
                     rows are on the host, block-aligned, nothing else to do)
  r3capture-staging  gather_pack into device staging + one async copy of the step's slots
                     (and step_info) to the pinned arena, then stream sync
  vllm-cast          buffer[:n].to(dtype), the GPU half of vLLM's path (GPU time)
  vllm               buffer[:n].to(dtype) + .to("cpu", non_blocking=True) of it and of
                     num_rejected + stream sync + per-request host slicing of accepted rows
and reports µs, effective GB/s, % of the measured HBM peak (a large device copy) and of the
measured PCIe peak (a large pinned D2H copy), and the bytes that cross PCIe per step.

Every configuration is gated on correctness before it is timed: the kernel's arena and
step_info must equal the torch reference byte for byte, and the accepted rows read back
from the arena must equal vLLM's host slices. A configuration that fails the gate gets no
timings. On a machine without CUDA only the gate runs (Triton interpreter, scaled-down
steps) and the script says that timings need a GPU, then exits 0.

    python -m bench.kernel_bench [--quick] [--out DIR]    (or: python -m bench.run kernel)

Rows follow ``bench.common.Result``: shape = [scheduled rows, L, K]; ``params`` carries the
model, step, timing kind (``gpu``: CUDA events around the launch; ``wall+sync``: until the
host may read the rows), bytes and bandwidths.
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

from bench.common import RESULTS_DIR, Result, machine_info, write_results  # noqa: E402
from r3capture.kernels import (  # noqa: E402
    can_write_host_directly,
    gather_pack,
    gather_pack_reference,
)

HASH_BLOCK = 16
MAX_NUM_BATCHED_TOKENS = 8192
QUANTILES = [0.5, 0.2, 0.8]  # do_bench wants a list


@dataclass(frozen=True)
class Request:
    rows: int
    start: int
    rejected: int = 0


def make_step(kind: str, rng: random.Random, small: bool) -> tuple[list[Request], bool]:
    """Requests of one step, and whether the step has speculative (rejected) rows."""
    if kind == "decode":
        n = 32 if small else 256
        return [Request(1, rng.randrange(0, 32_000)) for _ in range(n)], False
    if kind == "prefill":
        # Chunked prefill: 8192 tokens in four chunks, each starting mid-block.
        chunk = 128 if small else 2048
        return [Request(chunk, rng.randrange(0, 16_000)) for _ in range(4)], False
    if kind == "spec":
        # k=3 drafts, each accepted with p=0.5 until the first rejection: ~47% of rows kept.
        reqs = []
        for _ in range(32 if small else 256):
            kept = 0
            while kept < 3 and rng.random() < 0.5:
                kept += 1
            reqs.append(Request(4, rng.randrange(0, 32_000), 3 - kept))
        return reqs, True
    raise ValueError(f"unknown step kind {kind!r}")


STEP_KINDS = ("decode", "prefill", "spec")


@dataclass
class Step:
    model: ModelShape
    kind: str
    reqs: list[Request]
    args: dict  # gather_pack arguments with dest/step_info on the device
    num_slots: int

    @property
    def label(self) -> str:
        if self.kind == "decode":
            return f"decode {len(self.reqs)} req"
        if self.kind == "prefill":
            return f"prefill {self.sched_rows} tok"
        return f"spec k=3 {len(self.reqs)} req {100 * self.accepted_rows // self.sched_rows}% acc"

    @property
    def sched_rows(self) -> int:
        return sum(r.rows for r in self.reqs)

    @property
    def accepted_rows(self) -> int:
        return sum(r.rows - r.rejected for r in self.reqs)


def build_step(model: ModelShape, kind: str, device: str, seed: int, small: bool) -> Step:
    rng = random.Random(seed)
    reqs, speculative = make_step(kind, rng, small)
    gen = torch.Generator().manual_seed(seed)
    capture = torch.randint(
        0, model.num_experts, (MAX_NUM_BATCHED_TOKENS, model.num_layers, model.top_k),
        generator=gen, dtype=torch.int32,
    )  # fmt: skip
    qsl, first_block, cols = [0], [], []
    for r in reqs:
        qsl.append(qsl[-1] + r.rows)
        lo, hi = r.start // HASH_BLOCK, (r.start + r.rows - 1) // HASH_BLOCK
        first_block.append(lo)
        cols.append(hi - lo + 1)
    # The step's slots are numbered contiguously, so device staging needs one copy.
    table = torch.full((len(reqs), max(cols)), -1, dtype=torch.int32)
    next_slot = 0
    for i, n in enumerate(cols):
        table[i, :n] = torch.arange(next_slot, next_slot + n, dtype=torch.int32)
        next_slot += n
    num_slots = next_slot
    args = {
        "capture": capture,
        "query_start_loc": torch.tensor(qsl, dtype=torch.int32),
        "start_pos": torch.tensor([r.start for r in reqs], dtype=torch.int32),
        "first_block": torch.tensor(first_block, dtype=torch.int32),
        "slot_table": table,
        "dest": torch.zeros(
            (num_slots, HASH_BLOCK, model.num_layers, model.top_k), dtype=model.dtype
        ),
        "step_info": torch.zeros((len(reqs), 3), dtype=torch.int32),
        "num_rejected": (
            torch.tensor([r.rejected for r in reqs], dtype=torch.int32) if speculative else None
        ),
    }
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    return Step(model, kind, reqs, args, num_slots)


def _clone(args: dict, **place) -> dict:
    out = {}
    for name, value in args.items():
        if not isinstance(value, torch.Tensor):
            out[name] = value
        elif place.get(name) == "pinned":
            out[name] = torch.zeros(value.shape, dtype=value.dtype, pin_memory=True)
        elif place.get(name) == "cpu":
            out[name] = value.cpu().clone()
        else:
            out[name] = value.clone()
    return out


def vllm_host_rows(step: Step) -> list[np.ndarray]:
    """vLLM 0.33.0's path: narrow snapshot of every scheduled row, D2H, host slicing."""
    args = step.args
    n = step.sched_rows
    snapshot = args["capture"][:n].to(step.model.dtype)
    host = snapshot.to("cpu", non_blocking=True)
    rejected = args["num_rejected"]
    rejected_host = rejected.to("cpu", non_blocking=True) if rejected is not None else None
    if host.is_cuda or snapshot.is_cuda:
        torch.cuda.current_stream().synchronize()
    rows = host.numpy()
    qsl = np.cumsum([0] + [r.rows for r in step.reqs])
    rej = rejected_host.numpy() if rejected_host is not None else np.zeros(len(step.reqs), int)
    return [rows[qsl[i] : qsl[i + 1] - int(rej[i])] for i in range(len(step.reqs))]


def arena_rows(step: Step, dest: torch.Tensor) -> list[np.ndarray]:
    """Each request's accepted rows read back from a block-aligned arena."""
    arena = dest.cpu().numpy()
    table = step.args["slot_table"].cpu().numpy()
    out = []
    for i, r in enumerate(step.reqs):
        pos = r.start + np.arange(r.rows - r.rejected)
        slots = table[i, pos // HASH_BLOCK - r.start // HASH_BLOCK]
        out.append(arena[slots, pos % HASH_BLOCK])
    return out


def gate(step: Step) -> str | None:
    """None when every implementation agrees byte for byte, else what differed."""
    device = step.args["capture"].device
    kernel = _clone(step.args)
    gather_pack(**kernel, impl="triton")
    reference = _clone(step.args, **{n: "cpu" for n in step.args})
    gather_pack_reference(**reference)
    if device.type == "cuda":
        torch.cuda.synchronize()
    for name in ("dest", "step_info"):
        a = kernel[name].cpu().contiguous().view(torch.uint8)
        b = reference[name].contiguous().view(torch.uint8)
        if not torch.equal(a, b):
            return f"kernel {name} != reference"
    if device.type == "cuda" and can_write_host_directly(device):
        pinned = _clone(step.args, dest="pinned", step_info="pinned")
        gather_pack(**pinned)
        torch.cuda.synchronize()
        if not torch.equal(pinned["dest"].view(torch.uint8), reference["dest"].view(torch.uint8)):
            return "pinned-host dest != reference"
    ours, theirs = arena_rows(step, reference["dest"]), vllm_host_rows(step)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
            return f"request {i}: arena rows != vLLM host slice"
    return None


def _bench(fn: Callable[[], object]) -> tuple[float, float, float]:
    p50, p20, p80 = triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=QUANTILES)
    return p50 * 1e3, p20 * 1e3, p80 * 1e3  # ms -> us


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


def bench_step(step: Step, peaks: dict[str, float]) -> list[Result]:
    model, args = step.model, step.args
    item = model.dtype.itemsize
    row_in = model.row_elems * 4  # int32 capture
    row_out = model.row_elems * item
    acc, sched = step.accepted_rows, step.sched_rows
    slot_bytes = step.num_slots * HASH_BLOCK * row_out

    device_args = _clone(args)
    direct = can_write_host_directly(args["capture"].device)
    pinned_args = _clone(args, dest="pinned", step_info="pinned") if direct else None
    host_arena = torch.empty(args["dest"].shape, dtype=model.dtype, pin_memory=True)
    host_info = torch.empty(args["step_info"].shape, dtype=torch.int32, pin_memory=True)
    stream = torch.cuda.current_stream()

    def r3_pinned():
        gather_pack(**pinned_args)
        stream.synchronize()

    def r3_staging():
        gather_pack(**device_args)
        host_arena.copy_(device_args["dest"], non_blocking=True)
        host_info.copy_(device_args["step_info"], non_blocking=True)
        stream.synchronize()

    capture = args["capture"]
    providers = [
        # name, fn, timing, HBM bytes, PCIe bytes
        ("r3capture-kernel", lambda: gather_pack(**device_args), "gpu", acc * (row_in + row_out),
         0),
        ("r3capture-pinned", r3_pinned, "wall+sync", acc * row_in, acc * row_out),
        ("r3capture-staging", r3_staging, "wall+sync", acc * (row_in + row_out) + slot_bytes,
         slot_bytes),
        ("vllm-cast", lambda: capture[:sched].to(model.dtype), "gpu", sched * (row_in + row_out),
         0),
        ("vllm", lambda: vllm_host_rows(step), "wall+sync", sched * (row_in + 2 * row_out),
         sched * row_out),
    ]  # fmt: skip
    if not direct:
        print("this GPU cannot write pinned host memory directly: no r3capture-pinned timings")
        providers = [p for p in providers if p[0] != "r3capture-pinned"]
    rows = []
    for name, fn, timing, hbm_bytes, pcie_bytes in providers:
        p50, p20, p80 = _bench(fn)
        seconds = p50 * 1e-6
        hbm_gbps = hbm_bytes / seconds / 1e9
        pcie_gbps = pcie_bytes / seconds / 1e9
        rows.append(
            Result(
                bench="kernel",
                op="gather_pack",
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
    return rows


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
    ax.set_title(f"gather_pack vs vLLM snapshot path — {rows[0].machine}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def run(quick: bool = False, out: Path | None = None) -> tuple[list[Result], list[str]]:
    """Timing rows (empty without CUDA) and the configurations that failed the gate."""
    models = MODELS[:1] + MODELS[2:3] if quick else MODELS
    device = "cuda" if HAS_CUDA else "cpu"
    failures = []
    steps = []
    for i, model in enumerate(models):
        for j, kind in enumerate(STEP_KINDS):
            step = build_step(model, kind, device, seed=100 * i + j, small=not HAS_CUDA)
            problem = gate(step)
            label = f"{model.name:14s} {step.label:24s}"
            print(f"gate {label} rows {step.accepted_rows:5d}/{step.sched_rows:5d}: "
                  f"{'byte-equal' if problem is None else 'MISMATCH: ' + problem}")  # fmt: skip
            if problem is None:
                steps.append(step)
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
    for step in steps:
        step_rows = bench_step(step, peaks)
        rows.extend(step_rows)
        for r in step_rows:
            q = r.params
            print(f"{q['model']:14s} {q['step']:24s} {r.provider:18s} p50 {r.p50:9.1f} us  "
                  f"HBM {q['hbm_gbps']:7.1f} GB/s ({q['hbm_pct_of_peak']:5.1f}%)  "
                  f"PCIe {q['pcie_bytes'] / 1e6:7.3f} MB {q['pcie_gbps']:6.1f} GB/s "
                  f"({q['pcie_pct_of_peak']:5.1f}%)")  # fmt: skip
    if out is not None and rows:
        paths = write_results("kernel_bench", rows, figure=_figure(rows), out_dir=out,
                              extra={"peaks_gbps": peaks})  # fmt: skip
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
