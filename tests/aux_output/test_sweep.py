"""``python -m sim.sweep``: what a seed draws, that clean seeds pass, and that a worker
returning one wrong byte fails the seed and the command."""

from __future__ import annotations

from unittest import mock

import pytest

from r3capture.aux_output import (
    call_checks,
    publisher,
    request_book,
    request_table,
    sizing,
    small_step,
)
from r3capture.aux_output.types import AuxRequestOutput
from sim.sweep import VLLM_WRONG, draw_case, main, patched_knobs, run_case
from sim.trace import ROLLOUTS, random_trace

pytest.importorskip("vllm.distributed.aux_output_connector.worker")


def test_a_seed_draws_the_same_case_every_time_and_only_cases_the_worker_supports():
    cases = [draw_case(seed) for seed in range(400)]
    assert cases == [draw_case(seed) for seed in range(400)]
    assert len({repr(case) for case in cases}) == 400
    for case in cases:
        depth = case.shape["max_concurrent_batches"]
        drafts = case.shape["num_spec_tokens"]
        # A narrower reattach window than the drafts of the steps in flight is refused.
        assert case.knobs["REATTACH_TOKENS"] >= max(depth - 1, 1) * drafts
        if depth >= 3:
            assert case.destination != "direct"
    # Every alternative is drawn: both sides of each threshold, both destinations.
    assert {case.knobs["PER_REQUEST_MAX"] for case in cases} >= {0, 1000}
    assert {case.knobs["PER_ROW_MAX"] for case in cases} >= {0, 1000}
    assert {case.knobs["EMIT_LIST_MAX"] for case in cases} >= {0, 1000}
    assert {case.knobs["REMOVE_PER_ROW_MAX"] for case in cases} >= {0, 1000}
    assert {case.knobs["REATTACH_TOKENS"] for case in cases} >= {0, 256}
    assert {case.destination for case in cases} == {"auto", "staging", "direct"}
    assert {case.interleave_seed is None for case in cases} == {True, False}
    assert {case.shape["kv_delivery"] for case in cases} == {True, False}


def test_knobs_are_patched_only_for_the_run():
    knobs = {"REATTACH_TOKENS": 3, "PER_REQUEST_MAX": 0, "PER_ROW_MAX": 0}
    with patched_knobs({**knobs, "EMIT_LIST_MAX": 0, "REMOVE_PER_ROW_MAX": 0}):
        assert request_table.REMOVE_PER_ROW_MAX == 0
        assert sizing.REATTACH_TOKENS == 3
        assert small_step.PER_REQUEST_MAX == 0
        assert publisher.PER_ROW_MAX == 0
        assert call_checks.EMIT_LIST_MAX == 0
    assert sizing.REATTACH_TOKENS == 256
    assert small_step.PER_REQUEST_MAX == 32
    assert publisher.PER_ROW_MAX == 8
    assert call_checks.EMIT_LIST_MAX == 32
    assert request_table.REMOVE_PER_ROW_MAX == 8


@pytest.mark.parametrize("seed", range(6))
def test_clean_seeds_pass(seed):
    assert run_case(draw_case(seed)) is None


def _one_flipped_byte():
    """RequestBook.commit whose first output of every step has one byte flipped."""
    original = request_book.RequestBook.commit

    def commit(self, *args):
        outputs = original(self, *args)
        for request_id, output in outputs.items():
            rows = output.rows.copy()
            rows.reshape(-1)[0] ^= 1
            outputs[request_id] = AuxRequestOutput(output.token_start, rows)
            break
        return outputs

    return mock.patch.object(request_book.RequestBook, "commit", commit)


def test_a_wrong_byte_fails_the_seed_and_the_command(capsys):
    with _one_flipped_byte():
        problem = run_case(draw_case(0))
        status = main(["--seeds", "0:2", "--stop-first"])
    assert problem is not None and "differ" in problem
    out = capsys.readouterr().out
    assert status == 1
    assert "FAILED seed 0" in out and "repeat: python -m sim.sweep --seeds 0:1" in out
    assert "1 seeds (0:1), 1 failed, 0 where only vLLM fails" in out
    assert main(["--seeds", "0:2"]) == 0


def test_a_seed_range_must_name_seeds():
    with pytest.raises(SystemExit):
        main(["--seeds", "5:5"])
    with pytest.raises(SystemExit):
        main(["--seeds", "x"])


def test_a_seed_where_only_vllm_fails_passes_and_is_counted_apart(capsys):
    # Seed 85: a request resumed with a step of its earlier run in flight, under a KV
    # connector that must deliver (tests/aux_output/test_resumed_requests.py).
    case = draw_case(85)
    assert case.shape["kv_delivery"] and case.shape["max_concurrent_batches"] == 3
    assert run_case(case) == VLLM_WRONG
    assert main(["--seeds", "85:86"]) == 0
    assert "1 seeds (85:86), 0 failed, 1 where only vLLM fails" in capsys.readouterr().out


def test_only_the_simulators_step_limit_counts_as_an_unfinished_trace():
    from types import SimpleNamespace

    from sim.engine import SimError
    from sim.sweep import _unfinished

    def result(phase, exc):
        return SimpleNamespace(error=SimError(7, phase, exc))

    assert _unfinished(result("engine", RuntimeError("trace t did not finish in 9 steps")))
    assert not _unfinished(result("engine", RuntimeError("KV prefix-cache reset refused")))
    assert not _unfinished(result("process_output", RuntimeError("did not finish")))
    assert not _unfinished(SimpleNamespace(error=None))


def test_rollout_shapes_change_only_the_requests():
    """A seed reshaped as an RL rollout keeps its config, model and resets; ``agentic``
    makes most requests ask only for their new rows, ``groups`` samples some first turns
    several times, each sample with its own tokens; both are drawn for some seeds."""
    plain, agentic, groups = (random_trace(11, rollout=k) for k in (None, *ROLLOUTS))
    for reshaped in (agentic, groups):
        assert (reshaped.config, reshaped.model, reshaped.reset_steps) == (
            plain.config, plain.model, plain.reset_steps
        )  # fmt: skip
    asked = [q.prompt_start for q in agentic.requests]
    assert [q.prompt for q in agentic.requests] == [q.prompt for q in plain.requests]
    assert sum(0 < start for start in asked) >= len(asked) // 2
    copies = [q for q in groups.requests if q.req_id not in {p.req_id for p in plain.requests}]
    assert copies and all(c.after is None for c in copies)
    for copy in copies:
        original = next(q for q in plain.requests if copy.req_id.startswith(q.req_id + "s"))
        assert (copy.prompt, copy.arrival_step) == (original.prompt, original.arrival_step)
        assert copy.tokens != original.tokens
    drawn = {draw_case(seed).rollout for seed in range(200)}
    assert drawn == {None, *ROLLOUTS}
    with pytest.raises(ValueError, match="rollout must be one of"):
        random_trace(0, rollout="chat")
