"""Host time per step: r3capture's worker connector vs vLLM 0.33.0's, on the same traces.

Both connectors replay the same pre-built steps (``bench/step_traces.py``) in one process,
interleaved step by step. Timed: ``begin_step`` + ``process_output`` (the host work the
design targets), and separately ``prepare_output`` + ``enqueue_cpu_copy``. Every step's
outputs are compared byte for byte first; a preset whose outputs differ gets no ratio.

On a CPU machine ``prepare_output`` includes the gather kernel's work (the torch reference
stands in for the GPU), so it is reported but not part of the headline ratio. Bytes per step
that cross to the host: vLLM copies every scheduled row; r3capture only accepted rows.

    python -m bench.run host_step [--quick]
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np

from bench.common import Result, make_result, write_results
from bench.models import KIMI_K2, QWEN3_30B_A3B, ModelShape
from bench.step_traces import PRESETS, build_trace
from sim.workers import WorkerSizing, make_r3capture_worker, make_vllm_worker

BLOCK_SIZE = 16


def _sizes(shape: ModelShape, max_tokens: int, max_seqs: int, steps) -> WorkerSizing:
    row_bytes = shape.num_layers * shape.top_k * shape.np_dtype.itemsize
    total_rows = sum(step.num_rows for step in steps)
    # Room for every block of the trace: eviction is not what this benchmark measures.
    max_bytes = (total_rows // BLOCK_SIZE + 64) * BLOCK_SIZE * row_bytes * 2
    return WorkerSizing.for_model(
        num_layers=shape.num_layers,
        top_k=shape.top_k,
        num_experts=shape.num_experts,
        hash_block_size=BLOCK_SIZE,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max_tokens,
        max_concurrent_batches=1,
        max_bytes=max_bytes,
    )


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for key, out in a.items():
        other = b[key]
        if out.token_start != other.token_start:
            return False
        x, y = np.asarray(out.rows), np.asarray(other.rows)
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            return False
    return True


def _drain_writer(handle) -> None:
    """Wait for vLLM's background store writer (its store work happens off the step)."""
    queue = getattr(getattr(handle.worker, "_store", None), "_queue", None)
    if queue is not None:
        queue.join()


def _run_step(handle, step, torch_rows):
    """Returns outputs, (wall ns, thread CPU ns) of begin+process, wall ns of prepare, and
    wall ns of begin+process+writer drain."""
    wall, cpu = time.perf_counter_ns, time.thread_time_ns
    w0, c0 = wall(), cpu()
    handle.begin_step(step.metadata)
    w1, c1 = wall(), cpu()
    if step.num_rows:
        handle.capture_buffer[: step.num_rows].copy_(torch_rows)
    w2 = wall()
    pending = handle.prepare_output(step.input_batch(), step.num_rejected)
    pending.enqueue_cpu_copy(step.num_sampled, step.num_rejected)
    w3, c3 = wall(), cpu()
    outputs = pending.process_output()
    w4, c4 = wall(), cpu()
    _drain_writer(handle)
    w5 = wall()
    host = ((w1 - w0) + (w4 - w3), (c1 - c0) + (c4 - c3))
    return outputs, host, w3 - w2, (w1 - w0) + (w5 - w3)


def bench_preset(shape: ModelShape, preset: str, seed: int = 0, repeats: int = 3) -> list[Result]:
    """Replay the preset's trace ``repeats`` times (fresh connectors each time) and pool the
    timed steps: presets with few steps (prefill) get enough samples for a stable median."""
    import torch

    steps, max_tokens, max_seqs = build_trace(preset, shape, block_size=BLOCK_SIZE, seed=seed)
    sizes = _sizes(shape, max_tokens, max_seqs, steps)
    names = ("vllm-0.33.0", "r3capture")
    host = {name: [] for name in names}
    prepare = {name: [] for name in names}
    drained = {name: [] for name in names}
    identical = True
    row_bytes = shape.num_layers * shape.top_k * shape.np_dtype.itemsize
    vllm_bytes, our_bytes = [], []
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            handles = {
                "vllm-0.33.0": make_vllm_worker(sizes),
                "r3capture": make_r3capture_worker(sizes, kernel_impl="reference"),
            }
            try:
                for index, step in enumerate(steps):
                    torch_rows = torch.from_numpy(step.rows)
                    order = list(handles) if index % 2 == 0 else list(reversed(handles))
                    results = {}
                    for name in order:
                        outputs, host_ns, prep_ns, drained_ns = _run_step(
                            handles[name], step, torch_rows
                        )
                        results[name] = outputs
                        if step.timed:
                            host[name].append(host_ns)
                            prepare[name].append(prep_ns)
                            drained[name].append(drained_ns)
                    identical &= _same(results["vllm-0.33.0"], results["r3capture"])
                    if step.timed:
                        vllm_bytes.append(step.num_rows * row_bytes)
                        our_bytes.append(step.accepted_rows * row_bytes)
                    gc.collect(0)
            finally:
                for handle in handles.values():
                    handle.close()
    finally:
        if gc_was_enabled:
            gc.enable()

    rows = []
    for name in names:
        samples = np.asarray(host[name], dtype=np.int64)
        rows.append(
            make_result(
                "host_step",
                f"begin_step+process_output/{preset}",
                [shape.num_layers, shape.top_k],
                shape.np_dtype.name,
                name,
                samples,
                preset=preset,
                model=shape.name,
                p90=float(np.percentile(samples[:, 0], 90)) / 1e3,
                with_writer_drain_p50=float(np.median(drained[name])) / 1e3,
                prepare_p50=float(np.median(prepare[name])) / 1e3,
                steps=len(samples),
                bytes_to_host_per_step=float(
                    np.mean(vllm_bytes if name.startswith("vllm") else our_bytes)
                ),
                outputs_identical=bool(identical),
            )
        )
    theirs, ours = rows
    if identical:
        ours.params["ratio_p50"] = theirs.p50 / ours.p50
        ours.params["ratio_cpu_p50"] = theirs.params["cpu_p50"] / ours.params["cpu_p50"]
        ours.params["ratio_p90"] = theirs.params["p90"] / ours.params["p90"]
        ours.params["ratio_with_writer_p50"] = (
            theirs.params["with_writer_drain_p50"] / ours.params["with_writer_drain_p50"]
        )
    return rows


def _figure(results: list[Result]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r.params["model"] for r in results})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = [r for r in results if r.params["model"] == model]
        presets = [r.params["preset"] for r in rows if r.provider == "r3capture"]
        x = np.arange(len(presets))
        for offset, provider in ((-0.2, "vllm-0.33.0"), (0.2, "r3capture")):
            values = [r.p50 for r in rows if r.provider == provider]
            ax.bar(x + offset, values, width=0.4, label=provider)
        for i, r in enumerate(r for r in rows if r.provider == "r3capture"):
            if "ratio_p50" in r.params:
                ax.annotate(
                    f"{r.params['ratio_p50']:.1f}x",
                    (i + 0.2, r.p50),  # over r3capture's bar
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
        ax.set_xticks(x, presets)
        ax.set_yscale("log")
        ax.set_ylabel("host us per step (begin_step + process_output), p50")
        ax.set_title(f"{model}: ratio = vLLM 0.33.0 / r3capture")
        ax.legend()
    return fig


def run(quick: bool = False) -> list[Result]:
    shapes = [QWEN3_30B_A3B] if quick else [QWEN3_30B_A3B, KIMI_K2]
    results = []
    for shape in shapes:
        for preset in PRESETS:
            theirs, ours = bench_preset(shape, preset)
            results.extend((theirs, ours))
            ratio = ours.params.get("ratio_p50")
            print(
                f"{shape.name:14s} {preset:12s} vllm p50 {theirs.p50:9.1f} us  "
                f"r3capture p50 {ours.p50:8.1f} us  "
                + (
                    f"ratio {ratio:5.1f}x (cpu {ours.params['ratio_cpu_p50']:.1f}x, "
                    f"with writer {ours.params['ratio_with_writer_p50']:.1f}x)"
                    if ratio
                    else "OUTPUTS DIFFER: no ratio"
                )
                + f"  bytes/step {theirs.params['bytes_to_host_per_step']:.0f} -> "
                f"{ours.params['bytes_to_host_per_step']:.0f}",
                flush=True,
            )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Qwen3 shape only")
    args = parser.parse_args(argv)
    results = run(quick=args.quick)
    identical = all(r.params["outputs_identical"] for r in results)
    write_results(
        "host_step",
        results,
        figure=_figure(results),
        extra={"note": "CPU-only run: prepare_output includes the torch reference kernel"},
    )
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
