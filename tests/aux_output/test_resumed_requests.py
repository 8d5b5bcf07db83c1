"""A request preempted and resumed while a step of its earlier run is still in flight.

vLLM 0.33.0's scheduler reports a preemption to the auxiliary-output connector as a finish
(``request_finished``) and resumes the request only once its output in flight has been
delivered, except with a KV connector whose hand-off must be delivered
(``requires_kv_delivery``, a producer role): then that output is dropped, and the request may
be scheduled again at once; its connector sends the request's block hashes again from block
0. With three steps in flight (pipeline parallelism with async scheduling) the worker can see
the request scheduled again before it processed the earlier run's last step, so the
request's state is still there, marked finished.

vLLM 0.33.0's worker keeps that state: it appends the hashes sent again after the old ones,
so its keys name other blocks and it returns their rows, silently; or its cursors, still the
earlier run's, fail the resumed run's first capture ("capture moved backwards"). vLLM's own
backend never meets this (it refuses pipeline parallelism with routed experts); r3capture's
lifts that refusal. r3capture gives the resumed request a new row and lets the earlier run's
row live until its steps settle (``RequestBook._detach_resumed``): every row matches the
routing oracle, and everything vLLM gets right stays byte-identical. ``python -m sim.sweep``
found this (traces with ``kv_delivery`` at depth 3: 60 of 400 of these random traces).
"""

from __future__ import annotations

import numpy as np
import pytest

from sim import (
    RoutingOracle,
    SimEngine,
    make_vllm_worker,
    r3capture_scheduler,
    r3capture_worker_factory,
    random_trace,
    run_trace,
    worker_sizes,
)

pytest.importorskip("vllm.distributed.aux_output_connector.worker")

# (random_trace seed, the resumed request, the positions vLLM's worker gets wrong, where its
# rows there come from), for traces with kv_delivery at depth 3.
WRONG_ROWS = [
    (322, "r0001", range(32, 38), range(0, 6)),
]


# Traces (random_trace seed, engine shape) in which the simulator resumed a preempted
# request with its earlier run in flight before it followed vLLM's scheduler there.
EARLY_RESUMES = {
    1307: dict(hash_block_size=16, block_size=32, num_spec_tokens=0, max_num_seqs=8,
               max_num_batched_tokens=2048, pad_tokens_to=8),
    3609: dict(hash_block_size=2, block_size=2, num_spec_tokens=3, max_num_seqs=2,
               max_num_batched_tokens=16, pad_tokens_to=0),
    6539: dict(hash_block_size=8, block_size=16, num_spec_tokens=5, max_num_seqs=32,
               max_num_batched_tokens=16, pad_tokens_to=0),
}  # fmt: skip


def _trace(seed):
    return random_trace(seed, max_concurrent_batches=3, kv_delivery=True)


def _run(trace, factory):
    """Run ``trace``; returns the result and the worker's store references at the end
    (key -> count, read before the worker closes)."""
    handle = factory(worker_sizes(trace))
    try:
        engine = SimEngine(trace, handle, scheduler_factory=r3capture_scheduler, record_metas=True)
        result = engine.run(catch_errors=True)
        store = getattr(handle.worker, "store", None)
        if store is None:  # vLLM's worker: its writer thread's store, once it is idle
            handle.worker._store._queue.join()
            references = dict(handle.worker._store._store._references)
        else:
            references = {}
            for key in {k for s in result.metas if s for k in _keys_named(s)}:
                if store.ref_count(key):
                    references[key] = store.ref_count(key)
        return result, references
    finally:
        handle.close()


def _keys_named(metadata) -> list[str]:
    """vLLM's key strings of every block hash ``metadata`` names."""
    from vllm.distributed.aux_output_connector.routed_experts import routed_experts_keys

    packed = [*metadata.block_hashes.values()]
    packed += [p for p in (metadata.retained_block_hashes, metadata.released_block_hashes) if p]
    hashes = [
        p.data[i : i + p.item_size] for p in packed for i in range(0, len(p.data), p.item_size)
    ]
    return routed_experts_keys(hashes, str(metadata.generation))


def _oracle_rows(result, request_id):
    model = result.trace.model
    oracle = RoutingOracle(model.num_layers, model.top_k, model.num_experts, model.num_dense_layers)
    tokens = np.asarray(result.final_tokens[request_id])
    return oracle.expected(tokens, 0, len(tokens))


def _assert_vllm_outputs_kept(got, ref, request_id=None):
    """Every output of ``ref``'s processed steps is ``got``'s, byte for byte, but the rows
    of ``request_id`` (same start, dtype and shape)."""
    assert [s.req_ids for s in got.steps[: len(ref.steps)]] == [s.req_ids for s in ref.steps]
    for mine, theirs in zip(got.steps, ref.steps):
        assert mine.outputs.keys() == theirs.outputs.keys()
        for name, output in mine.outputs.items():
            if name != request_id:
                assert output == theirs.outputs[name], (mine.index, name)
            else:
                assert output[:3] == theirs.outputs[name][:3], (mine.index, name)


@pytest.mark.parametrize("seed, request_id, wrong, source", WRONG_ROWS)
def test_a_resumed_request_gets_its_own_rows_where_vllm_returns_other_blocks(
    seed, request_id, wrong, source
):
    trace = _trace(seed)
    ref, ref_references = _run(trace, make_vllm_worker)
    assert ref.error is None, ref.error
    assert ref.stats.preemptions > 0

    # vLLM 0.33.0: the resumed request's rows at `wrong` are those of positions `source`.
    oracle = _oracle_rows(ref, request_id)
    start = ref.emit_start[request_id]
    rows = ref.rows(request_id)
    differs = (rows != oracle[start : start + len(rows)]).reshape(len(rows), -1).any(axis=1)
    assert np.flatnonzero(differs).tolist() == [p - start for p in wrong]
    np.testing.assert_array_equal(rows[wrong.start - start : wrong.stop - start], oracle[source])

    for destination in ("auto", "staging"):
        factory = r3capture_worker_factory(kernel_impl="reference", destination=destination)
        got, references = _run(trace, factory)
        assert got.error is None, got.error
        got.check_ground_truth()
        assert len(got.steps) == len(ref.steps)
        _assert_vllm_outputs_kept(got, ref, request_id)
        assert got.rows(request_id).tobytes() == oracle[start : start + len(rows)].tobytes()
        # Each run's keys were released at its own teardown: the store ends with the
        # references vLLM's does (the scheduler's pins), none left over.
        assert references == ref_references


@pytest.mark.parametrize("seed", [6, 7, 9, 10])
def test_a_resumed_request_runs_on_where_vllm_fails_its_capture(seed):
    trace = _trace(seed)
    ref, _ = _run(trace, make_vllm_worker)
    assert ref.error is not None and ref.error.phase == "process_output"
    assert "capture moved backwards" in str(ref.error.exc)
    got, _ = _run(trace, r3capture_worker_factory(kernel_impl="reference"))
    assert got.error is None, got.error
    got.check_ground_truth()
    _assert_vllm_outputs_kept(got, ref)


def test_without_kv_delivery_a_preempted_request_waits_for_its_output_in_flight():
    """The simulator resumes a preempted request only once its output in flight is
    delivered, as vLLM 0.33.0's scheduler does; before it did, these traces resumed one at
    once and vLLM's worker returned other blocks' rows for it."""
    for seed, shape in EARLY_RESUMES.items():
        ref = run_trace(
            random_trace(seed, max_concurrent_batches=3, **shape),
            make_vllm_worker,
            catch_errors=True,
            check=False,
        )
        assert ref.error is None, ref.error
        assert ref.stats.preemptions > 0
        ref.check_ground_truth()
