"""bench/gpu_check.sh on a machine without a GPU: a dry run that says so and stops within
seconds, before installing, running or writing anything."""

from __future__ import annotations

import os
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
