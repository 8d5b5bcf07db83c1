"""``GatherAllocLaunch`` launches the variant Triton's JIT would, with the same arguments.

After its first launch per per-step dtype combination, the launcher calls the compiled
variant directly instead of going through Triton's JIT (``bench.run triton_launch``: ~11 µs
less host CPU per launch). With no GPU, ``bench/no_gpu_driver.py`` stands in for the CUDA
driver (the kernel compiles for sm_90, the launcher records its arguments and runs nothing),
in a subprocess where TRITON_INTERPRET is unset. For a run of steps with every dtype
combination, request counts that Triton would specialize (1, multiples of 16) and per-step
tensors at unaligned addresses, each step is launched both ways and the driver must receive
the same call, from the same compiled variant (the driver gives each variant its own
function handle, which the call carries): the step-independent tensors, which the launcher
passes as kernel addresses resolved once, at the addresses the JIT's tensors have.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Both scripts count the launches that go through Triton's JIT.
_COUNT_JIT_RUNS = r"""
import json
import torch
import triton
from bench.models import MODELS
from bench.no_gpu_driver import no_gpu_driver
from r3capture.kernels.gather_alloc import _gather_alloc_kernel

jit_runs = []
jit_run = type(_gather_alloc_kernel).run
def counted_run(self, *args, **kwargs):
    jit_runs.append(1)
    return jit_run(self, *args, **kwargs)
type(_gather_alloc_kernel).run = counted_run
"""

_SCRIPT = (
    _COUNT_JIT_RUNS
    + r"""
from bench.triton_launch import jit_launch, make_launch
import importlib
gather_alloc_module = importlib.import_module("r3capture.kernels.gather_alloc")  # not the function

def same_value(x, y):
    if hasattr(x, "data") and hasattr(x, "extras"):  # launch metadata: made anew per launch
        return type(x) is type(y) and x.data == y.data and x.extras == y.extras
    if isinstance(x, int) and torch.is_tensor(y):  # a kernel address for a tensor
        return static_address.get(x) is y
    return x is y or (not torch.is_tensor(x) and x == y)

def same(a, b):
    return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))

# The driver's address of a CUDA tensor or a mapped pinned one; CPU tensors have none, so
# the stand-in is data_ptr(), and every step-independent tensor must reach the driver as it.
static_address = {}
def stand_in_address(tensor):
    static_address[tensor.data_ptr()] = tensor
    return tensor.data_ptr()
gather_alloc_module.kernel_address = stand_in_address

model = [m for m in MODELS if m.name == "Qwen3-30B-A3B"][0]
steps = []
for num_reqs in (1, 5, 16, 33):
    for qsl_dtype in (torch.int32, torch.int64):
        for pos_dtype in (torch.int64, torch.int32):
            for rejected_dtype in (None, torch.int32, torch.int64):
                for offset in (0, 1):
                    steps.append((num_reqs, qsl_dtype, pos_dtype, rejected_dtype, offset))
report = {
    "steps": 0, "same_call": 0, "same_variant": 0, "launcher_jit_runs": 0, "keys": 0,
    "hooked_steps": 0,
}
def hook(metadata):
    pass
with no_gpu_driver(90, record=True) as driver:
    launch, _ = make_launch(model, pass_rejected=False)
    for serial, (num_reqs, qsl_dtype, pos_dtype, rejected_dtype, offset) in enumerate(steps):
        # offset 1: the tensors start 4 or 8 bytes into a buffer (not 16-byte aligned).
        qsl = torch.arange(num_reqs + 1 + offset, dtype=qsl_dtype)[offset:] - offset
        positions = torch.zeros(8192 + offset, dtype=pos_dtype)[offset:]
        index = torch.arange(num_reqs + offset, dtype=torch.int64)[offset:] - offset
        rejected = None
        if rejected_dtype is not None:
            rejected = torch.zeros(num_reqs + offset, dtype=rejected_dtype)[offset:]
        shape = launch.check_step(qsl, positions, index, rejected, None, launch=serial + 1,
                                  queue_tail=7, num_rows=num_reqs)
        # Some steps with a launch hook set (as a profiler sets one): then the launcher must
        # pass Triton's hooks and metadata as the JIT does; without one, none of them.
        hooked = offset == 1 and num_reqs == 5
        if hooked:
            triton.knobs.runtime.launch_enter_hook.add(hook)
        before = len(jit_runs)
        launch.launch_checked(shape, qsl, positions, index, rejected, None)
        through_jit = len(jit_runs) - before
        report["launcher_jit_runs"] += through_jit
        ours = driver.launches.pop()
        variant = jit_launch(launch, shape, qsl, positions, index, rejected)
        theirs = driver.launches.pop()
        if hooked:
            triton.knobs.runtime.launch_enter_hook.remove(hook)
            report["hooked_steps"] += 1
        if hooked or through_jit:
            report["same_call"] += same(ours, theirs)
        elif tuple(ours[6:9]) == (None, None, None):  # metadata, enter and exit hooks
            report["same_call"] += same(ours[:6] + ours[9:], theirs[:6] + theirs[9:])
        report["steps"] += 1
        report["same_variant"] += any(v is variant for v in launch._variants.values())
    report["keys"] = len(launch._variants)
    report["no_launch_left"] = not driver.launches
    report["addresses"] = len(static_address)
    report["passed_as_addresses"] = sum(isinstance(a, int) and a in static_address for a in ours)
print(json.dumps(report))
"""
)


def _run_on_the_no_gpu_driver(script: str, tmp_path: Path) -> dict:
    """Run ``script`` in a process without TRITON_INTERPRET; returns the JSON it printed last."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_direct_launch_matches_tritons_jit(tmp_path) -> None:
    report = _run_on_the_no_gpu_driver(_SCRIPT, tmp_path)
    steps = 4 * 2 * 2 * 3 * 2
    # Variants: qsl x positions x (no rejected, int32, int64); one JIT run for each.
    assert report == {
        "steps": steps,
        "same_call": steps,
        "same_variant": steps,
        "launcher_jit_runs": 2 * 2 * 3,
        "hooked_steps": 2 * 2 * 3,
        "keys": 2 * 2 * 3,
        "no_launch_left": True,
        # capture, ring, records, queue, heads, dest, step_info
        "addresses": 7,
        "passed_as_addresses": 7,
    }


_UNKNOWN_TRITON_SCRIPT = (
    _COUNT_JIT_RUNS
    + r"""
from bench.triton_launch import make_launch

triton.__version__ = "3.9.0"  # a release the direct launch was never tested on
model = [m for m in MODELS if m.name == "Qwen3-30B-A3B"][0]
report = {"steps": 0, "jit_runs": 0, "driver_launches": 0}
with no_gpu_driver(90, record=True) as driver:
    launch, _ = make_launch(model, pass_rejected=False)
    report["direct"] = launch._variants is not None
    for serial, num_reqs in enumerate((1, 5, 5, 16, 16)):
        qsl = torch.arange(num_reqs + 1, dtype=torch.int32)
        positions = torch.zeros(8192, dtype=torch.int64)
        index = torch.arange(num_reqs, dtype=torch.int32)
        shape = launch.check_step(qsl, positions, index, None, None, launch=serial + 1,
                                  queue_tail=7, num_rows=num_reqs)
        launch.launch_checked(shape, qsl, positions, index, None, None)
        report["steps"] += 1
    report["jit_runs"] = len(jit_runs)
    report["driver_launches"] = len(driver.launches)
print(json.dumps(report))
"""
)


@pytest.mark.parametrize(
    "version, direct",
    [("3.6.0", True), ("3.7.1", True), ("3.7.0+git1234", True), ("3.5.1", False),
     ("3.8.0", False), ("3.10.0", False), ("4.0.0", False)],
)  # fmt: skip
def test_the_direct_launch_is_kept_to_tested_triton_releases(version: str, direct: bool) -> None:
    from r3capture.kernels._launch import direct_launch_supported

    assert direct_launch_supported(version) is direct


@pytest.mark.slow
def test_an_unknown_triton_launches_every_step_through_its_jit(tmp_path) -> None:
    """On a Triton release the direct launch was not tested on, every launch (repeated
    dtype combinations included) goes through Triton's JIT and reaches the driver."""
    report = _run_on_the_no_gpu_driver(_UNKNOWN_TRITON_SCRIPT, tmp_path)
    assert report == {"steps": 5, "jit_runs": 5, "driver_launches": 5, "direct": False}


_ALLOC_SCRIPT = r"""
import importlib
import json
import torch
import triton
from bench.no_gpu_driver import no_gpu_driver

alloc = importlib.import_module("r3capture.kernels.gather_alloc")
jit_runs = []
jit_run = type(alloc._gather_alloc_kernel).run
def counted_run(self, *args, **kwargs):
    jit_runs.append(1)
    return jit_run(self, *args, **kwargs)
type(alloc._gather_alloc_kernel).run = counted_run

static_address = {}
def stand_in_address(tensor):
    static_address[tensor.data_ptr()] = tensor
    return tensor.data_ptr()
alloc.kernel_address = stand_in_address
alloc._check_triton_place = lambda *args: None  # nothing runs on the no-GPU driver

def same_value(x, y):
    if hasattr(x, "data") and hasattr(x, "extras"):  # launch metadata: made anew per launch
        return type(x) is type(y) and x.data == y.data and x.extras == y.extras
    if isinstance(x, int) and torch.is_tensor(y):
        return static_address.get(x) is y
    return x is y or (not torch.is_tensor(x) and x == y)

def same(a, b):
    return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))

report = {"steps": 0, "same_call": 0, "jit_runs": 0, "keys": 0}
with no_gpu_driver(90, record=True) as driver:
    launch = alloc.GatherAllocLaunch(
        torch.zeros((512, 48, 8), dtype=torch.int32),
        torch.full((64, 40), -1, dtype=torch.int64),
        torch.zeros((64, 2), dtype=torch.int64),
        torch.zeros(256, dtype=torch.int32),
        torch.zeros(4, dtype=torch.int64),
        torch.zeros((300, 16, 48, 8), dtype=torch.uint8),
        torch.zeros((64, 4), dtype=torch.int32),
        impl="triton",
    )
    serial = 0
    for num_reqs in (1, 5, 16):
        for rejected_dtype in (None, torch.int32):
            for fresh in (False, True):
                for tail in (7, 2**31 + 7):  # an i64 scalar is another variant
                    serial += 1
                    qsl = torch.arange(num_reqs + 1, dtype=torch.int32)
                    positions = torch.zeros(512, dtype=torch.int64)
                    index = torch.arange(num_reqs, dtype=torch.int64)
                    rejected = None
                    if rejected_dtype is not None:
                        rejected = torch.zeros(num_reqs, dtype=rejected_dtype)
                    flags = torch.ones(num_reqs, dtype=torch.uint8) if fresh else None
                    shape = launch.check_step(
                        qsl, positions, index, rejected, flags, launch=serial,
                        queue_tail=tail, num_rows=num_reqs,
                    )
                    before = len(jit_runs)
                    launch.launch_checked(shape, qsl, positions, index, rejected, flags)
                    through_jit = len(jit_runs) - before
                    ours = driver.launches.pop()
                    unused = launch._args["heads"]
                    step_args = (
                        qsl, positions, index, rejected if rejected is not None else unused,
                        flags if flags is not None else unused, shape.num_reqs,
                        shape.row_limit, (shape.num_reqs - 1).bit_length(), shape.launch,
                        shape.queue_tail, rejected is not None, flags is not None,
                    )
                    grid = (max(-(-shape.row_limit // launch._tiles["BLOCK_ROWS"]),
                                -(-shape.num_reqs // launch._tiles["BLOCK_REQS"])),)
                    alloc._gather_alloc_kernel[grid](
                        **launch._kernel_args, **dict(zip(alloc._STEP_ARGS, step_args))
                    )
                    theirs = driver.launches.pop()
                    if through_jit:
                        report["same_call"] += same(ours, theirs)
                    elif tuple(ours[6:9]) == (None, None, None):
                        report["same_call"] += same(ours[:6] + ours[9:], theirs[:6] + theirs[9:])
                    report["steps"] += 1
    report["jit_runs"] = len(jit_runs) - report["steps"]  # the reference calls above are JIT
    report["keys"] = len(launch._variants)
print(json.dumps(report))
"""


@pytest.mark.slow
def test_gather_allocs_direct_launch_matches_tritons_jit(tmp_path) -> None:
    """The slot-taking kernel's launcher also launches compiled variants directly after the
    first of each per-step type combination (dtypes, flags, an int32 or int64 scalar), and
    the driver receives the call the JIT makes."""
    report = _run_on_the_no_gpu_driver(_ALLOC_SCRIPT, tmp_path)
    steps = 3 * 2 * 2 * 2
    # Variants: rejected (none, int32) x fresh (none, flags) x tail (i32, i64).
    assert report == {"steps": steps, "same_call": steps, "jit_runs": 8, "keys": 8}
