"""A request preempted and resumed while a step of its earlier run is still in flight.

vLLM 0.33.0's scheduler reports a preemption to the auxiliary-output connector as a finish
(``request_finished``) and may schedule the request again at the next step; its connector
then sends the request's block hashes again from block 0. With three steps in flight
(pipeline parallelism with async scheduling) the worker can see the request scheduled again
before it processed the earlier run's last step, so the request's state is still there,
marked finished.

vLLM 0.33.0's worker keeps that state: it appends the hashes sent again after the old ones
and leaves the request finished. Its keys then name the wrong blocks, and the rows it
returns for those blocks are other blocks' rows, silently. vLLM's own backend never meets
this (it refuses pipeline parallelism with routed experts); r3capture's lifts that refusal.
r3capture releases the old keys and starts the list again (``RequestBook._resumed``): every
row matches the routing oracle, and everything else stays byte-identical to vLLM's outputs.
``python -m sim.sweep`` found both traces below (seeds 1307 and 3609 of its draws).
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
    worker_sizes,
)
from sim.sweep import draw_case

pytest.importorskip("vllm.distributed.aux_output_connector.worker")

# (sweep seed, the resumed request, the positions vLLM's worker gets wrong, where its
# rows there come from).
CASES = [
    (1307, "r0009", range(32, 48), range(0, 16)),
    (3609, "r0006", range(36, 48), range(0, 12)),
]


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


@pytest.mark.parametrize("seed, request_id, wrong, source", CASES)
def test_a_request_resumed_with_a_step_in_flight_gets_its_own_rows(seed, request_id, wrong, source):
    case = draw_case(seed)
    trace = random_trace(seed, **case.shape)
    assert trace.config.max_concurrent_batches == 3
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

    for destination in ("auto", "staging", "direct"):
        factory = r3capture_worker_factory(kernel_impl="reference", destination=destination)
        got, references = _run(trace, factory)
        assert got.error is None, got.error
        got.check_ground_truth()
        # Everything else is vLLM's, byte for byte: the same steps, outputs and rows.
        assert [s.req_ids for s in got.steps] == [s.req_ids for s in ref.steps]
        for mine, theirs in zip(got.steps, ref.steps):
            assert mine.outputs.keys() == theirs.outputs.keys()
            for name, output in mine.outputs.items():
                if name != request_id:
                    assert output == theirs.outputs[name], (mine.index, name)
                else:
                    assert output[:3] == theirs.outputs[name][:3], (mine.index, name)
        assert got.rows(request_id).tobytes() == oracle[start : start + len(rows)].tobytes()
        # The old keys were released as the new ones were retained: the store ends with
        # the references vLLM's does (the scheduler's pins), none left over.
        assert references == ref_references
