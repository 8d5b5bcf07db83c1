"""Device memory each connector adds to the capture path, by accounting (no GPU needed).

``python -m bench.run device_memory [--max-num-seqs N ...] [--out DIR]``

Both connectors share vLLM's int32 capture buffer ``[max_num_batched_tokens, L, K]``; what
each adds on the device:

* r3capture: the buffers ``DeviceSide`` keeps on the device for the kernel that takes its
  slots itself: per request index a ring of slots ``[max_num_seqs, D]`` int64 and two
  records ``[max_num_seqs, 2]`` int64, and ``heads [4]`` int64 (the queue's two heads,
  the last launch's serial and a count of finished programs; direct writes keep
  ``step_info`` in pinned host memory, and the free-slot queue is pinned host memory too,
  int32 ``[queue_stock + blocks_per_step]``: reported apart, as
  ``r3capture_queue_host_bytes``), read from a worker built on the CPU with the sizing
  ``vllm serve`` would give it (``DeviceSide.device_bytes``; the same tensors a GPU worker
  allocates, for any model: none depends on ``L``, ``K`` or the dtype);
* vLLM 0.33.0: the per-step snapshot its connector casts from the capture buffer,
  ``[num_tokens, L, K]`` in the row dtype, up to ``max_num_batched_tokens`` rows, one per
  step in flight until its copy to the host is done.

``bench.run nvml`` measures both on a GPU (allocator peaks and NVML); this is the arithmetic
it should confirm.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.common import RESULTS_DIR, write_results
from bench.models import MODELS, ModelShape
from r3capture.aux_output.sizing import WorkerSizing, row_dtype
from r3capture.aux_output.worker import TritonAuxOutputWorker

MAX_NUM_BATCHED_TOKENS = 8192
HASH_BLOCK = 16
DEPTH = 2  # steps in flight under async scheduling
MIB = 2**20


def r3capture_device_bytes(model: ModelShape, max_num_seqs: int) -> int:
    """``DeviceSide.device_bytes`` of a worker sized as ``vllm serve`` sizes it."""
    return r3capture_bytes(model, max_num_seqs)[0]


def r3capture_bytes(model: ModelShape, max_num_seqs: int) -> tuple[int, int]:
    """``(device bytes, pinned host bytes of the free-slot queue)`` of a worker sized as
    ``vllm serve`` sizes it."""
    sizing = WorkerSizing(
        shape_per_token=(model.num_layers, model.top_k),
        dtype=row_dtype(model.num_experts),
        hash_block_size=HASH_BLOCK,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_concurrent_batches=DEPTH,
        max_bytes=64 * MIB,
    )
    worker = TritonAuxOutputWorker(
        sizing,
        destination="direct",
        kernel_impl="reference",
        output_pool_bytes=0,
    )
    try:
        side = worker.device_side
        return side.device_bytes, side.queue_np.nbytes
    finally:
        worker.close()


def vllm_snapshot_bytes(model: ModelShape) -> int:
    """One step's snapshot at a full token budget."""
    return MAX_NUM_BATCHED_TOKENS * model.row_elems * model.np_dtype.itemsize


def measure(seqs: list[int]) -> list[dict]:
    rows = []
    for max_num_seqs in seqs:
        for model in MODELS:
            ours, queue = r3capture_bytes(model, max_num_seqs)
            snapshot = vllm_snapshot_bytes(model)
            rows.append({
                "model": model.name,
                "max_num_seqs": max_num_seqs,
                "r3capture_bytes": ours,
                "r3capture_queue_host_bytes": queue,
                "vllm_snapshot_bytes": snapshot,
                "vllm_in_flight_bytes": DEPTH * snapshot,
            })  # fmt: skip
    return rows


def plot(rows: list[dict]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seqs = sorted({row["max_num_seqs"] for row in rows})
    fig, axes = plt.subplots(1, len(seqs), figsize=(6 * len(seqs), 4.2), squeeze=False)
    for ax, max_num_seqs in zip(axes[0], seqs):
        mine = [row for row in rows if row["max_num_seqs"] == max_num_seqs]
        x = range(len(mine))
        width = 0.27
        series = (
            ("r3capture", "r3capture_bytes"),
            ("vLLM, one snapshot", "vllm_snapshot_bytes"),
            (f"vLLM, {DEPTH} in flight", "vllm_in_flight_bytes"),
        )
        for i, (label, key) in enumerate(series):
            ax.bar(
                [p + (i - 1) * width for p in x], [r[key] / MIB for r in mine], width, label=label
            )
        ax.set_xticks(list(x), [row["model"] for row in mine], rotation=20, fontsize=8)
        ax.set_ylabel("extra device memory, MiB")
        ax.set_title(f"max_num_seqs = {max_num_seqs}, {MAX_NUM_BATCHED_TOKENS}-token budget")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench.run device_memory", description=__doc__)
    parser.add_argument("--max-num-seqs", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if min(args.max_num_seqs) < 1:
        parser.error("--max-num-seqs must be >= 1")
    torch.set_num_threads(1)
    rows = measure(args.max_num_seqs)
    for row in rows:
        print(
            f"max_num_seqs {row['max_num_seqs']:5d} {row['model']:14s} r3capture "
            f"{row['r3capture_bytes'] / MIB:6.2f} MiB (queue, pinned host "
            f"{row['r3capture_queue_host_bytes'] / MIB:5.2f})  vLLM snapshot "
            f"{row['vllm_snapshot_bytes'] / MIB:6.2f} MiB ({DEPTH} in flight "
            f"{row['vllm_in_flight_bytes'] / MIB:6.2f})"
        )
    extra = {
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "hash_block": HASH_BLOCK,
        "depth": DEPTH,
        "memory": rows,
    }
    paths = write_results("device_memory", [], figure=plot(rows), extra=extra, out_dir=args.out)
    print("wrote", ", ".join(str(p) for p in paths))
    return 0
