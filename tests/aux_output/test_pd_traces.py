"""P/D decoder traces through the simulator (``sim.pd``): vLLM 0.33.0's scheduler-side aux
connector wrapped by ``PDSchedulerConnector`` and r3capture's worker under ``splice``, with
decode-leg requests whose prompt KV a prefiller computed (NIXL's backoff trims 0 to 5 of its
last tokens, so hits end on and off block boundaries), loaded at once or over several steps,
whole prompts among them (loaded asynchronously, the last token then recomputed, or reported
one token short by a synchronous connector), preempted and resumed, their next turns as
plain requests, other plain requests sharing prefixes, at depths 1 and 2.

Every seed: nothing fails (no request reads rows it lacks), every finished request's rows
are the routing oracle's from its emit start (a decode-leg request's: its first computed
position), and where vLLM's own connector and worker run the trace clean, plain requests
are byte-identical to theirs and decode-leg ones are the tail of theirs. Guards taken out
make seeds fail.
"""

from __future__ import annotations

from unittest import mock

import pytest

from r3capture.aux_output.pd_scheduler import PDSchedulerConnector
from sim.pd import check_pd_case

pytest.importorskip("vllm.distributed.aux_output_connector.connector")

SEEDS = range(150)


def _failures(seeds, **overrides):
    failed, totals = {}, {}
    for seed in seeds:
        problem, stats = check_pd_case(seed, **overrides)
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
    # 190 had a decode-leg hit let through, 179 an unaligned one, 115 an asynchronous load,
    # 75 one of a whole prompt, 51 a synchronous hit on a whole prompt, 65 a preempted
    # decode-leg request, 181 a local prefix hit, 52 a preempted request's output delivered
    # late; none a capped hit).
    assert seeds_with("remote_hits") >= 0.8 * len(SEEDS)
    assert seeds_with("remote_hits_unaligned") >= 0.7 * len(SEEDS)
    assert seeds_with("async_loads") >= 0.4 * len(SEEDS)
    assert seeds_with("decode_leg_preemptions") >= 0.2 * len(SEEDS)
    assert seeds_with("prefix_hit_tokens") >= 0.8 * len(SEEDS)
    assert sum(totals["external_hits_capped"]) == 0  # every decode-leg hit is loaded
    assert seeds_with("stale_outputs") >= 0.1 * len(SEEDS)
    assert seeds_with("whole_prompt_loads") >= 0.25 * len(SEEDS)
    assert seeds_with("whole_prompt_hits_sync") >= 0.15 * len(SEEDS)


def test_pd_traces_with_opted_out_requests():
    """Half of the requests (decode-leg ones and plain ones, which hit each other's blocks)
    opt out of routed experts: they get none, and every other request is checked as above
    against vLLM's run with every request opted in."""
    failed, totals = _failures(range(60), opt_out=0.5)
    assert not failed, "\n".join(f"seed {s}: {p}" for s, p in failed.items())
    assert sum(value > 0 for value in totals["remote_hits_unaligned"]) >= 30


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


def test_without_the_last_tokens_block_a_plain_request_reads_rows_never_computed():
    """After a whole-prompt load vLLM recomputes the last token: the block holding it has
    that row only. Left out of the rowless set (as if the load had brought it whole, or the
    decoder computed it), a plain next turn hits it and its rows are not in the store. The
    seeds run with NIXL's asynchronous loads and 32-token KV blocks, so that the last
    token's block is more often the first one past a local hit with rows (a plain request
    stops at an earlier loaded block)."""
    capped = PDSchedulerConnector.cap_external_hit

    def last_block_unmarked(self, request, num_local, num_external):
        allowed = capped(self, request, num_local, num_external)
        if num_local + allowed == request.num_tokens and self._is_decode_leg(request):
            index = (request.num_tokens - 1) // self._block_size
            self._partial_of.pop(request.request_id, None)
            for _, key in self._blocks(request, index, index + 1):
                self._rowless.discard(key)
        return allowed

    with mock.patch.object(PDSchedulerConnector, "cap_external_hit", last_block_unmarked):
        failed, _ = _failures(range(40), block_size=32, hash_block_size=16, async_kv_load=True)
    assert len(failed) >= 3, failed
    assert all("BlockObjectStoreError" in problem for problem in failed.values()), failed
