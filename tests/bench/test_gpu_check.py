"""bench/gpu_check.sh on a machine without a GPU: a dry run that says so and stops within
seconds, before installing, running or writing anything."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs every stage")
@pytest.mark.parametrize(
    ("python", "reason"),
    [(sys.executable, "sees no CUDA device"), ("/nonexistent/python3", "No such file")],
    ids=["torch-without-cuda", "no-python"],
)
def test_stops_at_once_without_a_gpu(tmp_path: Path, python: str, reason: str) -> None:
    out = tmp_path / "results"
    started = time.monotonic()
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(out)],
        env={**os.environ, "PYTHON": python},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert time.monotonic() - started < 60
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("gpu_check: no usable GPU: ")
    assert reason in proc.stderr and "nothing was run" in proc.stderr
    assert proc.stdout == ""
    assert not out.exists()


def test_an_unknown_stage_is_refused_before_anything_runs(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(out), "gpu_parts", "kernel_benchh"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.startswith("gpu_check: unknown stage 'kernel_benchh'; known: ")
    assert not out.exists()


def test_named_stages_run_alone_and_the_rest_say_so(tmp_path: Path) -> None:
    # A stand-in interpreter that "sees a GPU" and succeeds at every command it is given,
    # logging them: what the script runs, not what the stages measure.
    calls = tmp_path / "calls"
    fake = tmp_path / "python3"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {calls}\necho "Fake GPU"\n')
    fake.chmod(0o755)
    out = tmp_path / "results"
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(out), "gpu_parts", "nvml_profile"],
        env={**os.environ, "PYTHON": str(fake)},
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (out / "summary.txt").read_text().splitlines()
    verdicts = {line.split(":")[0]: line.split(":", 1)[1].strip() for line in summary}
    assert list(verdicts) == [
        "install", "imports", "pytest_gpu", "gpu_host_step", "gpu_parts", "kernel_bench",
        "nvml_profile",
    ]  # fmt: skip
    ran = {name for name, verdict in verdicts.items() if verdict.startswith("ok")}
    assert ran == {"install", "imports", "gpu_parts", "nvml_profile"}
    assert all(verdicts[name] == "not run (not named)" for name in verdicts.keys() - ran)
    modules = [line.split()[1] for line in calls.read_text().splitlines() if line.startswith("-m")]
    assert modules == ["pip", "bench.gpu_parts", "bench.nvml_profile"]


def test_source_digest_names_the_tree_not_its_git(tmp_path: Path) -> None:
    root = SCRIPT.parents[1]
    copy = tmp_path / "copy"
    skip = shutil.ignore_patterns("results", ".cache", "__pycache__", "*.png", "*.json")
    for name in ("aux_output", "kernels", "store", "sim", "bench", "tests"):
        shutil.copytree(root / name, copy / name, ignore=skip)
    shutil.copy(root / "pyproject.toml", copy)

    def digest(tree: Path) -> str:
        proc = subprocess.run(
            ["bash", str(tree / "bench" / "tree_digest.sh")],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        return proc.stdout.strip()

    here = digest(root)
    assert len(here) == 16 and int(here, 16) >= 0
    assert digest(copy) == here  # no .git in the copy: the same sources, the same digest
    (copy / "kernels" / "__pycache__").mkdir(exist_ok=True)
    (copy / "kernels" / "__pycache__" / "x.pyc").write_bytes(b"\0")
    assert digest(copy) == here
    changed = copy / "kernels" / "_device.py"
    changed.write_text(changed.read_text() + "\n")
    assert digest(copy) != here
