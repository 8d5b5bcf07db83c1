"""Hypothesis-driven random traces: config (async, drafts, chunking, KV pressure, offload
tier with sync/async loads, padding, hash/KV block sizes), shared prefixes, multi-turn
chains, returning prompts, aborts and prefix-cache resets, all drawn from one seed.

Each trace: both scheduler connectors agree call by call, vLLM's worker reproduces the
routing oracle, and r3capture's worker is byte-identical to vLLM's.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3capture.aux_output import publisher, sizing, small_step
from sim import (
    make_trace,
    make_vllm_worker,
    r3capture_scheduler,
    r3capture_worker_factory,
    random_trace,
    replay_scheduler,
    run_trace,
    vllm_scheduler,
)
from sim.compare import diff_opted_in, diff_results, run_vllm_all_opted_in, tee_factory
from sim.trace import ROLLOUTS

pytest.importorskip("vllm.distributed.aux_output_connector.worker")

SEEDS = st.integers(min_value=0, max_value=2**31 - 1)
SETTINGS = settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)


@SETTINGS
@given(seed=SEEDS, vllm_first=st.booleans())
def test_random_trace_schedulers_agree_and_match_oracle(seed, vllm_first):
    tee = (
        tee_factory(vllm_scheduler, r3capture_scheduler)
        if vllm_first
        else tee_factory(r3capture_scheduler, vllm_scheduler)
    )
    run_trace(random_trace(seed), make_vllm_worker, scheduler_factory=tee)


@SETTINGS
@given(
    seed=SEEDS,
    device_rejections=st.booleans(),
    vector_operations=st.booleans(),
    rollout=st.sampled_from([None, *ROLLOUTS]),
)
def test_random_trace_workers_byte_identical(seed, device_rejections, vector_operations, rollout):
    # These traces' steps are small: the per-request loops (the small-step commit,
    # publication) take most of them unless the vector operations are forced.
    trace = random_trace(seed, rollout=rollout)
    ref = run_trace(trace, make_vllm_worker, catch_errors=True, check=False)
    factory = r3capture_worker_factory(kernel_impl="reference", pass_num_rejected=device_rejections)
    limits = (
        (small_step, "PER_REQUEST_MAX"),
        (publisher, "PER_ROW_MAX"),
    )
    with contextlib.ExitStack() as stack:
        for module, name in limits if vector_operations else ():
            stack.enter_context(mock.patch.object(module, name, 0))
        got = run_trace(trace, factory, catch_errors=True, check=False)
    assert diff_results(ref, got) is None, diff_results(ref, got)
    assert ref.error is None, ref.error
    assert got.check_ground_truth() == ref.check_ground_truth()


@SETTINGS
@given(seed=SEEDS, device_rejections=st.booleans(), budget=st.sampled_from([None, 16]))
def test_random_trace_workers_byte_identical_on_the_narrowest_device_ring(
    seed, device_rejections, budget
):
    """With room for only the 3 draft tokens these traces draw at most (the rows a request
    may reattach below the scheduler's start), the device ring is as narrow as its bound
    allows, and with a 16-token budget most traces have a request that wraps it: still
    byte-identical."""
    trace = random_trace(seed, **({} if budget is None else {"max_num_batched_tokens": budget}))
    ref = run_trace(trace, make_vllm_worker, catch_errors=True, check=False)
    factory = r3capture_worker_factory(kernel_impl="reference", pass_num_rejected=device_rejections)
    with mock.patch.object(sizing, "REATTACH_TOKENS", 3):
        config = trace.config
        width, device_width = sizing.ring_widths(
            config.max_num_batched_tokens, config.hash_block_size, config.max_concurrent_batches
        )
        got = run_trace(trace, factory, catch_errors=True, check=False)
    assert device_width < width
    assert diff_results(ref, got) is None, diff_results(ref, got)
    assert ref.error is None, ref.error


@SETTINGS
@given(
    seed=SEEDS,
    share=st.sampled_from([0.2, 0.5, 0.9]),
    opt_in_default=st.booleans(),
    vector_operations=st.booleans(),
    rollout=st.sampled_from([None, *ROLLOUTS]),
)
def test_random_trace_with_opted_out_requests(
    seed, share, opt_in_default, vector_operations, rollout
):
    """A share of the requests opt out of routed experts (``--aux-output-replay-default off``
    too: then only those that ask get rows), with the random traces' prefix hits across
    requests of both kinds, preemptions, resets, drafts and aborts: through vLLM 0.33.0's
    scheduler connector as r3capture wraps it and r3capture's worker, every request that
    wants rows gets vLLM's bytes (vLLM's connector and worker on the same trace with every
    request opted in) and every other request none."""
    trace = random_trace(seed, rollout=rollout).with_opt_outs(share)
    if opt_in_default:
        trace = trace.with_config(replay_default=False)
    ref = run_vllm_all_opted_in(trace)
    factory = r3capture_worker_factory(kernel_impl="reference")
    limits = ((small_step, "PER_REQUEST_MAX"), (publisher, "PER_ROW_MAX"))
    with contextlib.ExitStack() as stack:
        for module, name in limits if vector_operations else ():
            stack.enter_context(mock.patch.object(module, name, 0))
        got = run_trace(
            trace,
            factory,
            scheduler_factory=replay_scheduler(not opt_in_default),
            catch_errors=True,
            check=False,
        )
    assert ref.error is None, ref.error
    diff = diff_opted_in(ref, got, trace.opted_out())
    assert diff is None, diff
    got.check_ground_truth()


# Engine shapes ``random_trace`` leaves out: hash blocks of 1, 3, 5 and 16 tokens, one
# request per step or up to 128, token budgets of 8 to 2,048, five drafts, CUDA-graph padding,
# a KV connector that must deliver (preempted requests' output in flight dropped).
WIDE_SHAPES = st.fixed_dictionaries(
    {
        "hash_block_size": st.sampled_from([1, 3, 5, 16]),
        "kv_blocks_per_hash_block": st.sampled_from([1, 2]),
        "max_concurrent_batches": st.sampled_from([1, 2]),
        "num_spec_tokens": st.sampled_from([0, 1, 5]),
        "max_num_seqs": st.sampled_from([1, 2, 32, 128]),
        "max_num_batched_tokens": st.sampled_from([8, 16, 512, 2048]),
        "pad_tokens_to": st.sampled_from([0, 8]),
        "kv_delivery": st.booleans(),
    }
)


@settings(SETTINGS, max_examples=10)
@given(
    seed=SEEDS,
    shape=WIDE_SHAPES,
    destination=st.sampled_from(["auto", "staging"]),
    device_rejections=st.booleans(),
)
def test_random_trace_workers_byte_identical_on_wide_shapes(
    seed, shape, destination, device_rejections
):
    """The engine shapes the other random traces never draw (a sweep of 8,736 traces of
    them, at depths 2 and 3, found no difference): every trace runs clean and
    byte-identical in both destinations."""
    shape = dict(shape)
    shape["block_size"] = shape["hash_block_size"] * shape.pop("kv_blocks_per_hash_block")
    trace = random_trace(seed, **shape)
    ref = run_trace(trace, make_vllm_worker, catch_errors=True, check=False)
    factory = r3capture_worker_factory(
        kernel_impl="reference", destination=destination, pass_num_rejected=device_rejections
    )
    got = run_trace(trace, factory, catch_errors=True, check=False)
    assert ref.error is None, ref.error
    assert diff_results(ref, got) is None, diff_results(ref, got)
    assert got.check_ground_truth() == ref.check_ground_truth()


@settings(SETTINGS, max_examples=8)
@given(
    seed=SEEDS,
    extra=st.sampled_from(
        [{}, {"async_kv_load": True}, {"max_concurrent_batches": 2, "num_spec_tokens": 1}]
    ),
)
def test_eviction_without_capping_fails_identically(seed, extra):
    """With hit capping off, an offload-tier hit can reference rows the store already
    evicted (about a third of these traces): both workers must then fail the same way at
    the same step, or both succeed byte for byte. With capping on, every run is clean."""
    trace = make_trace("eviction", seed, cap_hits=False, **extra)
    ref = run_trace(trace, make_vllm_worker, catch_errors=True, check=False)
    got = run_trace(
        trace, r3capture_worker_factory(kernel_impl="reference"), catch_errors=True, check=False
    )
    assert diff_results(ref, got) is None, diff_results(ref, got)
    if ref.error is not None:
        assert ref.error.kind == "BlockObjectStoreError", ref.error
    run_trace(trace.with_config(cap_hits=True), make_vllm_worker)


def test_a_depth_3_trace_once_scheduled_over_rows_in_flight_is_right_in_every_destination():
    """The simulator once moved r0001 back onto rows of a step still in flight in this trace
    (a step at 18 with 5 drafts, then, before its result, a step at 18 again): it resumed
    the request, preempted, before that step's output was delivered, which vLLM 0.33.0's
    scheduler does not do. ``direct`` then returned a row the later launch had overwritten;
    it still refuses such a step by name (``step_commit.check_not_overwritten``, tested in
    ``test_step_commit.py``). Now every destination is vLLM's, byte for byte. With a KV
    connector that must deliver, the scheduler does resume the request at once: vLLM's
    worker then fails its capture, and r3capture, which gives the resumed request a new row
    (``tests/aux_output/test_resumed_requests.py``), runs clean in every destination,
    ``direct`` included, since nothing of the earlier run is written over."""
    shape = dict(
        max_num_seqs=16,
        max_num_batched_tokens=128,
        max_concurrent_batches=3,
        num_spec_tokens=5,
        hash_block_size=3,
        block_size=3,
    )
    destinations = ("staging", "direct", None)  # None: auto, which is staging at depth 3
    trace = random_trace(104821, **shape)
    ref = run_trace(trace, make_vllm_worker, catch_errors=True, check=False)
    assert ref.error is None, ref.error
    for destination in destinations:
        factory = r3capture_worker_factory(kernel_impl="reference", destination=destination)
        got = run_trace(trace, factory, catch_errors=True, check=False)
        assert diff_results(ref, got) is None, diff_results(ref, got)

    trace = random_trace(104821, kv_delivery=True, **shape)
    ref = run_trace(trace, make_vllm_worker, catch_errors=True, check=False)
    assert ref.error is not None and "capture moved backwards" in str(ref.error.exc)
    for destination in destinations:
        factory = r3capture_worker_factory(kernel_impl="reference", destination=destination)
        got = run_trace(trace, factory, catch_errors=True, check=False)
        assert got.error is None, got.error
        got.check_ground_truth()
