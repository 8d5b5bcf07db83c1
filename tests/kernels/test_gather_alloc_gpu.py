"""gather_alloc compiled for a real GPU: device and pinned-host destinations.

Same scenarios as test_gather_alloc_steps.py, on CUDA tensors; plus the properties only a
GPU can show: direct stores into pinned host memory (the queue read from there too, as the
worker keeps it), no host synchronization, no allocation, and a launch that can be captured
into and replayed from a CUDA graph; the last two both through ``gather_alloc`` and through
the worker's ``GatherAllocLaunch`` built once.
"""

from __future__ import annotations

import pytest
import torch
from gather_alloc_cases import (
    QWEN3_30B,
    STATE,
    STEP_INPUTS,
    Case,
    Req,
    assert_state,
    build,
    clone_args,
    error_cases,
    graph_script,
    load_step,
    prepared_launch,
    special_cases,
    standard_cases,
)

from r3capture.kernels import can_write_host_directly, gather_alloc, gather_alloc_reference
from r3capture.kernels._device import kernel_address

pytestmark = pytest.mark.gpu

ALL_CASES = standard_cases() + special_cases() + error_cases()
# Where the worker may keep them in host memory: the queue always (``SlotQueue``), the
# destination and step_info when the kernel writes the arena directly.
HOST_SIDE = ("queue", "dest", "step_info")


def _on_gpu(args: dict, place: str) -> dict:
    """Inputs and state on the GPU; queue, dest and step_info on the GPU or in pinned host
    memory."""
    out = {}
    for name, value in args.items():
        if not isinstance(value, torch.Tensor):
            out[name] = value
        elif name in HOST_SIDE and place == "pinned":
            out[name] = value.cpu().clone().pin_memory()
        else:
            out[name] = value.to("cuda")
    return out


@pytest.fixture(scope="module", autouse=True)
def _device_probe() -> None:
    # Probing synchronizes once; do it before tests that forbid synchronization.
    can_write_host_directly("cuda")


def test_this_gpu_writes_pinned_host_memory_directly() -> None:
    assert can_write_host_directly(torch.cuda.current_device()) is True
    assert can_write_host_directly("cpu") is False


def test_kernel_addresses_of_device_and_pinned_tensors() -> None:
    device = torch.zeros(64, dtype=torch.int32, device="cuda")[3:]
    pinned = torch.zeros(64, dtype=torch.int32).pin_memory()[5:]
    pageable = torch.zeros(64, dtype=torch.int32)
    assert kernel_address(device) == device.data_ptr()
    # With unified addressing the driver maps pinned memory at its host address.
    assert kernel_address(pinned) == pinned.data_ptr()
    assert kernel_address(pageable) is pageable  # unmapped: Triton's launcher refuses it


def test_the_quick_device_test_passes_only_tensors_on_the_launch_gpu() -> None:
    from r3capture.kernels._alloc_checks import CPU_INDEX, _device_index, step_tensors_pass

    index = torch.cuda.current_device()
    assert _device_index(torch.zeros(1, device="cuda").device) == index
    step = [torch.arange(n, device="cuda") for n in (3, 4, 2, 2)]
    assert step_tensors_pass(index, *step, num_reqs=2, num_rows=4)
    assert not step_tensors_pass(CPU_INDEX, *step, num_reqs=2, num_rows=4)
    assert not step_tensors_pass(index + 1, *step, num_reqs=2, num_rows=4)
    for at in range(4):
        moved = list(step)
        moved[at] = moved[at].cpu()
        assert not step_tensors_pass(index, *moved, num_reqs=2, num_rows=4)
        moved[at] = moved[at].pin_memory()
        assert not step_tensors_pass(index, *moved, num_reqs=2, num_rows=4)


@pytest.mark.parametrize("place", ["device", "pinned"])
@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.id)
def test_matches_expected_on_gpu(case: Case, place: str) -> None:
    built = build(case)
    args = _on_gpu(built["args"], place)
    gather_alloc(**args)
    torch.cuda.synchronize()
    assert_state("kernel", args, built["expected"])


@pytest.mark.parametrize("place", ["device", "pinned"])
def test_reference_runs_on_gpu_tensors(place: str) -> None:
    case = Case("ref", QWEN3_30B, 16, [Req(40, 7, 2), Req(1, 3), Req(4, 20, 1, fresh=True)])
    built = build(case)
    args = _on_gpu(built["args"], place)
    gather_alloc_reference(**args)
    assert_state("reference", args, built["expected"])


def _mixed_step() -> Case:
    reqs = [Req(1, 17 * i + 3) for i in range(32)] + [Req(300, 45), Req(4, 99, 2)]
    return Case("graph", QWEN3_30B, 16, reqs + [Req(20, 0, fresh=True)])


def _launcher(args: dict, via: str):
    """gather_alloc over ``args``: one-shot, or the worker's GatherAllocLaunch built once."""
    if via == "prepared":
        return prepared_launch(args)
    return lambda: gather_alloc(**args)


@pytest.mark.parametrize("via", ["one-shot", "prepared"])
@pytest.mark.parametrize("place", ["device", "pinned"])
def test_no_sync_and_no_allocation(place: str, via: str) -> None:
    built = build(_mixed_step())
    args = _on_gpu(built["args"], place)
    gather_alloc(**clone_args(args))  # compile outside the measured call
    launch = _launcher(args, via)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.cuda.set_sync_debug_mode("error")
    try:
        launch()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() == before == torch.cuda.memory_allocated()
    assert_state("launch", args, built["expected"])


@pytest.mark.parametrize("via", ["one-shot", "prepared"])
@pytest.mark.parametrize("rows_layout", [False, True], ids=["slots", "rows"])
@pytest.mark.parametrize("place", ["device", "pinned"])
def test_cuda_graph_capture_and_replay(place: str, rows_layout: bool, via: str) -> None:
    # The same script as test_graph_script.py runs on the CPU, without the graph.
    (case, seed), *replays = graph_script(rows_layout)
    built = build(case, seed=seed)
    args = _on_gpu(built["args"], place)
    gather_alloc(**clone_args(args))  # compile before capture
    launch = _launcher(args, via)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    # Capturing ran nothing: the state and outputs are as built.
    torch.cuda.synchronize()
    for name in STATE:
        assert torch.equal(args[name].cpu(), built["args"][name]), name
    for case, seed in replays:
        # Every input of a new launch (capture, query_start_loc, positions, request indices,
        # num_rejected) and the state it starts from (ring, records, queue, heads), and
        # freshly poisoned outputs written into the captured tensors, then a replay.
        fresh = build(case, seed=seed)
        changed = load_step(args, fresh["args"])
        assert set(STEP_INPUTS) <= changed, f"{case.id}: {set(STEP_INPUTS) - changed}"
        graph.replay()
        torch.cuda.synchronize()
        assert_state(f"replay {case.id}", args, fresh["expected"])


def test_pageable_host_dest_is_rejected() -> None:
    args = _on_gpu(build(_mixed_step())["args"], "device")
    args["dest"] = args["dest"].cpu()  # pageable: the GPU cannot address it
    with pytest.raises(ValueError, match="dest must be on the capture's device"):
        gather_alloc(**args)


def test_pageable_host_queue_is_rejected() -> None:
    args = _on_gpu(build(_mixed_step())["args"], "device")
    args["queue"] = args["queue"].cpu()
    with pytest.raises(ValueError, match="queue must be on the capture's device"):
        gather_alloc(**args)
