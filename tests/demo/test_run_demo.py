"""The demo's report: its request times are said to be CPU emulation when they are."""

from __future__ import annotations

import numpy as np
import pytest

from demo.run_demo import print_report
from demo.scenario import RequestResult, ScenarioRun

METRICS = {
    "spec_draft_tokens": 6.0,
    "spec_accepted_tokens": 2.0,
    "prefix_cache_hit_tokens": 0.0,
    "model_tokens": 12.0,
    "requests": 1.0,
}


def _run(backend: str, seconds: float) -> ScenarioRun:
    rows = np.zeros((11, 2, 2), np.uint8)
    result = RequestResult("single", list(range(3, 10)), [5] * 5, 0, rows, 0, seconds)
    return ScenarioRun(backend, {"single": result}, dict(METRICS), startup_s=30.0)


@pytest.mark.parametrize("emulated", [True, False])
def test_the_report_says_when_its_times_are_cpu_emulation(capsys, emulated):
    """Under the CPU emulation r3capture's kernel runs in the Triton interpreter, 2-3x slower
    per request than vLLM's torch ops; without a word a reader takes that for r3capture's
    speed. Served as is (``MODEL=...``, a GPU) the times are real and nothing is added."""
    print_report(_run("torch", 0.5), _run("triton", 1.2), (2, 2), "uint8", emulated=emulated)
    out = capsys.readouterr().out
    assert ("CPU emulation" in out) == emulated
    assert ("Triton interpreter" in out) == emulated
    table = out.splitlines()
    assert any(line.startswith("single") and "0.50" in line and "1.20" in line for line in table)
