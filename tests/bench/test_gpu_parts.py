"""bench/gpu_parts.py dry-run on the CPU: every part it times is reached, nests inside the
call it belongs to, and the timers leave the worker as they found it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import gpu_parts
from r3capture.aux_output.step_launcher import StepLauncher
from r3capture.kernels import GatherAllocLaunch


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU it runs")
def test_without_cuda_it_says_so_and_exits_3(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_parts.main([]) == gpu_parts.NO_CUDA_EXIT
    assert "no CUDA device here" in capsys.readouterr().err


def test_cpu_dry_run_times_every_part_within_its_call(tmp_path: Path) -> None:
    layout_of, launch_checked = StepLauncher.layout_of, GatherAllocLaunch.launch_checked
    assert gpu_parts.main(["--device", "cpu", "--families", "spec-k3", "--out", str(tmp_path)]) == 0
    # Unwrapped again.
    assert StepLauncher.layout_of is layout_of
    assert GatherAllocLaunch.launch_checked is launch_checked
    doc = json.loads((tmp_path / "gpu_parts.json").read_text())
    ops = doc["ops_us_p50"]
    assert ops["step_info D2H copy_ (1024 x 4 int32)"] > 0
    assert ops["vLLM cast: capture[:256].to(uint8)"] > 0
    assert not [name for name in ops if "upload" in name or "scatter" in name]
    parts = doc["parts"]["spec-k3"]
    assert parts["steps"] > 100
    prepare, enqueue = parts["prepare_output"]["total"], parts["enqueue_cpu_copy"]["total"]
    inside_prepare = ["layout_of", "launcher checks", "queue reserve", "fresh flags", "launch"]
    assert all(parts[name]["total"] > 0 for name in inside_prepare)
    assert sum(parts[name]["total"] for name in inside_prepare) <= prepare
    # Every forward step launches: the launch is timed in every one of them.
    assert parts["launch"]["p50"] > 0
    assert parts["copy_back"]["total"] <= enqueue
