"""Device memory used by the routed-experts capture path: r3capture vs vLLM 0.33.0.

Each provider runs in its own process (so NVML sees only its allocations) through the same
sequence of steps (decode 256 requests, an 8192-token chunked prefill, speculative k=3):
  vllm               int32 capture buffer + a per-step narrow snapshot (buffer[:n].to(dtype))
                     copied to the host, as vLLM 0.33.0 does
  r3capture-pinned   the same int32 buffer + the kernel's device metadata (slot table, block
                     starts, rejected counts); rows go straight into a pinned host arena
  r3capture-staging  as above + a device staging arena of the step's slots, copied once
and reports torch.cuda.max_memory_allocated / max_memory_reserved above the process's
baseline and NVML's used-memory delta (per process where the driver reports it, else
device-wide), as JSON. The capture buffer is counted for every provider: vLLM's capturer
allocates it either way.

    python -m bench.nvml_profile [--quick] [--out DIR]    (or: python -m bench.run nvml)

Exit status: 0 measured; 3 no NVIDIA driver/NVML here (one line, no traceback); 4 NVML works
but torch has no CUDA device; 1 a provider process failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.common import RESULTS_DIR, write_results

EXIT_NO_NVML = 3
EXIT_NO_TORCH_CUDA = 4
PROVIDERS = ("baseline", "vllm", "r3capture-pinned", "r3capture-staging")
# name: (L, K, experts)
MODELS = {"Qwen3-30B-A3B": (48, 8, 128), "Kimi-K2": (61, 8, 384)}
MAX_TOKENS = 8192
MAX_SEQS = 256
HASH_BLOCK = 16


def _nvml_handle(pynvml):
    import torch

    try:
        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except (pynvml.NVMLError, AttributeError):
        return pynvml.nvmlDeviceGetHandleByIndex(0)


def _nvml_used(pynvml, handle) -> tuple[int, str]:
    """This process's device memory if the driver reports it (not in every container)."""
    try:
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory), "process"
    except pynvml.NVMLError:
        pass
    return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used), "device"


def _steps(rng) -> list[tuple[list[int], list[int], list[int]]]:
    """(rows, starts, rejected) per request, for each profiled step."""
    decode = ([1] * MAX_SEQS, [int(x) for x in rng.integers(0, 30_000, MAX_SEQS)], [0] * MAX_SEQS)
    prefill = ([MAX_TOKENS // 4] * 4, [int(x) for x in rng.integers(0, 16_000, 4)], [0] * 4)
    spec = (
        [4] * MAX_SEQS,
        [int(x) for x in rng.integers(0, 30_000, MAX_SEQS)],
        [int(x) for x in rng.integers(0, 4, MAX_SEQS)],
    )
    return [decode, prefill, spec] * 3


def child(provider: str, model: str) -> dict:
    import numpy as np
    import pynvml
    import torch

    from r3capture.kernels import gather_pack

    pynvml.nvmlInit()
    torch.zeros(1, device="cuda")  # create the context before the baseline
    torch.cuda.synchronize()
    handle = _nvml_handle(pynvml)
    nvml0, source = _nvml_used(pynvml, handle)
    torch0 = torch.cuda.memory_allocated()
    reserved0 = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()

    num_layers, top_k, num_experts = MODELS[model]
    dtype = torch.uint8 if num_experts <= 256 else torch.uint16
    row_bytes = num_layers * top_k * dtype.itemsize
    max_cols = MAX_TOKENS // HASH_BLOCK + 2
    max_slots = MAX_TOKENS // HASH_BLOCK + MAX_SEQS  # vLLM's own per-step block bound
    if provider != "baseline":
        buffer = torch.randint(
            0, num_experts, (MAX_TOKENS, num_layers, top_k), dtype=torch.int32, device="cuda"
        )
    if provider.startswith("r3capture"):
        qsl = torch.zeros(MAX_SEQS + 1, dtype=torch.int32, device="cuda")
        start = torch.zeros(MAX_SEQS, dtype=torch.int32, device="cuda")
        first = torch.zeros(MAX_SEQS, dtype=torch.int32, device="cuda")
        rejected = torch.zeros(MAX_SEQS, dtype=torch.int32, device="cuda")
        table = torch.full((MAX_SEQS, max_cols), -1, dtype=torch.int32, device="cuda")
        host_arena = torch.empty(
            (max_slots, HASH_BLOCK, num_layers, top_k), dtype=dtype, pin_memory=True
        )
        host_info = torch.empty((MAX_SEQS, 3), dtype=torch.int32, pin_memory=True)
        if provider == "r3capture-staging":
            dest = torch.empty(host_arena.shape, dtype=dtype, device="cuda")
            info = torch.empty((MAX_SEQS, 3), dtype=torch.int32, device="cuda")
        else:
            dest, info = host_arena, host_info

    for rows, starts, rej in _steps(np.random.default_rng(0)):
        n, num_reqs = sum(rows), len(rows)
        if provider == "vllm":
            snapshot = buffer[:n].to(dtype)
            host = snapshot.to("cpu", non_blocking=True)
            torch.cuda.synchronize()
            del snapshot, host
        elif provider.startswith("r3capture"):
            qsl_host = np.concatenate([[0], np.cumsum(rows)])
            table_host = np.full((num_reqs, max_cols), -1, dtype=np.int32)
            firsts, slot = [], 0
            for r, (count, s) in enumerate(zip(rows, starts)):
                lo, hi = s // HASH_BLOCK, (s + count - 1) // HASH_BLOCK
                firsts.append(lo)
                table_host[r, : hi - lo + 1] = np.arange(slot, slot + hi - lo + 1)
                slot += hi - lo + 1
            qsl[: num_reqs + 1].copy_(torch.from_numpy(qsl_host.astype(np.int32)))
            start[:num_reqs].copy_(torch.tensor(starts, dtype=torch.int32))
            first[:num_reqs].copy_(torch.tensor(firsts, dtype=torch.int32))
            rejected[:num_reqs].copy_(torch.tensor(rej, dtype=torch.int32))
            table[:num_reqs].copy_(torch.from_numpy(table_host))
            gather_pack(
                buffer, qsl, start, first, table, dest, info, rejected,
                num_reqs=num_reqs, num_rows=n,
            )  # fmt: skip
            if provider == "r3capture-staging":
                host_arena[:slot].copy_(dest[:slot], non_blocking=True)
                host_info[:num_reqs].copy_(info[:num_reqs], non_blocking=True)
            torch.cuda.synchronize()
            if int(host_info[:num_reqs, 2].max()) != 0:
                raise RuntimeError(
                    f"gather_pack reported a failing request: {host_info[:num_reqs]}"
                )
    torch.cuda.synchronize()
    nvml1, _ = _nvml_used(pynvml, handle)
    return {
        "provider": provider,
        "model": model,
        "dtype": str(dtype).removeprefix("torch."),
        "row_bytes": row_bytes,
        "torch_peak_allocated_bytes": torch.cuda.max_memory_allocated() - torch0,
        "torch_peak_reserved_bytes": torch.cuda.max_memory_reserved() - reserved0,
        "nvml_used_delta_bytes": nvml1 - nvml0,
        "nvml_source": source,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    parser.add_argument("--quick", action="store_true", help="one model only")
    parser.add_argument("--child", nargs=2, metavar=("PROVIDER", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        import pynvml
    except ImportError:
        print("nvml_profile: nvidia-ml-py (pynvml) is not installed; nothing to measure")
        return EXIT_NO_NVML
    try:
        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else driver
    except pynvml.NVMLError as exc:
        print(f"nvml_profile: no NVIDIA driver here ({type(exc).__name__}); nothing to measure")
        return EXIT_NO_NVML
    import torch

    if not torch.cuda.is_available():
        print("nvml_profile: NVML works but torch sees no CUDA device; nothing to measure")
        return EXIT_NO_TORCH_CUDA
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0

    repo = Path(__file__).resolve().parents[1]
    rows = []
    for model in list(MODELS)[:1] if args.quick else MODELS:
        for provider in PROVIDERS:
            proc = subprocess.run(
                [sys.executable, "-m", "bench.nvml_profile", "--child", provider, model],
                capture_output=True, text=True, timeout=300, cwd=repo,
            )  # fmt: skip
            lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
            if proc.returncode != 0 or not lines:
                print(f"nvml_profile: {provider} {model} failed:\n{proc.stderr[-3000:]}")
                return 1
            row = json.loads(lines[-1])
            rows.append(row)
            mib = {k: v / 2**20 for k, v in row.items() if k.endswith("_bytes")}
            print(
                f"{model:14s} {provider:18s} torch peak {mib['torch_peak_allocated_bytes']:8.2f} "
                f"MiB  reserved {mib['torch_peak_reserved_bytes']:8.2f} MiB  NVML "
                f"{mib['nvml_used_delta_bytes']:8.2f} MiB ({row['nvml_source']})"
            )
    extra = {
        "driver": driver,
        "cuda": torch.version.cuda,
        "max_num_batched_tokens": MAX_TOKENS,
        "max_num_seqs": MAX_SEQS,
        "hash_block": HASH_BLOCK,
        "memory": rows,  # one entry per (model, provider); not timings, so not Result rows
    }
    paths = write_results("nvml_profile", [], extra=extra, out_dir=args.out)
    print("wrote", ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
