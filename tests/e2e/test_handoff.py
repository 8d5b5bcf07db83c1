"""The step's device num_rejected reaches r3capture's kernel: rejected rows are never written.
A step without drafts, which can reject nothing, launches without the counts.

Runs tests/e2e/handoff_probe.py (vLLM in one process, the backend selected from Python via
additional_config, n-gram speculative decoding) and checks every kernel launch it recorded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from demo.scenario import SPECULATIVE_CONFIG

pytestmark = pytest.mark.e2e

PROBE = Path(__file__).with_name("handoff_probe.py")


def test_kernel_gets_device_num_rejected_and_writes_accepted_rows_only(tiny_model, server_env):
    prompt = [5, 6, 7, 8] * 12
    env = {**os.environ, **server_env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run(
        [sys.executable, str(PROBE), tiny_model, json.dumps(prompt), "48",
         json.dumps(SPECULATIVE_CONFIG)],
        env=env, capture_output=True, text=True, timeout=600, start_new_session=True,
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-6000:]
    probe = json.loads(lines[0].removeprefix("PROBE "))

    launches = probe["launches"]
    assert launches, "the capture kernel never ran"
    for launch in launches:
        assert launch["status"] == [0] * len(launch["status"])
        (written,) = launch["written"]
        if launch["drafts"] == 0:  # the prompt's prefill: every row is kept
            assert launch["num_rejected"] is None, f"counts of a step without drafts: {launch}"
            assert written == launch["rows"]
            continue
        assert launch["num_rejected"] is not None, f"kernel launched without num_rejected: {launch}"
        # One request per step here: rows computed = accepted + rejected.
        (rejected,) = launch["num_rejected"]
        assert written == launch["rows"] - rejected
    assert launches[0]["drafts"] == 0, "the prefill came with drafts"
    verified = [launch for launch in launches if launch["drafts"]]
    assert any(launch["num_rejected"][0] > 0 for launch in verified), "no draft was rejected"
    assert probe["rows_shape"] == [len(prompt) + len(probe["output"]) - 1, 2, 2]
