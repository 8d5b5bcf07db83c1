"""The environment variables of envs.py: defaults, spelling, refusals, and that the worker
reads them when its constructor leaves the choice open."""

from __future__ import annotations

import pytest
from test_worker import SIZES

from r3capture.aux_output import envs
from r3capture.aux_output.sizing import WorkerSizing
from r3capture.aux_output.worker import TritonAuxOutputWorker

CHOICES = [
    ("R3CAPTURE_KERNEL_IMPL", envs.kernel_impl, ("auto", "triton", "reference")),
    ("R3CAPTURE_DESTINATION", envs.destination, ("auto", "direct", "staging")),
]


@pytest.mark.parametrize(("name", "read", "values"), CHOICES, ids=[c[0] for c in CHOICES])
def test_choices_default_to_auto_and_ignore_case_and_spaces(monkeypatch, name, read, values):
    monkeypatch.delenv(name, raising=False)
    assert read() == "auto"
    for raw in ("", "   "):
        monkeypatch.setenv(name, raw)
        assert read() == "auto"
    for value in values:
        monkeypatch.setenv(name, f" {value.upper()} ")
        assert read() == value


@pytest.mark.parametrize(("name", "read", "values"), CHOICES, ids=[c[0] for c in CHOICES])
def test_an_unknown_choice_is_refused_by_name(monkeypatch, name, read, values):
    monkeypatch.setenv(name, "fastest")
    with pytest.raises(ValueError, match=f"{name}='fastest' is not one of"):
        read()


def test_the_worker_reads_them_when_its_arguments_leave_the_choice_open(monkeypatch):
    sizing = WorkerSizing(**SIZES)
    monkeypatch.setenv("R3CAPTURE_DESTINATION", "Staging")
    monkeypatch.setenv("R3CAPTURE_KERNEL_IMPL", "reference")
    worker = TritonAuxOutputWorker(sizing)
    assert worker.device_side.destination == "staging"
    # An explicit argument wins over the environment.
    explicit = TritonAuxOutputWorker(sizing, destination="direct")
    assert explicit.device_side.destination == "direct"
    explicit.close()
    monkeypatch.setenv("R3CAPTURE_KERNEL_IMPL", "fastest")
    with pytest.raises(ValueError, match="R3CAPTURE_KERNEL_IMPL='fastest'"):
        TritonAuxOutputWorker(sizing)
    TritonAuxOutputWorker(sizing, kernel_impl="reference").close()
    worker.close()


def test_the_replay_log_interval_defaults_to_vllms_stats_interval(monkeypatch):
    monkeypatch.delenv("R3CAPTURE_REPLAY_LOG_INTERVAL_S", raising=False)
    assert envs.replay_log_interval_s() == 10.0
    monkeypatch.setenv("R3CAPTURE_REPLAY_LOG_INTERVAL_S", " 0 ")
    assert envs.replay_log_interval_s() == 0.0
    monkeypatch.setenv("R3CAPTURE_REPLAY_LOG_INTERVAL_S", "2.5")
    assert envs.replay_log_interval_s() == 2.5


@pytest.mark.parametrize("raw", ["-1", "soon", "nan"])
def test_a_replay_log_interval_that_is_not_seconds_is_refused_by_name(monkeypatch, raw):
    monkeypatch.setenv("R3CAPTURE_REPLAY_LOG_INTERVAL_S", raw)
    with pytest.raises(ValueError, match=f"R3CAPTURE_REPLAY_LOG_INTERVAL_S='{raw}'"):
        envs.replay_log_interval_s()
