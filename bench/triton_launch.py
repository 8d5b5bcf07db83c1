"""Host CPU of one kernel launch on the launching thread: Triton's JIT path against the
compiled variant ``GatherAllocLaunch`` launches directly (no GPU needed).

``python -m bench.run triton_launch [--calls N] [--out DIR]``

On a GPU host every step's ``prepare_output`` pays one ``gather_alloc`` launch on the main
thread. ``bench.run host_step`` stands a tiny torch op in for it (``bench/stand_ins.py``),
as for vLLM's snapshot cast. Here, with ``bench/no_gpu_driver.py`` as Triton's driver (the
kernel compiles for sm_90; the launcher runs nothing), the CPU times what a launch costs
before the driver's C launcher, per call, thread CPU, worker-shaped arguments:

* ``triton_jit``: the grid by ``triton.cdiv``, then ``_gather_alloc_kernel[grid](**kwargs)``,
  Triton's JIT path (binding and specializing every argument, the variant cache, the
  launch): how r3capture launched before it kept its variants;
* ``r3capture_launch``: ``GatherAllocLaunch.launch_checked`` as the worker calls it (the
  batch's ``query_start_loc``, ``positions``, ``idx_mapping``, ``num_rejected``, a launch
  serial and the queue's tail): the variant found by types, launched directly with the
  same arguments;
* ``check_step``: the launcher's per-step checks of the batch's device inputs, which both
  paths follow (for scale);
* ``stand_in``: ``bench.stand_ins.launch_stand_in``, what ``host_step`` charges per launch.

Not included on either path: the driver's C launcher (argument packing, ``cuLaunchKernel``),
which both pay alike. Run where TRITON_INTERPRET is unset.
"""

from __future__ import annotations

import argparse
import importlib
import os
import time
from pathlib import Path

import numpy as np
import torch
import triton

from bench.common import RESULTS_DIR, make_result, run_interleaved, write_results
from bench.models import MODELS
from bench.no_gpu_driver import no_gpu_driver
from bench.stand_ins import launch_stand_in
from r3capture.aux_output.sizing import ring_widths

MAX_NUM_BATCHED_TOKENS = 8192
MAX_NUM_SEQS = 1024
HASH_BLOCK = 16
DEPTH = 2
# The worker's device ring at this budget and depth.
RING_WIDTH = ring_widths(MAX_NUM_BATCHED_TOKENS, HASH_BLOCK, DEPTH)[1]
NUM_SLOTS = 64
QUEUE_SIZE = 4096
QUEUE_TAIL = 7  # entries ever put in the queue: the same for every timed launch
BATCH_SIZES = (1, 8, 256)
CALLS_PER_SAMPLE = 20
PROVIDERS = ("triton_jit", "r3capture_launch", "check_step", "stand_in")


def make_launch(model, *, pass_rejected: bool):
    """A ``GatherAllocLaunch`` on CPU tensors shaped as the worker's state, and its step
    inputs (``query_start_loc`` int32 ``[R+1]``, ``positions`` int64, ``idx_mapping`` int32,
    ``num_rejected`` int32 or None, as Model Runner V2 hands them over)."""
    gather_alloc = importlib.import_module("r3capture.kernels.gather_alloc")
    L, K = model.num_layers, model.top_k
    capture = torch.zeros((MAX_NUM_BATCHED_TOKENS, L, K), dtype=torch.int32)
    dest = torch.zeros((NUM_SLOTS, HASH_BLOCK, L, K), dtype=model.dtype)
    # On a CPU the launcher refuses impl="triton" outside the interpreter (nothing could
    # run it); with the no-GPU driver nothing runs, so the place check is skipped.
    check_place = gather_alloc._check_triton_place
    gather_alloc._check_triton_place = lambda *args: None
    try:
        launch = gather_alloc.GatherAllocLaunch(
            capture,
            torch.full((MAX_NUM_SEQS, RING_WIDTH), -1, dtype=torch.int64),
            torch.zeros((MAX_NUM_SEQS, 2), dtype=torch.int64),
            torch.zeros(QUEUE_SIZE, dtype=torch.int32),
            torch.zeros(4, dtype=torch.int64),
            dest,
            torch.zeros((MAX_NUM_SEQS, 4), dtype=torch.int32),
            impl="triton",
        )
    finally:
        gather_alloc._check_triton_place = check_place

    def step_inputs(num_reqs: int):
        qsl = torch.arange(num_reqs + 1, dtype=torch.int32)
        positions = torch.zeros(MAX_NUM_BATCHED_TOKENS, dtype=torch.int64)
        index = torch.arange(num_reqs, dtype=torch.int32)
        rejected = torch.zeros(num_reqs, dtype=torch.int32) if pass_rejected else None
        return qsl, positions, index, rejected

    return launch, step_inputs


def jit_launch(launch, shape, qsl, positions, index, rejected, fresh=None):
    """What ``launch_checked`` does after its checks without its variants: the grid by
    ``triton.cdiv``, then the JIT call, every step. Returns the compiled variant the JIT
    launched."""
    gather_alloc = importlib.import_module("r3capture.kernels.gather_alloc")
    unused = launch._args["heads"]
    kwargs = dict(
        launch._kernel_args,
        qsl_ptr=qsl,
        pos_ptr=positions,
        idx_ptr=index,
        rejected_ptr=rejected if rejected is not None else unused,
        fresh_ptr=fresh if fresh is not None else unused,
        num_reqs=shape.num_reqs,
        row_limit=shape.row_limit,
        num_steps=(shape.num_reqs - 1).bit_length(),
        launch=shape.launch,
        queue_tail=shape.queue_tail,
        HAS_REJECTED=rejected is not None,
        HAS_FRESH=fresh is not None,
    )
    tiles = launch._tiles
    grid = (
        max(
            triton.cdiv(shape.row_limit, tiles["BLOCK_ROWS"]),
            triton.cdiv(shape.num_reqs, tiles["BLOCK_REQS"]),
        ),
    )
    return gather_alloc._gather_alloc_kernel[grid](**kwargs)


def _timed(call) -> np.ndarray:
    """(wall, thread CPU) nanoseconds per call, over ``CALLS_PER_SAMPLE`` calls."""
    wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
    for _ in range(CALLS_PER_SAMPLE):
        call()
    cpu, wall = time.thread_time_ns() - cpu, time.perf_counter_ns() - wall
    return np.array([wall // CALLS_PER_SAMPLE, cpu // CALLS_PER_SAMPLE])


def _providers(launch, shape, qsl, positions, index, rejected) -> dict:
    """One timed sample per provider (``run_interleaved``'s round index unused). Nothing
    runs, so every launch may pass the same serial."""
    return {
        "triton_jit": lambda _: _timed(
            lambda: jit_launch(launch, shape, qsl, positions, index, rejected)
        ),
        "r3capture_launch": lambda _: _timed(
            lambda: launch.launch_checked(shape, qsl, positions, index, rejected, None)
        ),
        "check_step": lambda _: _timed(
            lambda: launch.check_step(
                qsl,
                positions,
                index,
                rejected,
                None,
                launch=shape.launch,
                queue_tail=shape.queue_tail,
                num_rows=shape.row_limit,
            )  # fmt: skip
        ),
        "stand_in": lambda _: _timed(launch_stand_in),
    }


def measure(calls: int) -> list:
    rows = []
    repeats = max(1, calls // CALLS_PER_SAMPLE)
    for model in [m for m in MODELS if m.name in ("Qwen3-30B-A3B", "Kimi-K2")]:
        for pass_rejected in (True, False):
            launch, step_inputs = make_launch(model, pass_rejected=pass_rejected)
            for num_reqs in BATCH_SIZES:
                qsl, positions, index, rejected = step_inputs(num_reqs)
                shape = launch.check_step(
                    qsl, positions, index, rejected, None, launch=1, queue_tail=QUEUE_TAIL,
                    num_rows=num_reqs,
                )  # fmt: skip
                # The first launch compiles (or finds) the variant; the bench times later ones.
                launch.launch_checked(shape, qsl, positions, index, rejected, None)
                providers = _providers(launch, shape, qsl, positions, index, rejected)
                samples = run_interleaved(providers, repeats=repeats)
                for provider in PROVIDERS:
                    rows.append(
                        make_result(
                            "triton_launch",
                            "launch",
                            [num_reqs, model.num_layers, model.top_k],
                            str(model.np_dtype),
                            provider,
                            samples[provider],
                            model=model.name,
                            num_reqs=num_reqs,
                            num_rejected=pass_rejected,
                            calls_per_sample=CALLS_PER_SAMPLE,
                        )
                    )
    return rows


def plot(rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted(
        {(r.params["model"], r.params["num_reqs"], r.params["num_rejected"]) for r in rows},
        key=lambda k: (k[0], k[2], k[1]),
    )
    fig, ax = plt.subplots(figsize=(11, 4.2))
    width = 0.2
    for i, provider in enumerate(PROVIDERS):
        values = []
        for model, num_reqs, rejected in labels:
            (row,) = [
                r
                for r in rows
                if r.provider == provider
                and (r.params["model"], r.params["num_reqs"], r.params["num_rejected"])
                == (model, num_reqs, rejected)
            ]
            values.append(row.params["cpu_p50"])
        ax.bar([x + (i - 1.5) * width for x in range(len(labels))], values, width, label=provider)
    ax.set_xticks(
        range(len(labels)),
        [f"{m.split('-')[0]}\nR={n}{'' if rej else ', no rej.'}" for m, n, rej in labels],
        fontsize=7,
    )
    ax.set_ylabel("thread CPU per launch, µs (p50)")
    ax.set_title("Host CPU of one gather_alloc launch (driver launch excluded), sm_90 variant")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench.run triton_launch", description=__doc__)
    parser.add_argument("--calls", type=int, default=4000, help="timed calls per provider")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error("--calls must be >= 1")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("bench.run triton_launch: unset TRITON_INTERPRET (the interpreter launches nothing)")
        return 2
    torch.set_num_threads(1)
    with no_gpu_driver(90):
        rows = measure(args.calls)
    for row in rows:
        p = row.params
        print(
            f"{p['model']:14s} R={p['num_reqs']:4d} rejected={p['num_rejected']!s:5s} "
            f"{row.provider:17s} cpu p50 {p['cpu_p50']:6.2f} µs  p80 {p['cpu_p80']:6.2f}"
        )
    extra = {"arch": "sm_90", "ring_width": RING_WIDTH, "max_num_seqs": MAX_NUM_SEQS,
             "kernel": "gather_alloc"}  # fmt: skip
    paths = write_results("triton_launch", rows, figure=plot(rows), extra=extra, out_dir=args.out)
    print("wrote", ", ".join(str(p) for p in paths))
    return 0
