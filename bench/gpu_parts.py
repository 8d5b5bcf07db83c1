"""Where r3capture's main-thread time goes on a GPU, and what each device operation costs.

Two measurements, thread CPU of the calling thread:

* ``parts``: the worker (direct destination, real Triton launch) in ``bench/gpu_host_step``'s
  harness (the simulator, async depth 2), with its parts timed inside ``prepare_output`` and
  ``enqueue_cpu_copy``: the batch layout, the launcher's per-step checks, the free-slot
  queue's reserve, the fresh-request flags, re-attaching launches, the launch (the kernel
  takes its slots itself: no slot planning and no upload) and the copies back. Each step's
  sum per part; p50 and total over the forward steps. The timers add about a µs per part;
  the calls' own times are ``bench/gpu_host_step``'s.
* ``ops``: each torch or CUDA operation the two paths issue per step, alone, on buffers of a
  step's size: p50 of 2,000 calls (the device drained every 50, outside the timing); on a
  GPU also its wall time behind ~200 µs of queued GPU work (200 calls), which shows an
  operation that waits for the device.

    python -m bench.gpu_parts [--families F,...] [--out DIR] [--device cpu]

``--device cpu`` dry-runs both (the reference kernel; CPU tensors). Without CUDA and without
``--device cpu`` it exits with code 3 and one line.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.common import per_call_ns
from bench.gpu_host_step import (
    NO_CUDA_EXIT,
    CallTimes,
    bench_trace,
    gpu_bench_parser,
    refuse_without_cuda,
    step_stats,
    timed_r3capture_factory,
)

FAMILIES = ("decode-256", "prefill", "spec-k3")
OP_CALLS, OP_WARMUP, OP_BATCH = 2000, 100, 50


class PartTimes:
    """Thread-CPU ns per (part, step); the step is set by the caller."""

    def __init__(self) -> None:
        self.step = -1
        self.ns: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))

    def wrap(self, owner: Any, name: str, part: str) -> Callable[[], None]:
        """Time every call of ``owner.name`` as ``part``; returns the undo."""
        original = getattr(owner, name)
        clock = time.thread_time_ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return original(*args, **kwargs)
            finally:
                self.ns[part][self.step] += clock() - start

        setattr(owner, name, timed)
        return lambda: setattr(owner, name, original)


def _part_targets() -> list[tuple[Any, str, str]]:
    from r3capture.aux_output import (
        device_side,
        request_table,
        slot_queue,
        step_launcher,
    )
    from r3capture.kernels import GatherAllocLaunch

    return [
        (step_launcher.StepLauncher, "layout_of", "layout_of"),
        (step_launcher, "step_tensors_pass", "launcher checks"),
        (slot_queue.SlotQueue, "reserve", "queue reserve"),
        (request_table.RequestTable, "take_fresh", "fresh flags"),
        (step_launcher.StepLauncher, "_attach", "attach"),
        (GatherAllocLaunch, "launch_checked", "launch"),
        (device_side.DeviceSide, "copy_back", "copy_back"),
    ] + _launcher_target()


def _launcher_target() -> list[tuple[Any, str, str]]:
    """Triton's C launcher (inside ``launch``), where CUDA has one: what of the launch is
    Triton's and the driver's, the rest is ours."""
    import torch

    if not torch.cuda.is_available():
        return []
    from triton.backends.nvidia import driver as nvidia_driver

    return [(nvidia_driver.CudaLauncher, "__call__", "launch: Triton's C launcher")]


def measure_parts(family: str, model: str, seed: int, device: str) -> dict:
    """Per part: p50 / p90 / total µs over the forward steps of one run of ``family``."""
    from sim import run_trace

    run_trace(
        bench_trace("decode-8", model, seed),
        timed_r3capture_factory("direct", CallTimes(), [], device),
        check=False,
    )
    parts = PartTimes()
    times, steps = CallTimes(), []
    base = timed_r3capture_factory("direct", times, steps, device)

    def factory(sizes: Any) -> Any:
        handle = base(sizes)
        begin = handle.worker.begin_step

        def begin_step(metadata: Any) -> None:
            parts.step += 1
            begin(metadata)

        handle.worker.begin_step = begin_step
        return handle

    undo = [parts.wrap(*target) for target in _part_targets()]
    try:
        run_trace(bench_trace(family, model, seed), factory)
    finally:
        for restore in reversed(undo):
            restore()
    forward = [i for i, (_, reqs) in enumerate(steps) if reqs]
    calls = times.array(len(steps))
    out: dict[str, Any] = {"steps": len(forward)}
    for index, call in enumerate(("prepare_output", "enqueue_cpu_copy")):
        out[call] = step_stats(calls[1 + index, forward, 1] / 1e3)
    for part, per_step in parts.ns.items():
        out[part] = step_stats(np.asarray([per_step.get(i, 0) for i in forward]) / 1e3)
    return out


def _op_cost(
    fn: Callable[[], Any],
    sync: Callable[[], None],
    clock: Callable[[], int] = time.thread_time_ns,
    before: Callable[[], Any] | None = None,
) -> float:
    """p50 µs of one call of ``fn`` by ``clock``; ``before`` runs ahead of each call, untimed
    (then the device drains before every call, and a tenth of the calls are timed)."""
    if before is None:
        samples = per_call_ns(fn, sync, calls=OP_CALLS, warmup=OP_WARMUP, batch=OP_BATCH)
    else:
        samples = per_call_ns(
            fn, sync, calls=OP_CALLS // 10, warmup=OP_WARMUP, batch=1, clock=clock, before=before
        )
    return round(float(np.percentile(samples, 50)) / 1e3, 2)


BUSY_CYCLES = 400_000  # torch.cuda._sleep: ~200 µs of GPU time at the H200's ~2 GHz


def measure_ops(device: str) -> dict[str, float]:
    """Host cost of each per-step operation, on Qwen3-30B-A3B-sized buffers."""
    import torch

    on_cuda = device == "cuda"
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    dev = torch.device(device)
    capture = torch.zeros((8192, 48, 8), dtype=torch.int32, device=dev)
    snapshot = capture[:256].to(torch.uint8)
    info_dev = torch.zeros((1024, 4), dtype=torch.int32, device=dev)
    info_host = torch.zeros((1024, 4), dtype=torch.int32, pin_memory=on_cuda)
    fresh = torch.zeros(1024, dtype=torch.uint8, pin_memory=on_cuda)
    ops: dict[str, Callable[[], Any]] = {
        "vLLM cast: capture[:256].to(uint8)": lambda: capture[:256].to(torch.uint8),
        "vLLM copy: snapshot.to('cpu', non_blocking)": lambda: snapshot.to(
            "cpu", non_blocking=True
        ),
        # staging only: copy_back's step_info copy (direct: the kernel writes it there).
        "step_info D2H copy_ (1024 x 4 int32)": lambda: info_host.copy_(
            info_dev, non_blocking=True
        ),
        # A step with requests new to their index passes the first R of its fresh flags.
        "slice the pinned fresh flags": lambda: fresh[:256],
    }
    if on_cuda:

        def device_context() -> None:
            with torch.cuda.device(capture.device):
                pass

        ops["torch.cuda.device(capture.device) enter + exit"] = device_context
        ops["torch.cuda.current_stream()"] = torch.cuda.current_stream
        ops["torch.cuda.current_device()"] = torch.cuda.current_device
        try:
            ops.update(_launch_ops(capture))
        except Exception as exc:  # noqa: BLE001 - the other operations still get timed
            ops["gather_alloc decode-256 launches"] = functools.partial(_raise, exc)
    costs: dict[str, Any] = {}
    for name, fn in ops.items():
        try:
            costs[name] = _op_cost(fn, sync)
            if on_cuda:
                # Wall time behind ~200 µs of queued GPU work: an operation that waits for
                # the device takes about that long, one that only enqueues takes its CPU time.
                busy = functools.partial(torch.cuda._sleep, BUSY_CYCLES)
                costs[name + " | wall, GPU busy"] = _op_cost(fn, sync, time.perf_counter_ns, busy)
        except Exception as exc:  # noqa: BLE001 - an op this torch refuses is a finding
            costs[name] = f"{type(exc).__name__}: {exc}"[:200]
    if on_cuda:
        sleep = functools.partial(torch.cuda._sleep, BUSY_CYCLES)
        costs["reference: torch.cuda.synchronize() | wall, GPU busy"] = _op_cost(
            torch.cuda.synchronize, sync, time.perf_counter_ns, sleep
        )
    return costs


def _raise(exc: Exception) -> None:
    raise exc


def _launch_ops(capture: Any) -> dict[str, Callable[[], Any]]:
    """One decode-256 step of ``gather_alloc`` (direct: pinned arena, queue and step_info;
    the ring, records and heads on the device, as ``DeviceSide`` keeps them):
    ``GatherAllocLaunch.check_step`` (the launcher's per-step checks) and
    ``GatherAllocLaunch.launch_checked``, each alone, on arguments built once."""
    import torch

    from r3capture.aux_output.sizing import ring_widths
    from r3capture.kernels import GatherAllocLaunch

    reqs, block = 256, 16
    dev = capture.device
    _, depth_width = ring_widths(capture.shape[0], block, 2)
    ring = torch.full((reqs, depth_width), -1, dtype=torch.int64, device=dev)
    records = torch.zeros((reqs, 2), dtype=torch.int64, device=dev)
    heads = torch.zeros(4, dtype=torch.int64, device=dev)
    queue = torch.arange(4096, dtype=torch.int32).pin_memory()
    arena = torch.zeros((2 * reqs, block, *capture.shape[1:]), dtype=torch.uint8, pin_memory=True)
    info = torch.zeros((reqs, 4), dtype=torch.int32, pin_memory=True)
    launch = GatherAllocLaunch(capture, ring, records, queue, heads, arena, info)
    qsl = torch.arange(reqs + 1, dtype=torch.int32, device=dev)
    positions = torch.full((reqs,), 100, dtype=torch.int32, device=dev)
    index = torch.arange(reqs, dtype=torch.int64, device=dev)

    def check() -> Any:
        return launch.check_step(qsl, positions, index, launch=1, queue_tail=0, num_rows=reqs)

    # An empty queue (tail 0): every request of launch 1 fails closed (NO_STOCK), and the
    # repeated launches, which reuse its serial, fail closed too (BAD_LAUNCH), so they leave
    # the ring, records, queue heads and arena as they are.
    shape = check()
    launch.launch_checked(shape, qsl, positions, index, None, None)  # compiles or loads it
    torch.cuda.synchronize()
    return {
        "gather_alloc decode-256: check_step": check,
        "gather_alloc decode-256: launch_checked": lambda: launch.launch_checked(
            shape, qsl, positions, index, None, None
        ),
    }


def main(argv: list[str] | None = None) -> int:
    args = gpu_bench_parser(__doc__.splitlines()[0], FAMILIES).parse_args(argv)
    if refuse_without_cuda("gpu_parts", args.device, "it times real device operations"):
        return NO_CUDA_EXIT
    from bench.common import machine_info

    doc: dict[str, Any] = {"bench": "gpu_parts", "device": args.device, "model": args.model}
    doc["machine"] = machine_info()
    doc["ops_us_p50"] = measure_ops(args.device)
    for name, us in doc["ops_us_p50"].items():
        print(f"op   {name:50s} {us} us", flush=True)
    doc["parts"] = {}
    for family in args.families.split(","):
        doc["parts"][family] = parts = measure_parts(family, args.model, args.seed, args.device)
        for part, stats in parts.items():
            if isinstance(stats, dict):
                print(
                    f"part {family:12s} {part:32s} p50 {stats['p50']:8.1f} "
                    f"p90 {stats['p90']:8.1f} total {stats['total']:10.0f} us",
                    flush=True,
                )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_parts.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
