"""Bytes r3capture's slot-ring uploads move to the device per trace (no GPU needed).

``python -m bench.run upload_bytes [--families ...] [--max-num-seqs N ...] [--out DIR]``

A step whose batch or slot ring changed packs its table rows and changed ring entries into a
pinned buffer and copies it to the device before the kernel, on the same stream
(``DeviceSide._upload``). The buffer is sized for every request taking slots at once
(``max_num_seqs + 2 × max_updates`` int32: 43 KiB at 256 sequences, 160 KiB at 1,024);
until 2026-12-02 each upload copied all of it, now the shortest power-of-two prefix that
holds its entries. This replays the host-step traces (``bench/host_step_families.py``, the
same recordings, Qwen3-30B-A3B, depth 2) through r3capture's worker on the CPU and counts,
per upload, the bytes copied and the whole buffer's: the copy engine's work per trace before
and after, by accounting. On a GPU host each 160 KiB copy is a few µs of stream time ahead
of the kernel.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from bench.common import RESULTS_DIR, write_results
from bench.host_step_bench import CACHE
from bench.host_step_families import FAMILIES
from bench.host_step_replay import ensure_recording, replay
from bench.stand_ins import KernelStandIn
from r3capture.aux_output import device_side

MODEL = "Qwen3-30B-A3B"
DEPTH = 2
KIB = 1024


def upload_sizes(family: str, max_num_seqs: int | None) -> list[tuple[int, int]]:
    """``(bytes copied, bytes of the whole buffer)`` of every upload in the trace."""
    from sim.recording import Recording, vllm_metadata_types

    directory = ensure_recording(CACHE, family, MODEL, DEPTH, 0, max_num_seqs)
    sizes: list[tuple[int, int]] = []
    upload = device_side.device_upload

    def counting(dst, src, ring_flat, index, values):
        whole = dst._base if dst._base is not None else dst
        sizes.append((dst.numel() * dst.element_size(), whole.numel() * whole.element_size()))
        upload(dst, src, ring_flat, index, values)

    device_side.device_upload = counting
    try:
        with KernelStandIn() as exclusion:
            replay(
                Recording.load(directory),
                "r3capture",
                exclusion=exclusion,
                metadata_types=vllm_metadata_types(),
            )
    finally:
        device_side.device_upload = upload
    return sizes


def measure(families: list[str], seqs: list[int | None]) -> list[dict]:
    rows = []
    for max_num_seqs in seqs:
        for family in families:
            sizes = np.array(upload_sizes(family, max_num_seqs), dtype=np.int64).reshape(-1, 2)
            rows.append({
                "family": family,
                "max_num_seqs": max_num_seqs or "family's own",
                "uploads": int(len(sizes)),
                "copied_bytes_p50": float(np.median(sizes[:, 0])) if len(sizes) else 0.0,
                "buffer_bytes": int(sizes[0, 1]) if len(sizes) else 0,
                "copied_bytes": int(sizes[:, 0].sum()),
                "whole_buffer_bytes": int(sizes[:, 1].sum()),
            })  # fmt: skip
    return rows


def plot(rows: list[dict]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({str(row["max_num_seqs"]) for row in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(7 * len(groups), 4.2), squeeze=False)
    for ax, group in zip(axes[0], groups):
        mine = [row for row in rows if str(row["max_num_seqs"]) == group]
        x = np.arange(len(mine))
        ax.bar(x - 0.2, [r["whole_buffer_bytes"] / KIB for r in mine], 0.4, label="whole buffer")
        ax.bar(x + 0.2, [r["copied_bytes"] / KIB for r in mine], 0.4, label="prefix (now)")
        ax.set_yscale("log")
        ax.set_xticks(x, [row["family"] for row in mine], rotation=35, fontsize=7)
        ax.set_ylabel("host-to-device upload, KiB per trace")
        ax.set_title(f"{MODEL}, depth {DEPTH}, max_num_seqs: {group}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench.run upload_bytes", description=__doc__)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        nargs="+",
        default=[0, 1024],
        help="engine sizes; 0 = each family's own (default: 0 and vLLM's 1024)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if min(args.max_num_seqs) < 0:
        parser.error("--max-num-seqs must be >= 0")
    torch.set_num_threads(1)
    rows = measure(args.families, [n or None for n in args.max_num_seqs])
    for row in rows:
        print(
            f"{row['family']:18s} seqs {row['max_num_seqs']!s:12s} uploads {row['uploads']:4d} "
            f"p50 {row['copied_bytes_p50'] / KIB:7.2f} KiB of {row['buffer_bytes'] / KIB:7.2f}; "
            f"trace {row['copied_bytes'] / KIB:9.1f} KiB (whole buffer: "
            f"{row['whole_buffer_bytes'] / KIB:9.1f})"
        )
    extra = {"model": MODEL, "depth": DEPTH, "uploads": rows}
    paths = write_results("upload_bytes", [], figure=plot(rows), extra=extra, out_dir=args.out)
    print("wrote", ", ".join(str(p) for p in paths))
    return 0
