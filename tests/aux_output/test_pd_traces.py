"""P/D decoder traces through the simulator (``sim.pd``): vLLM 0.33.0's scheduler-side aux
connector wrapped by ``PDSchedulerConnector`` and r3capture's worker under ``splice``, with
decode-leg requests whose prompt KV a prefiller computed (NIXL's backoff trims 0 to 5 of its
last tokens, so hits end on and off block boundaries), loaded at once or over several steps,
preempted and resumed, their next turns as plain requests, other plain requests sharing
prefixes, at depths 1 and 2.

Every seed: nothing fails (no request reads rows it lacks), every finished request's rows
are the routing oracle's from its emit start (a decode-leg request's: its first computed
position), and where vLLM's own connector and worker run the trace clean, plain requests
are byte-identical to theirs and decode-leg ones are the tail of theirs. Two guards taken
out make seeds fail.
"""

from __future__ import annotations

from unittest import mock

import pytest

from r3capture.aux_output.pd_scheduler import PDSchedulerConnector
from sim.pd import check_pd_case

pytest.importorskip("vllm.distributed.aux_output_connector.connector")

SEEDS = range(150)


def _failures(seeds):
    failed, totals = {}, {}
    for seed in seeds:
        problem, stats = check_pd_case(seed)
        if problem is not None:
            failed[seed] = problem
        for name, value in vars(stats).items():
            totals.setdefault(name, []).append(value)
    return failed, totals


def test_pd_traces_return_the_oracles_rows_and_vllms_for_plain_requests():
    failed, totals = _failures(SEEDS)
    assert not failed, "\n".join(f"seed {s}: {p}" for s, p in failed.items())

    def seeds_with(name):
        return sum(value > 0 for value in totals[name])

    # What the seeds exercise: the share of seeds with at least one of each (of 200 seeds,
    # 180 had a decode-leg hit let through, 171 an unaligned one, 95 a capped hit, 108 an
    # asynchronous load, 67 a preempted decode-leg request, 186 a local prefix hit, 47 a
    # preempted request's output delivered late).
    assert seeds_with("remote_hits") >= 0.8 * len(SEEDS)
    assert seeds_with("remote_hits_unaligned") >= 0.7 * len(SEEDS)
    assert seeds_with("external_hits_capped") >= 0.3 * len(SEEDS)
    assert seeds_with("async_loads") >= 0.4 * len(SEEDS)
    assert seeds_with("decode_leg_preemptions") >= 0.2 * len(SEEDS)
    assert seeds_with("prefix_hit_tokens") >= 0.8 * len(SEEDS)
    assert seeds_with("stale_outputs") >= 0.1 * len(SEEDS)


def test_without_the_partial_block_mark_a_plain_request_reads_rows_never_computed():
    """The block an unaligned hit ends in, left out of the rowless set: a plain next turn
    hits it once the decode-leg request's output completed it, and its rows are not in the
    store."""
    with mock.patch.object(PDSchedulerConnector, "_record_partial_keys", lambda self: None):
        failed, _ = _failures(range(20))
    assert len(failed) >= 3, failed
    assert all("BlockObjectStoreError" in problem for problem in failed.values()), failed


def test_without_the_emit_start_raise_a_decoder_reads_rows_it_never_computed():
    def unraised(self, scheduler_output, requests):
        return self._inner.build_connector_meta(scheduler_output, requests)

    with mock.patch.object(PDSchedulerConnector, "build_connector_meta", unraised):
        failed, _ = _failures(range(10))
    assert len(failed) >= 5, failed
    assert all("Error" in problem for problem in failed.values()), failed
