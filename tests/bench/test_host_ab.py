"""The two-version host bench: a second copy of the package coexists with the installed one,
each replay runs the version installed for it, and a version whose outputs differ stops
the run."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from bench import host_ab
from bench.host_ab import (
    METRICS,
    SUBPACKAGES,
    Version,
    compare,
    installed_package,
    load_package,
    result_rows,
)
from sim import make_trace
from sim.recording import record_trace

pytest.importorskip("vllm.distributed.aux_output_connector.worker")

ROOT = Path(__file__).resolve().parents[2]


def _package_modules() -> dict:
    return installed_package()


@pytest.fixture
def copied_tree(tmp_path):
    for sub in SUBPACKAGES:
        shutil.copytree(ROOT / sub, tmp_path / sub, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_a_second_copy_loads_beside_the_installed_package(copied_tree):
    before = _package_modules()
    copy = load_package(copied_tree)
    assert _package_modules() == before  # the installed package is back, untouched
    worker = copy["r3capture.aux_output.worker"]
    assert Path(worker.__file__).is_relative_to(copied_tree)
    assert worker is not before.get("r3capture.aux_output.worker")
    # The copy's own modules, not the installed ones, behind its imports.
    assert worker.RequestBook is copy["r3capture.aux_output.request_book"].RequestBook
    # The kernel's CPU emulation, which the stand-in wraps: the copy's own too.
    reference = copy["r3capture.kernels.alloc_reference"]
    assert Path(reference.__file__).is_relative_to(copied_tree)
    assert reference is not before["r3capture.kernels.alloc_reference"]


def test_each_replay_runs_its_own_version(copied_tree, monkeypatch):
    """An A/A run over the same code: both versions reproduce the outputs; a replay of the
    copy calls the copy's worker only, and a broken copy stops the run."""
    recording = record_trace(make_trace("spec_decode", seed=0))
    installed = _package_modules()
    copy = Version("copy", load_package(copied_tree))
    tree = Version("tree", installed)
    calls = {"copy": 0, "tree": 0}
    for label, modules in (("copy", copy.modules), ("tree", installed)):
        worker_type = modules["r3capture.aux_output.worker"].TritonAuxOutputWorker
        original = worker_type.begin_step

        def counted(self, metadata, _original=original, _label=label):
            calls[_label] += 1
            return _original(self, metadata)

        monkeypatch.setattr(worker_type, "begin_step", counted)
    try:
        times = compare((copy, tree), {"t": recording}, rounds=2)
        assert times["t"].shape == (2, 2, len(METRICS))
        assert (times["t"] > 0).all()
        # Warm-up (part of the trace) plus two rounds, each version only through its own.
        assert calls["copy"] == calls["tree"] > 2 * recording.num_steps
        rows = result_rows(times, ("copy", "tree"), "m", 2)
        ratio = next(r for r in rows if r.provider == "tree" and r.op == "main")
        assert ratio.params["ratio_p50"] > 0
        copy_worker = copy.modules["r3capture.aux_output.worker"].TritonAuxOutputWorker
        process = copy_worker.process_output

        def drops_an_output(self, pending):
            outputs = process(self, pending)
            outputs.pop(next(iter(outputs), None), None)
            return outputs

        monkeypatch.setattr(copy_worker, "process_output", drops_an_output)
        with pytest.raises(RuntimeError, match="copy did not reproduce"):
            compare((copy, tree), {"t": recording}, rounds=1)
    finally:
        copy.close()
        tree.close()
    assert _package_modules() == installed


def test_a_version_whose_kernel_the_stand_in_misses_stops_the_run(copied_tree):
    """A version whose launches the stand-in does not see (as a base whose worker launched
    another kernel would be) would have its kernel's CPU emulation counted as host work:
    the run stops, naming it, rather than report a ratio."""
    recording = record_trace(make_trace("spec_decode", seed=0))
    installed = _package_modules()
    copy = Version("copy", load_package(copied_tree))
    tree = Version("tree", installed)
    try:
        with copy.installed():
            copy.stand_in.__exit__(None, None, None)  # the kernel runs unwrapped
        with pytest.raises(RuntimeError, match="copy: no stand-in launch"):
            compare((copy, tree), {"t": recording}, rounds=1)
    finally:
        copy.close()
        tree.close()
    assert _package_modules() == installed


def test_a_shadowed_run_replays_behind_vllm_with_the_kernel_deferred(copied_tree, monkeypatch):
    """``--shadow`` replays as host_step does: vLLM's connector is built beside each timed
    replay, and every launch's emulation is deferred and settled (none left over), with the
    outputs reproduced by both versions."""
    from bench import host_step_replay

    recording = record_trace(make_trace("spec_decode", seed=0))
    installed = _package_modules()
    copy = Version("copy", load_package(copied_tree), defer=True)
    tree = Version("tree", installed, defer=True)
    built = []
    make_connector = host_step_replay.make_connector

    def counted(name, sizing):
        built.append(name)
        return make_connector(name, sizing)

    monkeypatch.setattr(host_step_replay, "make_connector", counted)
    try:
        times = compare((copy, tree), {"t": recording}, rounds=2, shadow=True)
        assert (times["t"] > 0).all()
        # Warm-up plus two rounds per version, each timed replay with its shadow.
        assert built.count("vllm-0.33.0") == built.count("r3capture") == 6
        for version in (copy, tree):
            assert version.stand_in.defer and version.stand_in.launches > 0
            assert not version.stand_in._deferred
    finally:
        copy.close()
        tree.close()
    assert _package_modules() == installed


def test_the_figure_and_rows_name_both_versions():
    times = {
        "decode-1": np.stack([np.full((3, len(METRICS)), 10.0), np.full((3, len(METRICS)), 8.0)])
    }
    rows = result_rows(times, ("base abc", "working tree"), "Qwen3-30B-A3B", 2)
    assert {r.provider for r in rows} == {"base abc", "working tree"}
    main = next(r for r in rows if r.provider == "working tree" and r.op == "main")
    assert main.p50 == pytest.approx(8.0) and main.params["ratio_p50"] == pytest.approx(0.8)
    assert host_ab.figure(rows, ("base abc", "working tree")) is not None
