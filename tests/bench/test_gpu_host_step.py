"""bench/gpu_host_step.py: its arithmetic, and a dry run of every stage on the CPU (the
reference kernel in place of the launch), so a GPU run never fails on the harness."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bench import gpu_host_step as ghs


def _run(calls_us: list[list[float]], steps: list[tuple[int, int]]) -> dict:
    """One round of family ``f``: per call (CALLS order) and step, thread-CPU µs; wall = 2x."""
    cpu = np.asarray(calls_us, np.int64) * 1000
    return {"f": {"calls": np.stack([2 * cpu, cpu], axis=-1).tolist(), "steps": steps}}


def test_summary_counts_forward_steps_of_every_round_and_divides_theirs_by_ours() -> None:
    steps = [(3, 1), (0, 0), (8, 2)]  # the middle step had no forward
    ours = [
        _run([[10, 99, 20], [30, 0, 50], [5, 0, 7], [1, 0, 1]], steps),
        _run([[12, 0, 22], [40, 0, 60], [6, 0, 8], [1, 0, 1]], steps),
    ]
    theirs = [_run([[0, 0, 0], [3, 0, 4], [1, 0, 2], [0, 0, 0]], steps)] * 2
    summary = ghs.summarize({"r3capture-direct": ours, "vllm-gpu-path": theirs}, ["f"])["f"]
    mine = summary["r3capture-direct"]
    # Four forward steps (two rounds x two); the 99 µs begin_step of a step without a
    # forward is in no statistic.
    assert mine["cpu"]["begin_step"]["steps"] == 4
    assert mine["cpu"]["begin_step"]["total"] == 10 + 20 + 12 + 22
    assert mine["cpu"]["main"]["total"] == sum([10, 30, 5, 20, 50, 7, 12, 40, 6, 22, 60, 8])
    assert mine["wall"]["main"]["total"] == 2 * mine["cpu"]["main"]["total"]
    assert mine["cpu"]["gpu_path_calls"]["total"] == 30 + 5 + 50 + 7 + 40 + 6 + 60 + 8
    assert mine["cpu"]["prepare_output"]["p50"] == np.percentile([30, 50, 40, 60], 50)
    ratio = mine["ratio_vllm_over_ours"]
    assert ratio["gpu_path_calls"]["total"] == round((3 + 1 + 4 + 2) * 2 / 206, 3)
    assert ratio["enqueue_cpu_copy"]["total"] == round((1 + 2) * 2 / (5 + 7 + 6 + 8), 3)
    assert "ratio_vllm_over_ours" not in summary["vllm-gpu-path"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU it runs")
def test_without_cuda_it_says_so_and_exits_3(capsys: pytest.CaptureFixture[str]) -> None:
    assert ghs.main(["--rounds", "1"]) == ghs.NO_CUDA_EXIT
    assert "no CUDA device here" in capsys.readouterr().err


def test_cpu_dry_run_times_every_side_on_the_same_steps(tmp_path: Path) -> None:
    args = ["--device", "cpu", "--families", "decode-8", "--rounds", "1", "--out", str(tmp_path)]
    assert ghs.main(args) == 0
    doc = json.loads((tmp_path / "gpu_host_step.json").read_text())
    assert (tmp_path / "gpu_host_step.png").stat().st_size > 0
    assert doc["device"] == "cpu" and doc["families"] == ["decode-8"]
    runs = {side: rounds[0]["decode-8"] for side, rounds in doc["runs"].items()}
    assert set(runs) == set(ghs.SIDES)
    # One simulator, one seed: every side saw the same schedule, step for step.
    steps = runs["r3capture-direct"]["steps"]
    assert len(steps) > 100 and all(run["steps"] == steps for run in runs.values())
    forward = np.asarray([reqs > 0 for _, reqs in steps])
    for side, run in runs.items():
        cpu = np.asarray(run["calls"])[..., 1]  # [call, step]
        timed = cpu > 0
        begin, prepare, enqueue, process = timed
        if side == "vllm-gpu-path":
            assert not begin.any() and not process.any()  # its bookkeeping is not vLLM's
        else:
            assert begin.all() and (process <= forward).all() and process[forward].mean() > 0.9
        assert (prepare == forward).all() and (enqueue == forward).all(), side
    ratio = doc["summary"]["decode-8"]["r3capture-direct"]["ratio_vllm_over_ours"]
    assert ratio["gpu_path_calls"]["p50"] > 0
