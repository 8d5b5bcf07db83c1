"""bench.triton_launch: host CPU of one launch, Triton's JIT path against the direct one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import triton_launch as tl

ROOT = Path(__file__).resolve().parents[2]


def test_refuses_to_run_under_the_interpreter(monkeypatch, capsys) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tl.main(["--calls", "1"]) == 2
    assert "unset TRITON_INTERPRET" in capsys.readouterr().out


@pytest.mark.slow
def test_main_writes_every_provider_for_every_case(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "triton_launch", "--calls", "40",
         "--out", str(tmp_path)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    payload = json.loads((tmp_path / "triton_launch.json").read_text())
    assert (tmp_path / "triton_launch.png").stat().st_size > 0
    rows = payload["rows"]
    cases = {
        (r["params"]["model"], r["params"]["num_reqs"], r["params"]["num_rejected"]) for r in rows
    }
    assert cases == {
        (model, n, rejected)
        for model in ("Qwen3-30B-A3B", "Kimi-K2")
        for n in tl.BATCH_SIZES
        for rejected in (True, False)
    }
    for case in cases:
        providers = [
            r["provider"]
            for r in rows
            if (r["params"]["model"], r["params"]["num_reqs"], r["params"]["num_rejected"]) == case
        ]
        assert sorted(providers) == sorted(tl.PROVIDERS)
    assert all(r["params"]["cpu_p50"] > 0 for r in rows)
