"""Main-thread host cost on a CUDA GPU: r3capture's worker against vLLM 0.33.0's GPU path.

``bench/host_step`` times both connectors on a CPU, where stand-ins replace every launch.
This benchmark times the real thing on a GPU, on the same trace families
(``bench/host_step_families.py``, async depth 2):

  r3capture-direct   the worker with the Triton kernel writing the pinned host arena and
                     ``step_info``: ``begin_step``, ``prepare_output`` (the checks and the
                     real launch; the kernel takes its own slots) and ``enqueue_cpu_copy``
                     (no copy to start) on the main thread; ``process_output`` after the
                     step's copy event
  r3capture-staging  the same with device staging: ``enqueue_cpu_copy`` starts the copies
                     of ``step_info`` and of the step's rows
  vllm-gpu-path      a torch-only rendering of vLLM 0.33.0's GPU path (vLLM is not on the GPU
                     machine), driven by the same simulator: ``prepare_output`` is the
                     snapshot cast of every scheduled row to the narrow dtype (a new device
                     tensor), ``enqueue_cpu_copy`` its ``.to("cpu", non_blocking=True)``.
                     vLLM's Python bookkeeping around them (``begin_step``, the pending list,
                     the lock, ``process_output``'s commit) is not in it: this side is a lower
                     bound of vLLM's main thread (``bench/host_step`` measures that
                     bookkeeping on a CPU).

Every side runs inside the simulator (``sim/``), which computes each step's rows between
the calls, as an engine runs a forward between them: caches are as cold for one side as for
the other (a tight loop of launches alone would flatter whichever side it timed). Both run
``enqueue_cpu_copy`` as Model Runner V2 does: on a copy stream that waited for the main
stream, followed by a blocking event that the output side synchronizes
(``sim/copy_stream.py``). Every call is timed by wall clock and by the calling thread's CPU
clock; the kernel, the copies and the waits for the event are not in any call. Each side
runs in its own fresh process, rounds alternated (the order reversed every other round);
each process first runs a short trace of its own so that Triton's compilation and the first
allocations are not in a timed step. r3capture's rows are checked against the routing
oracle after every timed trace.

    python -m bench.gpu_host_step [--families F,...] [--model NAME] [--rounds N] [--out DIR]

Without CUDA it exits with code 3 and one line saying so.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import RESULTS_DIR

FAMILIES = ("decode-256", "prefill", "spec-k3")
SIDES = ("r3capture-direct", "r3capture-staging", "vllm-gpu-path")
CALLS = ("begin_step", "prepare_output", "enqueue_cpu_copy", "process_output")
MAIN_CALLS = CALLS[:3]
DEPTH = 2
NO_CUDA_EXIT = 3


class CallTimes:
    """Per call and step: wall and thread-CPU ns, ``[len(CALLS), steps, 2]`` int64."""

    def __init__(self) -> None:
        self._samples: list[tuple[int, int, int, int]] = []

    def timed(self, call: str, step: int, fn: Any, *args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter_ns, time.thread_time_ns
        w0, c0 = wall(), cpu()
        result = fn(*args, **kwargs)
        c1, w1 = cpu(), wall()
        self._samples.append((CALLS.index(call), step, w1 - w0, c1 - c0))
        return result

    def array(self, steps: int) -> np.ndarray:
        out = np.zeros((len(CALLS), steps, 2), np.int64)
        for call, step, wall_ns, cpu_ns in self._samples:
            out[call, step] += (wall_ns, cpu_ns)
        return out


class _TimedPending:
    """A worker's pending step whose two later calls are timed."""

    def __init__(self, pending: Any, step: int, times: CallTimes) -> None:
        self._pending, self._step, self._times = pending, step, times

    def enqueue_cpu_copy(self, **counts: Any) -> None:
        self._times.timed("enqueue_cpu_copy", self._step, self._pending.enqueue_cpu_copy, **counts)

    def process_output(self) -> Any:
        return self._times.timed("process_output", self._step, self._pending.process_output)


def timed_r3capture_factory(
    destination: str, times: CallTimes, steps: list[tuple[int, int]], device: str = "cuda"
):
    """A ``run_trace`` worker factory: r3capture on ``device`` (the Triton kernel on CUDA,
    the torch reference on a CPU) with every worker call timed; each step's (rows,
    requests) is appended to ``steps`` (index = step; (0, 0) for a step without a forward)."""
    from sim.workers import make_r3capture_worker

    kernel_impl = "triton" if device == "cuda" else "reference"

    def factory(sizes: Any) -> Any:
        handle = make_r3capture_worker(
            sizes, kernel_impl=kernel_impl, device=device, destination=destination
        )
        _time_worker_calls(handle.worker, times, steps)
        return handle

    return factory


def _time_worker_calls(worker: Any, times: CallTimes, steps: list[tuple[int, int]]) -> None:
    """Replace ``worker``'s calls by timed ones; each step's (rows, requests) goes to
    ``steps`` (index = step; (0, 0) for a step without a forward)."""
    begin, prepare = worker.begin_step, worker.prepare_output
    state = {"step": -1}

    def begin_step(metadata: Any) -> None:
        state["step"] += 1
        steps.append((0, 0))
        times.timed("begin_step", state["step"], begin, metadata)

    def prepare_output(batch: Any, **kwargs: Any) -> Any:
        step = state["step"]
        steps[step] = (int(batch.query_start_loc_np[batch.num_reqs]), batch.num_reqs)
        pending = times.timed("prepare_output", step, prepare, batch, **kwargs)
        return None if pending is None else _TimedPending(pending, step, times)

    worker.begin_step, worker.prepare_output = begin_step, prepare_output


def bench_trace(family: str, model: str, seed: int) -> Any:
    """The host-step family's simulator trace for ``model`` at async depth 2."""
    from bench.host_step_replay import family_trace

    return family_trace(family, model, DEPTH, seed)


class _VllmGpuPath:
    """The GPU half of vLLM 0.33.0's worker connector, timed, as a worker the simulator can
    drive: ``prepare_output`` casts the step's scheduled rows to the narrow dtype (a new
    device tensor, ``snapshot_routing_data``), ``enqueue_cpu_copy`` copies that to the host
    with ``.to("cpu", non_blocking=True)``. Only those two operations are timed. The
    simulator also needs outputs: an untimed r3capture worker on the CPU (reference kernel,
    a capture buffer of zeros) makes them, so the rows are not the oracle's."""

    def __init__(self, sizes: Any, device: str, times: CallTimes, steps: list) -> None:
        import torch

        from r3capture.aux_output.worker import TritonAuxOutputWorker

        self.capture_buffer = torch.zeros(
            (sizes.max_num_batched_tokens, *sizes.shape_per_token), dtype=torch.int32,
            device=device,
        )  # fmt: skip
        self._dtype = getattr(torch, sizes.dtype.name)
        self._outputs = TritonAuxOutputWorker(sizes, device="cpu", kernel_impl="reference")
        self._times, self._steps = times, steps

    def begin_step(self, metadata: Any) -> None:
        self._steps.append((0, 0))
        self._outputs.begin_step(metadata)

    def prepare_output(self, batch: Any, num_rejected: Any = None) -> Any:
        step = len(self._steps) - 1
        rows = int(batch.query_start_loc_np[len(batch.req_ids)])
        self._steps[step] = (rows, len(batch.req_ids))
        snapshot = self._times.timed("prepare_output", step, _cast, self.capture_buffer, rows,
                                     self._dtype)  # fmt: skip
        batch.query_start_loc = batch.query_start_loc.cpu()
        batch.positions = batch.positions.cpu()
        rejected = None if num_rejected is None else num_rejected.cpu()
        pending = self._outputs.prepare_output(batch, num_rejected=rejected)
        if pending is None:
            return None
        return _VllmGpuPathPending(pending, snapshot, step, self._times)

    def close(self) -> None:
        self._outputs.close()


def _cast(capture: Any, rows: int, dtype: Any) -> Any:
    return capture[:rows].to(dtype)  # vLLM's snapshot_routing_data


def _to_host(snapshot: Any) -> Any:
    return snapshot.to("cpu", non_blocking=True)  # vLLM's enqueue_cpu_copy


class _VllmGpuPathPending:
    """One step of ``_VllmGpuPath``: its snapshot and its host copy (timed), and the output
    worker's pending step (untimed)."""

    def __init__(self, pending: Any, snapshot: Any, step: int, times: CallTimes) -> None:
        self._pending, self._snapshot, self._step, self._times = pending, snapshot, step, times
        self._host: Any = None

    def enqueue_cpu_copy(self, **counts: Any) -> None:
        self._host = self._times.timed("enqueue_cpu_copy", self._step, _to_host, self._snapshot)
        self._pending.enqueue_cpu_copy(**counts)

    def process_output(self) -> Any:
        self._snapshot = self._host = None
        return self._pending.process_output()


def timed_vllm_gpu_path_factory(times: CallTimes, steps: list[tuple[int, int]], device: str):
    """Like ``timed_r3capture_factory``, for ``_VllmGpuPath``."""
    from sim.workers import WorkerHandle

    def factory(sizes: Any) -> Any:
        worker = _VllmGpuPath(sizes, device, times, steps)

        def prepare(batch: Any, num_rejected: Any) -> Any:
            import torch

            return worker.prepare_output(batch, torch.from_numpy(num_rejected.copy()))

        return WorkerHandle("vllm-gpu-path", worker, worker.capture_buffer, prepare, lambda: -1)

    return factory


def run_sides(side: str, families: list[str], model: str, seed: int, device: str = "cuda") -> dict:
    """Time one side on ``families``; per family the call times and the step sizes."""
    from sim import run_trace

    def factory(times: CallTimes, steps: list[tuple[int, int]]) -> Any:
        if side == "vllm-gpu-path":
            return timed_vllm_gpu_path_factory(times, steps, device)
        return timed_r3capture_factory(side.removeprefix("r3capture-"), times, steps, device)

    # Compile (or load) the kernel and warm the allocators outside the timed traces.
    run_trace(bench_trace("decode-8", model, seed), factory(CallTimes(), []), check=False)
    out = {}
    for family in families:
        times, steps = CallTimes(), []
        # r3capture's rows are checked against the routing oracle after the run; the vLLM
        # rendering makes no outputs to check.
        check = side != "vllm-gpu-path"
        run_trace(bench_trace(family, model, seed), factory(times, steps), check=check)
        out[family] = {"calls": times.array(len(steps)).tolist(), "steps": steps}
    return out


def _child(args: argparse.Namespace) -> int:
    families = args.families.split(",")
    result = run_sides(args.side, families, args.model, args.seed, args.device)
    Path(args.json).write_text(json.dumps(result))
    return 0


def step_stats(per_step_us: np.ndarray) -> dict[str, float]:
    """p50, p90 and total of per-step µs, and how many steps."""
    if per_step_us.size == 0:
        return {"p50": 0.0, "p90": 0.0, "total": 0.0, "steps": 0}
    return {
        "p50": round(float(np.percentile(per_step_us, 50)), 2),
        "p90": round(float(np.percentile(per_step_us, 90)), 2),
        "total": round(float(per_step_us.sum()), 1),
        "steps": int(per_step_us.size),
    }


def summarize(runs: dict[str, list[dict]], families: list[str]) -> dict:
    """Per family and side: p50/p90/total µs (thread CPU and wall) over the forward steps of
    every round, per call and for the main thread, and the ratio vLLM / r3capture."""
    summary: dict[str, Any] = {}
    for family in families:
        per_side = {}
        for side, rounds in runs.items():
            arrays = [np.asarray(r[family]["calls"], np.int64) for r in rounds]
            forward = [np.asarray([reqs > 0 for _, reqs in r[family]["steps"]]) for r in rounds]
            entry: dict[str, Any] = {"rounds": len(arrays)}
            for clock, index in (("cpu", 1), ("wall", 0)):
                calls_us = (
                    np.concatenate([a[:, f, index] for a, f in zip(arrays, forward)], axis=1) / 1e3
                )
                entry[clock] = {name: step_stats(calls_us[i]) for i, name in enumerate(CALLS)}
                entry[clock]["main"] = step_stats(calls_us[: len(MAIN_CALLS)].sum(axis=0))
                entry[clock]["gpu_path_calls"] = step_stats(calls_us[1:3].sum(axis=0))
            per_side[side] = entry
        theirs = per_side.get("vllm-gpu-path")
        if theirs is not None:
            for side, entry in per_side.items():
                if side == "vllm-gpu-path":
                    continue
                entry["ratio_vllm_over_ours"] = {
                    key: {
                        stat: (
                            round(theirs["cpu"][key][stat] / entry["cpu"][key][stat], 3)
                            if entry["cpu"][key][stat]
                            else None
                        )
                        for stat in ("p50", "p90", "total")
                    }
                    for key in ("prepare_output", "enqueue_cpu_copy", "gpu_path_calls")
                }
        summary[family] = per_side
    return summary


def _figure(summary: dict, families: list[str]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(families), figsize=(4.2 * len(families), 3.6), squeeze=False)
    for ax, family in zip(axes[0], families):
        sides = list(summary[family])
        x = np.arange(len(MAIN_CALLS))
        width = 0.8 / len(sides)
        for i, side in enumerate(sides):
            values = [summary[family][side]["cpu"][c]["p50"] for c in MAIN_CALLS]
            ax.bar(x + i * width, values, width, label=side)
        ax.set_xticks(x + 0.4 - width / 2, [c.replace("_", "\n") for c in MAIN_CALLS], fontsize=7)
        ax.set_title(f"{family}: main-thread µs p50 (thread CPU)", fontsize=8)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def run(
    families: list[str], model: str, rounds: int, seed: int, out: Path, device: str = "cuda"
) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    base = [sys.executable, "-m", "bench.gpu_host_step", "--child"]
    common = ["--families", ",".join(families), "--model", model, "--seed", str(seed)]
    common += ["--device", device]
    for round_index in range(rounds):
        order = list(SIDES) if round_index % 2 == 0 else list(reversed(SIDES))
        for side in order:
            result_path = out / f".gpu_host_step_{side}_{round_index}.json"
            cmd = [*base, "--side", side, "--json", str(result_path)]
            t0 = time.perf_counter()
            subprocess.run([*cmd, *common], check=True)
            data = json.loads(result_path.read_text())
            result_path.unlink()
            runs[side].append(data)
            print(f"round {round_index} {side}: {time.perf_counter() - t0:.1f} s", flush=True)
    summary = summarize(runs, families)
    _print(summary, families)
    from bench.common import machine_info

    doc = {
        "bench": "gpu_host_step",
        "model": model,
        "depth": DEPTH,
        "device": device,
        "seed": seed,
        "rounds": rounds,
        "families": families,
        "machine": machine_info(),
        "summary": summary,
        "runs": runs,
    }
    (out / "gpu_host_step.json").write_text(json.dumps(doc))
    _figure(summary, families).savefig(out / "gpu_host_step.png", dpi=120)
    return doc


def _print(summary: dict, families: list[str]) -> None:
    for family in families:
        for side, entry in summary[family].items():
            cpu = entry["cpu"]
            main = cpu["main"]
            calls = "  ".join(f"{c} {cpu[c]['p50']:.1f}/{cpu[c]['p90']:.1f}" for c in CALLS)
            print(
                f"{family:12s} {side:18s} main p50 {main['p50']:7.1f} p90 {main['p90']:7.1f} "
                f"total {main['total']:9.0f} us | {calls}"
            )
            if "ratio_vllm_over_ours" in entry:
                ratio = entry["ratio_vllm_over_ours"]["gpu_path_calls"]
                print(
                    f"{'':31s} vLLM-GPU-path / ours, prepare+enqueue: "
                    f"p50 {ratio['p50']}x total {ratio['total']}x"
                )


def gpu_bench_parser(description: str, families: tuple[str, ...]) -> argparse.ArgumentParser:
    """The options every GPU host benchmark takes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--families", default=",".join(families))
    parser.add_argument("--model", default="Qwen3-30B-A3B")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "gpu")
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: a dry run of every step (reference kernel, CPU tensors; no GPU timings)",
    )
    return parser


def refuse_without_cuda(name: str, device: str, what: str) -> bool:
    """True (after one line on stderr) when ``device`` is cuda and there is none."""
    import torch

    if device != "cuda" or torch.cuda.is_available():
        return False
    print(f"{name}: no CUDA device here; {what} (--device cpu dry-runs it)", file=sys.stderr)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = gpu_bench_parser(__doc__.splitlines()[0], FAMILIES)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    what = "it times real launches and needs a GPU (bench/host_step times host work on a CPU)"
    if refuse_without_cuda("gpu_host_step", args.device, what):
        return NO_CUDA_EXIT
    if args.child:
        return _child(args)
    run(args.families.split(","), args.model, args.rounds, args.seed, args.out, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
