"""gather_pack compiled for a real GPU: device staging and pinned-host destinations.

Same scenarios as test_gather_pack.py, on CUDA tensors; plus the properties only a GPU can
show: direct stores into pinned host memory, no host synchronization, no allocation, and a
launch that can be captured into and replayed from a CUDA graph; the last two both through
``gather_pack`` and through the worker's ``GatherPackLaunch`` built once.
"""

from __future__ import annotations

import pytest
import torch
from gather_pack_cases import (
    QWEN3_30B,
    STEP_INPUTS,
    Case,
    Req,
    assert_same_bytes,
    build,
    clone_args,
    error_cases,
    graph_script,
    load_step,
    prepared_launch,
    special_cases,
    standard_cases,
)

from r3capture.kernels import can_write_host_directly, gather_pack, gather_pack_reference
from r3capture.kernels._device import kernel_address

pytestmark = pytest.mark.gpu

ALL_CASES = standard_cases() + special_cases() + error_cases()


def _on_gpu(args: dict, dest_place: str) -> dict:
    """Inputs on the GPU; dest and step_info on the GPU or in pinned host memory."""
    out = {}
    for name, value in args.items():
        if not isinstance(value, torch.Tensor):
            out[name] = value
        elif name in ("dest", "step_info") and dest_place == "pinned":
            out[name] = value.clone().pin_memory()
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


@pytest.mark.parametrize("dest_place", ["device", "pinned"])
@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.id)
def test_matches_expected_on_gpu(case: Case, dest_place: str) -> None:
    built = build(case)
    args = _on_gpu(built["args"], dest_place)
    gather_pack(**args)
    torch.cuda.synchronize()
    assert_same_bytes("kernel dest", args["dest"], built["expected_dest"])
    assert_same_bytes("kernel step_info", args["step_info"], built["expected_info"])


@pytest.mark.parametrize("dest_place", ["device", "pinned"])
def test_reference_runs_on_gpu_tensors(dest_place: str) -> None:
    case = Case("ref", QWEN3_30B, 16, [Req(40, 7, 2), Req(1, 3), Req(4, 20, 1)])
    built = build(case)
    args = _on_gpu(built["args"], dest_place)
    gather_pack_reference(**args)
    assert_same_bytes("reference dest", args["dest"], built["expected_dest"])
    assert_same_bytes("reference step_info", args["step_info"], built["expected_info"])


def _mixed_step() -> Case:
    reqs = [Req(1, 17 * i + 3) for i in range(32)] + [Req(300, 45), Req(4, 99, 2)]
    return Case("graph", QWEN3_30B, 16, reqs)


def _packer(args: dict, via: str):
    """gather_pack over ``args``: one-shot, or the worker's GatherPackLaunch built once."""
    if via == "prepared":
        return prepared_launch(args)
    return lambda: gather_pack(**args)


@pytest.mark.parametrize("via", ["one-shot", "prepared"])
@pytest.mark.parametrize("dest_place", ["device", "pinned"])
def test_no_sync_and_no_allocation(dest_place: str, via: str) -> None:
    args = _on_gpu(build(_mixed_step())["args"], dest_place)
    gather_pack(**clone_args(args))  # compile outside the measured call
    pack = _packer(args, via)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pack()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() == before == torch.cuda.memory_allocated()


@pytest.mark.parametrize("via", ["one-shot", "prepared"])
@pytest.mark.parametrize("rows_layout", [False, True], ids=["slots", "rows"])
@pytest.mark.parametrize("dest_place", ["device", "pinned"])
def test_cuda_graph_capture_and_replay(dest_place: str, rows_layout: bool, via: str) -> None:
    # The same script as test_graph_script.py runs on the CPU, without the graph.
    (case, seed), *replays = graph_script(rows_layout)
    args = _on_gpu(build(case, seed=seed)["args"], dest_place)
    gather_pack(**clone_args(args))  # compile before capture
    pack = _packer(args, via)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pack()
    for case, seed in replays:
        # Every input of a new step (capture, query_start_loc, positions, table rows, the
        # ring and its block windows, num_rejected) and freshly poisoned outputs written into
        # the captured tensors, then a replay.
        fresh = build(case, seed=seed)
        changed = load_step(args, fresh["args"])
        assert set(STEP_INPUTS) <= changed, f"{case.id}: {set(STEP_INPUTS) - changed}"
        graph.replay()
        torch.cuda.synchronize()
        assert_same_bytes(f"replay {case.id} dest", args["dest"], fresh["expected_dest"])
        assert_same_bytes(f"replay {case.id} step_info", args["step_info"],
                          fresh["expected_info"])  # fmt: skip


def test_pageable_host_dest_is_rejected() -> None:
    args = _on_gpu(build(_mixed_step())["args"], "device")
    args["dest"] = args["dest"].cpu()  # pageable: the GPU cannot address it
    with pytest.raises(ValueError, match="dest must be on the capture's device"):
        gather_pack(**args)
