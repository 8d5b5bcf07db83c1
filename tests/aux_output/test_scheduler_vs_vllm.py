"""Differential test: r3capture's scheduler connector vs vLLM 0.33.0's on the same traces.

Both connectors sit on the same KV-cache-manager double and receive every call the engine
makes (TeeSchedulerConnector); each answer is compared: the metadata of every step (order
included), max_cache_hit, cap_external_hit, take_output rows, and errors. The worker is
vLLM's, and every run is also checked against the routing oracle.
"""

from __future__ import annotations

import dataclasses

import pytest

from sim import (
    SCENARIOS,
    make_trace,
    r3capture_scheduler,
    random_trace,
    run_trace,
    vllm_scheduler,
)
from sim.compare import ConnectorMismatch, tee_factory

pytest.importorskip("vllm.distributed.aux_output_connector.connector")

OURS_FIRST = tee_factory(r3capture_scheduler, vllm_scheduler)
VLLM_FIRST = tee_factory(vllm_scheduler, r3capture_scheduler)


def _run(trace, factory):
    tees = []

    def build(kv, kv_connector):
        tees.append(factory(kv, kv_connector))
        return tees[-1]

    result = run_trace(trace, scheduler_factory=build, record_metas=True)
    return result, tees[0]


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_scenario_same_decisions(scenario):
    result, tee = _run(make_trace(scenario, seed=3), OURS_FIRST)
    assert tee.calls["build_connector_meta"] == result.stats.steps
    assert tee.calls["take_output"] >= len(result.final_tokens)
    if result.stats.prefix_hit_tokens or result.stats.preemptions:
        assert tee.calls["max_cache_hit"] > 0


def test_eviction_without_capping_still_agrees_until_the_worker_fails():
    trace = make_trace("eviction", seed=0, cap_hits=False)
    tees = []

    def build(kv, kv_connector):
        tees.append(OURS_FIRST(kv, kv_connector))
        return tees[-1]

    result = run_trace(trace, scheduler_factory=build, catch_errors=True)
    assert result.error is not None and result.error.kind == "BlockObjectStoreError"
    assert "max_cache_hit" not in tees[0].calls


def test_capping_and_loading_paths_are_exercised():
    trace = make_trace("eviction", seed=1, async_kv_load=True)
    result, tee = _run(trace, VLLM_FIRST)
    assert tee.calls["cap_external_hit"] > 0
    assert result.stats.external_hits_capped > 0
    assert tee.calls.get("request_loading", 0) == result.stats.async_loads > 0
    assert any(meta.released_block_hashes for meta in result.metas)
    assert any(meta.retained_block_hashes for meta in result.metas)


def test_reset_and_hash_only_updates_agree():
    result, tee = _run(make_trace("reset", seed=5), VLLM_FIRST)
    assert tee.calls["reset"] == result.stats.resets == 3
    assert {meta.generation for meta in result.metas} == {0, 1, 2, 3}
    result, _ = _run(make_trace("async_spec", seed=2), OURS_FIRST)
    assert result.stats.hash_only_updates > 0


@pytest.mark.parametrize("seed", range(12))
def test_random_traces_same_decisions(seed):
    run_trace(random_trace(1000 + seed), scheduler_factory=OURS_FIRST if seed % 2 else VLLM_FIRST)


def test_tee_detects_a_divergent_connector():
    """The comparison can fail: a connector that forgets prompt starts is caught."""

    class Forgetful:
        def __init__(self, kv, kv_connector):
            self.inner = r3capture_scheduler(kv, kv_connector)

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def build_connector_meta(self, scheduler_output, requests):
            meta = self.inner.build_connector_meta(scheduler_output, requests)
            meta.requests = {k: 0 for k in meta.requests}
            return meta

    trace = make_trace("decode", seed=0)
    trace = trace.replace(
        requests=tuple(dataclasses.replace(r, prompt_start=2) for r in trace.requests)
    )
    with pytest.raises(ConnectorMismatch, match="build_connector_meta"):
        run_trace(trace, scheduler_factory=tee_factory(vllm_scheduler, Forgetful))
