"""Differential tests: r3capture's worker connector vs vLLM 0.33.0's on the same traces.

Each trace runs once through vLLM's AuxOutputWorkerConnector (built without a model, on a
CPU capture buffer) and once through r3capture's TritonAuxOutputWorker; every step's
outputs must be byte-identical (same requests, token_start, dtype, shape, bytes), errors
must be of the same kind at the same step and phase, and r3capture's rows must match the
routing oracle. Scripted protocol violations must raise the same kind of error.
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from r3capture.aux_output import publisher, small_step
from r3capture.aux_output.types import AuxOutputConnectorMetadata, PackedBlockHashes
from sim import (
    SCENARIOS,
    WorkerSizing,
    make_r3capture_worker,
    make_trace,
    make_vllm_worker,
    r3capture_worker_factory,
    replay_scheduler,
    run_trace,
)
from sim.compare import diff_opted_in, diff_results, run_vllm_all_opted_in, same_error
from sim.request_indices import RequestIndices

pytest.importorskip("vllm.distributed.aux_output_connector.worker")

REFERENCE = r3capture_worker_factory(kernel_impl="reference")


def _differential(trace, factory=REFERENCE, expect_error=None):
    ref = run_trace(trace, make_vllm_worker, catch_errors=True, check=False)
    got = run_trace(trace, factory, catch_errors=True, check=False)
    diff = diff_results(ref, got)
    assert diff is None, f"{trace.name}: {diff}"
    if expect_error is None:
        assert ref.error is None, ref.error
        assert got.check_ground_truth() == ref.check_ground_truth()
    else:
        assert ref.error is not None and ref.error.kind == expect_error
    return ref, got


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_scenario_byte_identical(scenario):
    _differential(make_trace(scenario, seed=0))


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_scenario_byte_identical_with_vector_operations(scenario, monkeypatch):
    # The scenarios' steps are small enough for the per-request loops (the small-step commit,
    # publication); this runs them through the vector operations instead.
    monkeypatch.setattr(small_step, "PER_REQUEST_MAX", 0)
    monkeypatch.setattr(publisher, "PER_ROW_MAX", 0)
    _differential(make_trace(scenario, seed=0))


@pytest.mark.parametrize("scenario", ["spec_decode", "async_spec", "finish_in_flight"])
def test_rejections_dropped_on_the_host(scenario):
    """Without the device num_rejected handoff the worker must drop rejected rows from
    the numpy counts that enqueue_cpu_copy delivers (valid only at process_output)."""
    factory = r3capture_worker_factory(kernel_impl="reference", pass_num_rejected=False)
    _differential(make_trace(scenario, seed=1), factory)


@pytest.mark.parametrize("scenario", ["async_spec", "reset", "multi_turn", "preemption"])
def test_device_staging_destination_byte_identical(scenario):
    """Staging (GPUs that cannot write host memory): the kernel writes device staging in
    step-row order and the host places the copy into the ring's slots; uint16 in reset."""
    factory = r3capture_worker_factory(kernel_impl="reference", destination="staging")
    _differential(make_trace(scenario, seed=4), factory)


def test_padded_steps_byte_identical():
    _differential(make_trace("async_spec", seed=2, pad_tokens_to=8))


def test_preemption_with_async_drafts_byte_identical():
    _differential(make_trace("preemption", seed=1, max_concurrent_batches=2, num_spec_tokens=2))


def test_eviction_without_capping_fails_the_same_way():
    ref, got = _differential(
        make_trace("eviction", seed=0, cap_hits=False), expect_error="BlockObjectStoreError"
    )
    assert "max_bytes" in str(got.error.exc)


@pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs CUDA or the Triton interpreter (TRITON_INTERPRET=1 at import)",
)
@pytest.mark.parametrize("scenario", ["async_spec", "multi_turn"])
def test_triton_kernel_byte_identical(scenario):
    trace = make_trace(scenario, seed=3, size="tiny")
    _differential(trace, r3capture_worker_factory(kernel_impl="auto"))


# ---------------------------------------------------------------- per-request routed experts


def _opted_out_differential(trace, factory=REFERENCE):
    """``trace`` (some requests opted out of routed experts) through vLLM 0.33.0's scheduler
    connector wrapped as under ``triton`` and r3capture's worker, against vLLM's connector and
    worker on the same trace with every request opted in (vLLM has no switch)."""
    ref = run_vllm_all_opted_in(trace)
    got = run_trace(
        trace,
        factory,
        scheduler_factory=replay_scheduler(trace.config.replay_default),
        catch_errors=True,
        check=False,
    )
    assert ref.error is None, ref.error
    assert trace.opted_out(), "the trace opts no request out"
    assert diff_opted_in(ref, got, trace.opted_out()) is None, diff_opted_in(
        ref, got, trace.opted_out()
    )
    got.check_ground_truth()
    return ref, got


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_opted_out_requests_emit_nothing_and_the_others_are_byte_identical(scenario):
    _opted_out_differential(make_trace(scenario, seed=0).with_opt_outs(0.5))


@pytest.mark.parametrize("scenario", ["multi_turn", "shared_prefix", "preemption", "reset"])
@pytest.mark.parametrize("vector_operations", [False, True])
def test_under_an_opt_in_default_with_either_commit(scenario, vector_operations, monkeypatch):
    """``--aux-output-replay-default off``: only requests that ask get rows; the small-step
    commit and the vector one (forced) both keep the emit start no request reaches."""
    if vector_operations:
        monkeypatch.setattr(small_step, "PER_REQUEST_MAX", 0)
        monkeypatch.setattr(publisher, "PER_ROW_MAX", 0)
    trace = make_trace(scenario, seed=1).with_opt_outs(0.3).with_config(replay_default=False)
    _opted_out_differential(trace)


@pytest.mark.parametrize("first_opted_out", [True, False])
def test_prefix_hits_across_opted_in_and_opted_out_turns(first_opted_out):
    """Conversations whose turns alternate between the two kinds: a turn that wants rows hits
    the blocks an opted-out turn computed, and gets every row of its prompt from them (the
    opted-out turn's rows were captured and published), byte for byte vLLM's."""
    base = make_trace("multi_turn", seed=2, max_concurrent_batches=2)
    turns: dict[str, int] = {}
    requests = []
    for q in base.requests:
        turns[q.req_id] = 0 if q.after is None else turns[q.after] + 1
        opted_out = (turns[q.req_id] % 2 == 0) == first_opted_out
        requests.append(dataclasses.replace(q, replay=False if opted_out else None))
    trace = base.replace(requests=tuple(requests))
    _, got = _opted_out_differential(trace)
    opted_out = trace.opted_out()
    crossing = [
        q.req_id
        for q in trace.requests
        if q.after in opted_out
        and q.req_id not in opted_out
        and got.emit_start[q.req_id] == 0
        and got.first_computed[q.req_id] > 0
    ]
    assert len(crossing) >= 3, crossing


# ---------------------------------------------------------------- scripted protocol errors

SIZES = WorkerSizing.for_model(
    num_layers=2,
    top_k=2,
    num_experts=16,
    hash_block_size=4,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    max_concurrent_batches=2,
    max_bytes=64 * 16,
)


def _meta(requests=None, hashes=None, finished=(), generation=0):
    packed = {
        req_id: PackedBlockHashes(b"".join(bytes([i]) * 32 for i in ids), 32)
        for req_id, ids in (hashes or {}).items()
    }
    return AuxOutputConnectorMetadata(generation, dict(requests or {}), packed, tuple(finished))


def _batch(steps, indices=None):
    """steps: [(req_id, sched_start, num_rows, true_start)] -> an input batch (request
    indices from ``indices``, given to ids it has none for)."""
    indices = indices or RequestIndices(SIZES.max_num_seqs)
    for req_id, *_ in steps:
        if req_id not in indices.of:
            indices.add(req_id)
    idx_mapping_np, idx_mapping = indices.mapping([s[0] for s in steps])
    qsl = np.zeros(len(steps) + 1, np.int32)
    positions = []
    for i, (_, _, n, true_start) in enumerate(steps):
        qsl[i + 1] = qsl[i] + n
        positions.append(np.arange(true_start, true_start + n))
    return SimpleNamespace(
        req_ids=[s[0] for s in steps],
        num_reqs=len(steps),
        query_start_loc_np=qsl,
        num_computed_tokens_np=np.array([s[1] for s in steps], np.int32),
        query_start_loc=torch.from_numpy(qsl.copy()),
        positions=torch.from_numpy(np.concatenate(positions).astype(np.int64)),
        idx_mapping_np=idx_mapping_np,
        idx_mapping=idx_mapping,
    )


def _play(handle, script):
    """Run a script of ("begin", meta) / ("prepare", steps, rejected) / ("process", k)
    actions; returns (outputs, (index, phase, exception) of the first error or None)."""
    pendings = []
    outputs = []
    rng = np.random.default_rng(0)
    indices = RequestIndices(SIZES.max_num_seqs)
    for index, action in enumerate(script):
        phase = action[0]
        try:
            if phase == "begin":
                indices.free(action[1].finished_requests)
                handle.begin_step(action[1])
            elif phase == "prepare":
                steps, rejected = action[1], np.asarray(action[2], np.int32)
                rows = int(sum(s[2] for s in steps))
                handle.capture_buffer[:rows] = torch.from_numpy(
                    rng.integers(0, 16, (rows, 2, 2), dtype=np.int32)
                )
                pending = handle.prepare_output(_batch(steps, indices), rejected)
                sampled = np.array([s[2] - r for s, r in zip(steps, rejected)], np.int32)
                pending.enqueue_cpu_copy(num_sampled=sampled, num_rejected=rejected)
                pendings.append(pending)
            else:
                out = pendings.pop(0).process_output()
                outputs.append(
                    {k: (v.token_start, v.rows.dtype.str, v.rows.tobytes()) for k, v in out.items()}
                )
        except Exception as exc:  # noqa: BLE001 - the error is what is compared
            return outputs, (index, phase, exc)
    return outputs, None


def _play_on_both(script):
    """``_play`` on vLLM 0.33.0's worker, then on r3capture's: ``[vLLM's, r3capture's]``."""
    results = []
    for make in (make_vllm_worker, lambda s: make_r3capture_worker(s, kernel_impl="reference")):
        handle = make(SIZES)
        try:
            results.append(_play(handle, script))
        finally:
            handle.close()
    return results


_A_RUNS_THEN_FINISHES = [
    ("begin", _meta({"a": 0}, {"a": [1]})),
    ("prepare", [("a", 0, 3, 0)], [0]),
    ("process",),
    ("begin", _meta({}, finished=("a",))),
]

SCRIPTS = {
    "run_and_finish_in_one_step": [("begin", _meta({"a": 0}, finished=("a",)))],
    "generation_moves_backwards": [
        ("begin", _meta({"a": 0}, generation=1)),
        ("begin", _meta({"a": 0}, generation=0)),
    ],
    # vLLM's generation assertion comes before any lookup of the requests the step names.
    "generation_moves_backwards_with_hashes_of_unknown_requests": [
        ("begin", _meta({"a": 0}, generation=1)),
        ("begin", _meta({}, {"zz": [1]}, generation=0)),
    ],
    "generation_moves_backwards_finishing_unknown_requests": [
        ("begin", _meta({"a": 0}, generation=1)),
        ("begin", _meta({}, finished=("zz",), generation=0)),
    ],
    "rejected_count_invalid": [
        ("begin", _meta({"a": 0}, {"a": [1]})),
        ("prepare", [("a", 0, 4, 0)], [5]),
        ("process",),
    ],
    "capture_moves_backwards": [
        ("begin", _meta({"a": 0}, {"a": [1, 2]})),
        ("prepare", [("a", 0, 8, 0)], [0]),
        ("process",),
        ("begin", _meta({"a": 8})),
        ("prepare", [("a", 4, 1, 4)], [0]),
        ("process",),
    ],
    "unbacked_gap": [
        ("begin", _meta({"a": 0}, {"a": [1]})),
        ("prepare", [("a", 0, 4, 0)], [0]),
        ("process",),
        ("begin", _meta({"a": 4})),
        ("prepare", [("a", 6, 1, 6)], [0]),
        ("process",),
    ],
    "emit_cursor_ahead": [
        ("begin", _meta({"a": 0}, {"a": [1]})),
        ("prepare", [("a", 0, 4, 0)], [0]),
        ("process",),
        ("begin", _meta({"a": 7})),
    ],
    "too_many_steps_in_flight": [
        ("begin", _meta({"a": 0})),
        ("prepare", [("a", 0, 1, 0)], [0]),
        ("begin", _meta({"a": 0})),
        ("prepare", [("a", 1, 1, 1)], [0]),
        ("begin", _meta({"a": 0})),
        ("prepare", [("a", 2, 1, 2)], [0]),
    ],
    "generation_change_with_output_in_flight": [
        ("begin", _meta({"a": 0})),
        ("prepare", [("a", 0, 3, 0)], [0]),
        ("begin", _meta({}, generation=1)),
    ],
    "unknown_request_in_batch": [
        ("begin", _meta({"a": 0})),
        ("prepare", [("a", 0, 2, 0), ("b", 0, 2, 0)], [0, 0]),
    ],
    "finish_unknown_request": [("begin", _meta({}, finished=("zz",)))],
    # A request that finishes with no step in flight is gone at once for the scheduler,
    # however late its teardown runs.
    "hashes_for_a_finished_request": [
        *_A_RUNS_THEN_FINISHES,
        ("begin", _meta({}, {"a": [9]})),
    ],
    "finish_a_finished_request_again": [
        *_A_RUNS_THEN_FINISHES,
        ("begin", _meta({}, finished=("a",))),
    ],
    "finished_request_in_batch": [
        *_A_RUNS_THEN_FINISHES,
        ("begin", _meta({"b": 0})),
        ("prepare", [("b", 0, 2, 0), ("a", 3, 1, 3)], [0, 0]),
    ],
    # A prefix hit (capture from 4, emit from 0) whose hit block has no hash: none of its
    # rows are stored, and only the open block's are readable.
    "prefix_hit_without_its_hashes": [
        ("begin", _meta({"a": 0})),
        ("prepare", [("a", 4, 2, 4)], [0]),
        ("process",),
    ],
    # The same, with the step's rows ending on a block boundary: the open block is empty.
    "prefix_hit_without_its_hashes_ending_a_block": [
        ("begin", _meta({"a": 0})),
        ("prepare", [("a", 4, 4, 4)], [0]),
        ("process",),
    ],
    # "p" stores blocks 0 and 1; "a" hits both but names only block 0's hash: block 0 comes
    # from the store, block 1 is neither stored for "a" nor its open block.
    "prefix_hit_past_its_hashed_blocks": [
        ("begin", _meta({"p": 0}, {"p": [1, 2]})),
        ("prepare", [("p", 0, 8, 0)], [0]),
        ("process",),
        ("begin", _meta({"a": 0}, {"a": [1]})),
        ("prepare", [("a", 8, 2, 8)], [0]),
        ("process",),
    ],
}


@pytest.mark.parametrize("case", sorted(SCRIPTS))
def test_protocol_violation_same_error(case):
    script = SCRIPTS[case]
    results = _play_on_both(script)
    (ref_out, ref_err), (got_out, got_err) = results
    assert ref_err is not None, f"{case}: vLLM accepted the script"
    assert got_err is not None, f"{case}: r3capture accepted what vLLM rejects: {ref_err}"
    assert same_error(ref_err[2], got_err[2]), f"{case}: {ref_err!r} vs {got_err!r}"
    # Raised no later than vLLM raises it (r3capture may validate in prepare_output).
    assert got_err[0] <= ref_err[0], f"{case}: {ref_err[:2]} vs {got_err[:2]}"
    assert got_out == ref_out[: len(got_out)]


@pytest.mark.parametrize(
    "case",
    [
        "prefix_hit_without_its_hashes",
        "prefix_hit_without_its_hashes_ending_a_block",
        "prefix_hit_past_its_hashed_blocks",
    ],
)
def test_unreadable_prefix_rows_fail_with_vllms_message(case):
    """Rows a prefix hit needs that are neither behind its keys nor in its open block:
    vLLM's assertion, word for word ("range is unavailable" with the same ranges, or "buffer
    is missing request" when the step's rows end on a block boundary), at the same call."""
    (_, ref_err), (_, got_err) = _play_on_both(SCRIPTS[case])
    assert isinstance(ref_err[2], AssertionError), ref_err
    assert (got_err[:2], str(got_err[2])) == (ref_err[:2], str(ref_err[2]))


def test_scripted_finish_with_two_steps_in_flight_waits_for_both():
    """A request finished (an abort) while two of its steps are in flight is torn down by
    the second one's process_output, not the first: both steps return its rows, as in vLLM."""
    script = [
        ("begin", _meta({"a": 0}, {"a": [1]})),
        ("prepare", [("a", 0, 3, 0)], [0]),
        ("begin", _meta({"a": 0})),
        ("prepare", [("a", 3, 2, 3)], [0]),
        ("begin", _meta({}, finished=("a",))),
        ("process",),
        ("process",),
        # The id is free again only after both: it comes back as a new request.
        ("begin", _meta({"a": 0}, {"a": [7]})),
        ("prepare", [("a", 0, 2, 0)], [0]),
        ("process",),
    ]
    results = _play_on_both(script)
    assert results[0][1] is None, results[0][1]
    assert results[1] == results[0]
    assert [list(o) for o in results[0][0]] == [["a"], ["a"], ["a"]]


def test_scripted_reattach_after_rejection_matches():
    """Async + drafts by hand: the next step is scheduled from the optimistic count (7)
    while the true position after two rejections is 5."""
    script = [
        ("begin", _meta({"a": 0}, {"a": [1]})),
        ("prepare", [("a", 0, 4, 0)], [0]),
        ("begin", _meta({"a": 0})),
        ("prepare", [("a", 4, 3, 4)], [2]),
        ("process",),
        ("begin", _meta({"a": 4}, {"a": [2]})),
        ("prepare", [("a", 7, 3, 5)], [0]),
        ("process",),
        ("process",),
    ]
    results = _play_on_both(script)
    assert results[0][1] is None, results[0][1]
    assert results[1] == results[0]
    assert [list(o) for o in results[0][0]] == [["a"], ["a"], ["a"]]


def test_finished_request_id_scheduled_again_starts_afresh():
    """A request finishes with no step in flight; its id returns as a new request (its
    teardown may not have run yet): fresh state and outputs as vLLM's."""
    script = [
        ("begin", _meta({"a": 0, "b": 0}, {"a": [1], "b": [2]})),
        ("prepare", [("a", 0, 5, 0), ("b", 0, 4, 0)], [0, 0]),
        ("process",),
        ("begin", _meta({"b": 4}, finished=("a",))),
        ("prepare", [("b", 4, 1, 4)], [0]),
        ("begin", _meta({"a": 0, "b": 4}, {"a": [3]})),
        ("prepare", [("a", 0, 6, 0), ("b", 5, 1, 5)], [0, 0]),
        ("process",),
        ("process",),
    ]
    results = _play_on_both(script)
    assert results[0][1] is None, results[0][1]
    assert results[1] == results[0]
    assert [sorted(o) for o in results[0][0]] == [["a", "b"], ["b"], ["a", "b"]]


def test_non_output_rank_and_missing_metadata_skip_the_data_plane():
    """Non-first TP ranks capture but own no data plane; a step without metadata (warmup,
    dummy run) takes no snapshot. Both workers return None from prepare_output and accept
    any metadata without looking at it."""
    batch = _batch([("a", 0, 2, 0)])
    for make in (make_vllm_worker, make_r3capture_worker):
        off_rank = make(SIZES, is_output_rank=False)
        off_rank.begin_step(_meta({"a": 0}, finished=("a",)))  # would be a violation
        assert off_rank.prepare_output(batch, np.zeros(1, np.int32)) is None
        off_rank.close()
        handle = make(SIZES)
        handle.begin_step(None)
        assert handle.prepare_output(batch, np.zeros(1, np.int32)) is None
        handle.close()
