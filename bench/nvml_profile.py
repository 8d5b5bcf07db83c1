"""Device memory used by the routed-experts capture path: r3capture vs vLLM 0.33.0.

Each provider runs in its own process (so NVML sees only its allocations) through the same
sequence of steps (decode 256 requests, an 8192-token chunked prefill, speculative k=3):
  vllm               vLLM's own buffers (the int32 capture buffer, the batch's positions and
                     num_rejected) + a per-step narrow snapshot (buffer[:n].to(dtype)) copied
                     to the host, as vLLM 0.33.0 does
  r3capture-pinned   the same vLLM buffers + the batch's query_start_loc and idx_mapping (one
                     int32 buffer filled by one copy) + the worker's own device side
                     (``aux_output/device_side.DeviceSide``: the kernel's ring
                     [max_num_seqs, D] and records, the queue's heads, the pinned free-slot
                     queue and step_info, one GatherAllocLaunch built at start-up); every
                     request is new to its index and takes its blocks' slots from the queue
                     the host refills; rows go straight into the pinned host arena
  r3capture-staging  as above + device staging [max_num_batched_tokens, L, K] in step-row
                     order and step_info on the device, copied back per step; the host places
                     its rows by the slots the launch took
and reports torch.cuda.max_memory_allocated / max_memory_reserved above the process's
baseline and NVML's used-memory delta (per process where the driver reports it, else
device-wide), as JSON. vLLM's buffers are counted for every provider: vLLM allocates them
either way.

Every step is checked after it completes: step_info and every row that reached the host
(arena, staging copy or vLLM's snapshot) must equal the capture buffer's rows, and nothing
else of the arena or staging may change (it is poisoned before each step). ``Provider`` runs
on a CPU device as well (Triton interpreter), which is how the tests exercise it.

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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bench.common import RESULTS_DIR, write_results
from bench.kernel_bench import DEST_SENTINEL, ring_width
from r3capture.aux_output.device_side import DeviceSide

EXIT_NO_NVML = 3
EXIT_NO_TORCH_CUDA = 4
PROVIDERS = ("baseline", "vllm", "r3capture-pinned", "r3capture-staging")
# name: (L, K, experts)
MODELS = {"Qwen3-30B-A3B": (48, 8, 128), "Kimi-K2": (61, 8, 384)}


@dataclass(frozen=True)
class Limits:
    max_tokens: int  # max_num_batched_tokens: capture rows
    max_seqs: int  # max_num_seqs
    block: int  # hash block size B

    @property
    def max_slots(self) -> int:
        """Arena slots: vLLM's own bound on the blocks one step touches."""
        return -(-self.max_tokens // self.block) + self.max_seqs


PROFILE = Limits(max_tokens=8192, max_seqs=256, block=16)


@dataclass(frozen=True)
class ProfileStep:
    rows: np.ndarray  # int64 [R], scheduled rows per request
    starts: np.ndarray  # int64 [R], token position of each request's first row
    rejected: np.ndarray  # int64 [R], rejected speculative rows at the end
    speculative: bool


def profile_steps(rng: np.random.Generator, limits: Limits) -> list[ProfileStep]:
    """Decode (max_seqs requests), a chunked prefill of max_tokens rows in 4 chunks and
    speculative k=3 (max_seqs requests of 4 rows), three times over."""
    n, chunks = limits.max_seqs, 4
    ones, zeros = np.ones(n, np.int64), np.zeros(n, np.int64)
    decode = ProfileStep(ones, rng.integers(0, 30_000, n), zeros, False)
    chunk = np.full(chunks, limits.max_tokens // chunks, np.int64)
    prefill = ProfileStep(chunk, rng.integers(0, 16_000, chunks), np.zeros(chunks, np.int64), False)
    spec = ProfileStep(np.full(n, 4, np.int64), rng.integers(0, 30_000, n),
                       rng.integers(0, 4, n), True)  # fmt: skip
    return [decode, prefill, spec] * 3


@dataclass(frozen=True)
class Plan:
    """What the host derives for one step: a distinct request index per request and, for
    the blocks of each request's accepted rows, distinct arena slots in batch order (the
    queue entries the launch takes)."""

    qsl: np.ndarray  # int64 [R+1]
    positions: np.ndarray  # int64 [num_rows], token position of each row
    request_index: np.ndarray  # int64 [R]
    block_lo: np.ndarray  # int64 [R], first block of the accepted rows
    block_hi: np.ndarray  # int64 [R], last block of the accepted rows
    block_slots: np.ndarray  # int64 [U]: slots of blocks block_lo..=block_hi, request by request

    @property
    def num_rows(self) -> int:
        return int(self.qsl[-1])


def plan_step(step: ProfileStep, rng: np.random.Generator, limits: Limits) -> Plan:
    rows, starts = step.rows, step.starts
    num_reqs, block = len(rows), limits.block
    qsl = np.concatenate([[0], np.cumsum(rows)])
    positions = np.repeat(starts - qsl[:-1], rows) + np.arange(qsl[-1])
    accepted = rows - step.rejected
    block_lo, block_hi = starts // block, (starts + accepted - 1) // block
    num_blocks = block_hi - block_lo + 1
    width = ring_width(limits.max_tokens, block)
    if num_blocks.sum() > limits.max_slots or (num_blocks > width).any():
        raise ValueError(f"a step of {int(num_blocks.sum())} blocks does not fit {limits}")
    request_index = rng.permutation(limits.max_seqs)[:num_reqs]
    block_slots = rng.permutation(limits.max_slots)[: int(num_blocks.sum())]
    return Plan(qsl, positions, request_index, block_lo, block_hi, block_slots)


def accepted_rows(step: ProfileStep, plan: Plan, block: int) -> tuple[np.ndarray, np.ndarray]:
    """int64 ``(step row, arena row = slot * B + position % B)`` of every accepted row."""
    accepted = step.rows - step.rejected
    owner = np.repeat(np.arange(len(accepted)), accepted)
    i = np.arange(len(owner)) - (np.cumsum(accepted) - accepted)[owner]
    pos = step.starts[owner] + i
    num_blocks = plan.block_hi - plan.block_lo + 1
    first_of = np.cumsum(num_blocks) - num_blocks
    slot = plan.block_slots[first_of[owner] + pos // block - plan.block_lo[owner]]
    return plan.qsl[owner] + i, slot * block + pos % block


def _poison(t: torch.Tensor, sentinel: int) -> None:
    if t.dtype == torch.uint16:
        t.view(torch.int16).fill_(sentinel - 2**16)  # the same bytes; fill_ needs no uint16 op
    else:
        t.fill_(sentinel)


class Provider:
    """One provider's buffers and per-step work on ``device`` (cuda; cpu in the tests)."""

    def __init__(self, name: str, model: tuple[int, int, int], limits: Limits, device) -> None:
        if name not in PROVIDERS:
            raise ValueError(f"provider must be one of {PROVIDERS}; got {name!r}")
        self.name, self.limits = name, limits
        self.device = torch.device(device)
        num_layers, top_k, num_experts = model
        self.dtype = torch.uint8 if num_experts <= 256 else torch.uint16
        self.np_dtype = np.dtype(np.uint8 if num_experts <= 256 else np.uint16)
        self.sentinel = DEST_SENTINEL[self.dtype]
        if name == "baseline":
            return
        pinned = self.device.type == "cuda"
        L, K, B = num_layers, top_k, limits.block
        # vLLM's: the router hooks' capture buffer, the batch's positions, num_rejected.
        gen = torch.Generator().manual_seed(0)
        capture = torch.randint(0, num_experts, (limits.max_tokens, L, K), generator=gen,
                                dtype=torch.int32)  # fmt: skip
        capture[capture == self.sentinel] -= 1  # so that a missing write always shows
        self.expected_rows = capture.numpy().astype(self.np_dtype)  # host, for the checks
        self.capture = capture.to(self.device)
        self.positions = torch.zeros(limits.max_tokens, dtype=torch.int64, device=self.device)
        self.num_rejected = torch.zeros(limits.max_seqs, dtype=torch.int32, device=self.device)
        if name == "vllm":
            self.snapshot_host: np.ndarray | None = None
            return

        # The batch's query_start_loc and idx_mapping (vLLM's input batch holds them on the
        # device): one int32 buffer, filled by one copy per step.
        self._stride = stride = limits.max_seqs + 1
        self.inputs_host = torch.zeros(2 * stride, dtype=torch.int32, pin_memory=pinned)
        self.inputs = torch.zeros(2 * stride, dtype=torch.int32, device=self.device)
        # The store's arena: pinned host memory the kernel writes (direct) or the host fills.
        self.arena = torch.empty((limits.max_slots, B, L, K), dtype=self.dtype,
                                 pin_memory=pinned)  # fmt: skip
        staging = name == "r3capture-staging"
        # The worker's device side: the kernel's state, its launch and the copies back.
        self.side = DeviceSide(
            capture_buffer=self.capture, dtype=self.np_dtype, block_size=B,
            max_num_seqs=limits.max_seqs, ring_width=ring_width(limits.max_tokens, B),
            queue_size=limits.max_slots, depth=1,
            destination="staging" if staging else "direct", kernel_impl="triton",
        )  # fmt: skip
        self.side.attach(self.arena)
        # Its one buffer of each (depth 1): step_info on the host, and staging.
        self.info_host = self.side._info_host[0]
        if staging:
            self.staging = self.side._staging_dev[0]
            self.staging_host = self.side._staging_host[0]
        self._launch = 0
        self._queue_tail = 0
        self._step = None

    def run(self, step: ProfileStep, plan: Plan) -> None:
        """Enqueue one step's device work and copies back; the caller synchronizes."""
        if self.name == "baseline":
            return
        num_reqs, n = len(step.rows), plan.num_rows
        # vLLM writes these itself every step.
        self.positions[:n].copy_(torch.from_numpy(plan.positions))
        self.num_rejected[:num_reqs].copy_(torch.from_numpy(step.rejected.astype(np.int32)))
        if self.name == "vllm":
            snapshot = self.capture[:n].to(self.dtype)
            self.snapshot_host = snapshot.to("cpu", non_blocking=True).numpy()
            return

        _poison(self.arena, self.sentinel)
        self.info_host.fill_(-99)
        if self.name == "r3capture-staging":
            _poison(self.staging, self.sentinel)
            self.side._info_dev[0].fill_(-99)
        stride = self._stride
        host = self.inputs_host.numpy()
        host[: num_reqs + 1] = plan.qsl
        host[stride : stride + num_reqs] = plan.request_index
        self.inputs.copy_(self.inputs_host, non_blocking=True)
        # The host refills the queue with the step's slots, in the order its blocks take
        # them; every request is new to its index.
        queue, size = self.side.queue_np, len(self.side.queue_np)
        for k, slot in enumerate(plan.block_slots.tolist()):
            queue[(self._queue_tail + k) % size] = slot
        self._queue_tail += len(plan.block_slots)
        self.side.fresh_flags()[:num_reqs] = 1
        self._launch += 1
        qsl, index = self.inputs[: num_reqs + 1], self.inputs[stride : stride + num_reqs]
        rejected = self.num_rejected[:num_reqs] if step.speculative else None
        shape = self.side.check_step(
            qsl, self.positions, index, rejected, num_reqs=num_reqs, num_rows=n,
            launch=self._launch, queue_tail=self._queue_tail,
        )  # fmt: skip
        self._step = self.side.launch(shape, qsl, self.positions, index, rejected, fresh=True,
                                      num_rows=n)  # fmt: skip
        self.side.copy_back(self._step)

    def check(self, step: ProfileStep, plan: Plan) -> str | None:
        """None when the completed step left exactly the expected bytes on the host."""
        if self.name == "baseline":
            return None
        n = plan.num_rows
        if self.name == "vllm":
            got = self.snapshot_host
            if got.dtype != self.np_dtype or not np.array_equal(got, self.expected_rows[:n]):
                return "vllm snapshot != capture rows"
            return None

        num_reqs = len(step.rows)
        info = self.info_host[:num_reqs].numpy()
        blocks = plan.block_hi - plan.block_lo + 1
        expected_info = np.stack(
            [step.starts, step.rows - step.rejected, 0 * step.rows, blocks], axis=1
        )
        if not np.array_equal(info, expected_info):
            bad = np.flatnonzero((info != expected_info).any(axis=1))
            return f"step_info of requests {bad[:8].tolist()}: {info[bad[:3]].tolist()}"
        src, dst = accepted_rows(step, plan, self.limits.block)
        arena = self.arena.view(-1, *self.arena.shape[2:]).numpy().view(self.np_dtype)
        if self.name == "r3capture-staging":
            staged = self.staging_host[:n].numpy().view(self.np_dtype)
            expected = np.full_like(staged, self.sentinel)
            expected[src] = self.expected_rows[src]
            if not np.array_equal(staged, expected):
                return "staging copy != accepted capture rows (poison elsewhere)"
            arena[dst] = staged[src]  # the host places the rows, as the worker does
        expected = np.full_like(arena, self.sentinel)
        expected[dst] = self.expected_rows[src]
        if not np.array_equal(arena, expected):
            return "arena != accepted capture rows at their slots (poison elsewhere)"
        return None


def _nvml_handle(pynvml):
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


def child(provider: str, model: str) -> dict:
    import pynvml

    pynvml.nvmlInit()
    torch.zeros(1, device="cuda")  # create the context before the baseline
    torch.cuda.synchronize()
    handle = _nvml_handle(pynvml)
    nvml0, source = _nvml_used(pynvml, handle)
    torch0 = torch.cuda.memory_allocated()
    reserved0 = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()

    state = Provider(provider, MODELS[model], PROFILE, "cuda")
    rng = np.random.default_rng(0)
    for i, step in enumerate(profile_steps(rng, PROFILE)):
        plan = plan_step(step, rng, PROFILE)
        state.run(step, plan)
        torch.cuda.synchronize()
        problem = state.check(step, plan)
        if problem is not None:
            raise RuntimeError(f"{provider} {model} step {i}: {problem}")
    torch.cuda.synchronize()
    nvml1, _ = _nvml_used(pynvml, handle)
    num_layers, top_k, _ = MODELS[model]
    return {
        "provider": provider,
        "model": model,
        "dtype": str(state.dtype).removeprefix("torch."),
        "row_bytes": num_layers * top_k * state.dtype.itemsize,
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
    if not torch.cuda.is_available():
        print("nvml_profile: NVML works but torch sees no CUDA device; nothing to measure")
        return EXIT_NO_TORCH_CUDA
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0

    repo = Path(__file__).resolve().parents[1]
    rows = []
    extra = {
        "driver": driver,
        "cuda": torch.version.cuda,
        "max_num_batched_tokens": PROFILE.max_tokens,
        "max_num_seqs": PROFILE.max_seqs,
        "hash_block": PROFILE.block,
        "ring_width": ring_width(PROFILE.max_tokens, PROFILE.block),
        "memory": rows,  # one entry per (model, provider); not timings, so not Result rows
    }
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
        # After every model: a run stopped at its time limit keeps the models it finished.
        paths = write_results("nvml_profile", [], extra=extra, out_dir=args.out)
    print("wrote", ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
