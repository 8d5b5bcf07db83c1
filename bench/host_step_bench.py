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

from bench.step_traces import KIMI_K2, PRESETS, QWEN3_30B_A3B, ModelShape, build_trace
from r3capture.aux_output.sim.workers import WorkerSizes, make_r3capture_worker, make_vllm_worker

BLOCK_SIZE = 16


def _sizes(shape: ModelShape, max_tokens: int, max_seqs: int, steps) -> WorkerSizes:
    row_bytes = shape.num_layers * shape.top_k * shape.dtype.itemsize
    total_rows = sum(step.num_rows for step in steps)
    # Room for every block of the trace: eviction is not what this benchmark measures.
    max_bytes = (total_rows // BLOCK_SIZE + 64) * BLOCK_SIZE * row_bytes * 2
    return WorkerSizes(
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


def _run_step(handle, step, torch_rows):
    t0 = time.perf_counter_ns()
    handle.begin_step(step.metadata)
    t1 = time.perf_counter_ns()
    if step.num_rows:
        handle.capture_buffer[: step.num_rows].copy_(torch_rows)
    t2 = time.perf_counter_ns()
    pending = handle.prepare_output(step.input_batch(), step.num_rejected)
    pending.enqueue_cpu_copy(step.num_sampled, step.num_rejected)
    t3 = time.perf_counter_ns()
    outputs = pending.process_output()
    t4 = time.perf_counter_ns()
    return outputs, (t1 - t0) + (t4 - t3), t3 - t2


def bench_preset(shape: ModelShape, preset: str, seed: int = 0) -> list[dict]:
    import torch

    steps, max_tokens, max_seqs = build_trace(preset, shape, block_size=BLOCK_SIZE, seed=seed)
    sizes = _sizes(shape, max_tokens, max_seqs, steps)
    handles = {
        "vllm-0.33.0": make_vllm_worker(sizes),
        "r3capture": make_r3capture_worker(sizes, kernel_impl="reference"),
    }
    host = {name: [] for name in handles}
    prepare = {name: [] for name in handles}
    identical = True
    row_bytes = shape.num_layers * shape.top_k * shape.dtype.itemsize
    vllm_bytes, our_bytes = [], []
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for index, step in enumerate(steps):
            torch_rows = torch.from_numpy(step.rows)
            order = list(handles) if index % 2 == 0 else list(reversed(handles))
            results = {}
            for name in order:
                outputs, host_ns, prep_ns = _run_step(handles[name], step, torch_rows)
                results[name] = outputs
                if step.timed:
                    host[name].append(host_ns / 1e3)
                    prepare[name].append(prep_ns / 1e3)
            identical &= _same(results["vllm-0.33.0"], results["r3capture"])
            if step.timed:
                vllm_bytes.append(step.num_rows * row_bytes)
                our_bytes.append(step.accepted_rows * row_bytes)
    finally:
        if gc_was_enabled:
            gc.enable()
        for handle in handles.values():
            handle.close()

    rows = []
    for name in handles:
        times = np.asarray(host[name])
        prep = np.asarray(prepare[name])
        rows.append(
            {
                "op": "host_step",
                "preset": preset,
                "shape": f"{shape.name} {shape.num_layers}x{shape.top_k}",
                "dtype": shape.dtype.name,
                "provider": name,
                "unit": "us",
                "p50": float(np.median(times)),
                "p20": float(np.percentile(times, 20)),
                "p80": float(np.percentile(times, 80)),
                "p90": float(np.percentile(times, 90)),
                "prepare_p50": float(np.median(prep)),
                "steps": len(times),
                "bytes_to_host_per_step": float(
                    np.mean(vllm_bytes if name.startswith("vllm") else our_bytes)
                ),
                "outputs_identical": bool(identical),
            }
        )
    if identical:
        ours, theirs = rows[1], rows[0]
        ours["speedup_p50_vs_vllm"] = theirs["p50"] / ours["p50"]
        ours["speedup_p90_vs_vllm"] = theirs["p90"] / ours["p90"]
    return rows


def run(quick: bool = False) -> list[dict]:
    shapes = [QWEN3_30B_A3B] if quick else [QWEN3_30B_A3B, KIMI_K2]
    results = []
    for shape in shapes:
        for preset in PRESETS:
            rows = bench_preset(shape, preset)
            results.extend(rows)
            ours = rows[1]
            ratio = ours.get("speedup_p50_vs_vllm")
            print(
                f"{shape.name:14s} {preset:12s} vllm p50 {rows[0]['p50']:9.1f} us  "
                f"r3capture p50 {ours['p50']:8.1f} us  "
                + (f"ratio {ratio:5.1f}x" if ratio else "OUTPUTS DIFFER: no ratio")
                + f"  bytes/step {rows[0]['bytes_to_host_per_step']:.0f} -> "
                f"{ours['bytes_to_host_per_step']:.0f}",
                flush=True,
            )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Qwen3 shape only")
    args = parser.parse_args(argv)
    results = run(quick=args.quick)
    return 0 if all(r["outputs_identical"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
