"""The simulator itself: oracle, KV double, scenarios, and the ground-truth check.

Every scenario runs through vLLM 0.33.0's own worker connector and must reproduce the
routing oracle's rows for every request; each scenario must also exercise what it is named
for. Broken workers (kept rejected rows, a flipped byte, reused output buffers) must fail.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sim import (
    SCENARIOS,
    RoutingOracle,
    make_trace,
    make_vllm_worker,
    random_trace,
    run_trace,
)
from sim.compare import normalize_meta
from sim.kv import KVCacheDouble, block_hashes_for
from sim.oracle import SEED, prefix_hashes
from sim.workers import WorkerHandle

pytest.importorskip("vllm.distributed.aux_output_connector.worker")

# ---------------------------------------------------------------- oracle


def test_oracle_rows_depend_only_on_prefix_position_layer():
    oracle = RoutingOracle(num_layers=3, top_k=4, num_experts=64)
    rng = np.random.default_rng(0)
    a = rng.integers(0, 1000, 50)
    b = a.copy()
    b[30] = (b[30] + 1) % 1000
    ra, rb = oracle.rows(a, 0, 50), oracle.rows(b, 0, 50)
    assert ra.dtype == np.int32 and ra.shape == (50, 3, 4)
    assert np.array_equal(ra[:30], rb[:30])
    assert (ra[30:] != rb[30:]).reshape(20, -1).any(axis=1).all()
    assert np.array_equal(oracle.rows(a, 10, 20), ra[10:20])
    assert (ra[:, 0] != ra[:, 1]).any()  # layers differ
    assert ra.min() >= 0 and ra.max() < 64
    # K ids of one (token, layer) are distinct for a power-of-two expert count.
    assert all(len(set(row)) == 4 for row in ra.reshape(-1, 4).tolist())


def test_oracle_dtypes_and_dense_layers():
    small = RoutingOracle(2, 2, 256)
    big = RoutingOracle(2, 2, 257, num_dense_layers=1)
    toks = np.arange(9)
    assert small.expected(toks, 0, 9).dtype == np.uint8
    rows = big.expected(toks, 2, 9)
    assert rows.dtype == np.uint16 and rows.shape == (7, 2, 2)
    assert not rows[:, 0].any() and rows[:, 1].max() < 257


def test_prefix_hashes_continue_across_chunks():
    toks = np.random.default_rng(1).integers(0, 1000, 3000)
    full = prefix_hashes(toks)
    assert np.array_equal(prefix_hashes(toks[1000:], int(full[999])), full[1000:])
    seq = SEED
    for t in toks[:20].tolist():
        seq = (seq * 0x100000001B3 + t + 1) % 2**64
    assert int(full[19]) == seq


# ---------------------------------------------------------------- KV double


class _R:
    def __init__(self, req_id, tokens, hbs):
        self.request_id = req_id
        self.block_hashes = block_hashes_for(tokens, hbs)
        self.num_tokens = len(tokens)
        self.num_computed_tokens = 0


def test_block_hashes_chain_and_extend():
    tokens = list(range(20))
    full = block_hashes_for(tokens, 4)
    assert len(full) == 5 and len(set(full)) == 5
    assert block_hashes_for(tokens, 4, full[:2]) == full[2:]
    other = block_hashes_for([99] + tokens[1:], 4)
    assert all(x != y for x, y in zip(full, other))  # chained: one token changes all


def test_kv_double_hits_eviction_order_and_reset():
    kv = KVCacheDouble(num_blocks=4, block_size=4, hash_block_size=2)
    a = _R("a", list(range(12)), 2)
    assert kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    assert kv.block_pool.get_cached_block(a.block_hashes[5], [0]) is not None
    assert kv.block_pool.get_cached_block(a.block_hashes[4], [0]) is None  # not a KV key
    b = _R("b", list(range(12)) + [5], 2)
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 12 and len(blocks) == 3
    assert kv.get_computed_blocks(b, 8)[1] == 8
    assert not kv.reset_prefix_cache()  # a holds blocks
    kv.free(a)
    c = _R("c", list(range(100, 104)), 2)
    assert kv.allocate_slots(c, 4)  # the free block 3, then a's tail block goes first
    assert kv.allocate_slots(_R("d", list(range(200, 204)), 2), 4)
    assert kv.get_computed_blocks(b)[1] == 8  # a's last block was evicted first
    assert not kv.allocate_slots(_R("e", list(range(300, 312)), 2), 12)
    kv.free(c)
    kv.free(_R("d", [], 2))
    assert kv.reset_prefix_cache() and kv.get_computed_blocks(b)[1] == 0


# ---------------------------------------------------------------- scenarios


EXPECT = {
    "decode": lambda s: s.forward_steps > 10 and s.rows_scheduled == s.rows_accepted,
    "chunked_prefill": lambda s: s.partial_prefills > 5,
    "multi_turn": lambda s: s.prefix_hit_tokens > 100,
    "spec_decode": lambda s: 0 < s.rejected_drafts < s.drafts,
    "async": lambda s: s.max_in_flight == 2,
    "async_spec": lambda s: s.reattach_rows > 0 and s.hash_only_updates > 0,
    "preemption": lambda s: s.preemptions > 0 and s.prefix_hit_tokens > 0,
    "reset": lambda s: s.resets == 3 and s.prefix_hit_tokens > 0,
    "eviction": lambda s: s.external_hits_capped > 0 and s.external_hit_tokens > 0,
    "finish_in_flight": lambda s: s.finished_in_flight > 0 and s.aborts > 0,
    "shared_prefix": lambda s: s.same_step_hit_blocks > 0 and s.in_flight_hit_blocks > 0,
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_scenario_matches_oracle_with_vllm_worker(scenario):
    trace = make_trace(scenario, seed=0)
    result = run_trace(trace, make_vllm_worker)
    assert result.check_ground_truth() > 100
    assert set(result.final_tokens) == {r.req_id for r in trace.requests}
    assert EXPECT[scenario](result.stats), result.stats
    stopped = [r for r, s in result.finish_status.items() if s == "finished_stopped"]
    assert stopped and all(result.emit_start[r] is not None for r in stopped)


def test_async_preemption_delivers_stale_output():
    for spec in (0, 2):
        trace = make_trace("preemption", seed=0, max_concurrent_batches=2, num_spec_tokens=spec)
        result = run_trace(trace, make_vllm_worker)
        assert result.stats.stale_outputs > 0 and result.stats.preemptions > 0


def test_eviction_without_capping_fails_closed():
    result = run_trace(
        make_trace("eviction", seed=0, cap_hits=False), make_vllm_worker, catch_errors=True
    )
    assert result.error is not None
    assert (result.error.phase, result.error.kind) == ("process_output", "BlockObjectStoreError")
    assert "evicted" in str(result.error.exc)


def test_padded_steps_and_uint16():
    trace = make_trace("async_spec", seed=4, pad_tokens_to=8).replace(
        model=make_trace("multi_turn").model
    )
    run_trace(trace, make_vllm_worker)


@pytest.mark.parametrize("seed", range(8))
def test_random_traces_match_oracle(seed):
    run_trace(random_trace(seed), make_vllm_worker)


def test_runs_are_deterministic():
    trace = make_trace("finish_in_flight", seed=7)
    a = run_trace(trace, make_vllm_worker, record_metas=True)
    b = run_trace(trace, make_vllm_worker, record_metas=True)
    assert a.steps == b.steps and a.final_tokens == b.final_tokens
    assert [normalize_meta(m) for m in a.metas] == [normalize_meta(m) for m in b.metas]
    a.stats.worker_seconds = b.stats.worker_seconds = 0.0
    assert a.stats == b.stats
    c = run_trace(make_trace("finish_in_flight", seed=8), make_vllm_worker)
    assert c.final_tokens != a.final_tokens
    assert make_trace("reset", 3) == make_trace("reset", 3)


# ---------------------------------------------------------------- the check can fail


def _wrapped(transform):
    """A vLLM worker whose pending outputs pass through ``transform(pending, outputs)``."""

    def factory(sizes):
        inner = make_vllm_worker(sizes)

        class Pending:
            def __init__(self, pending):
                self.pending = pending

            def enqueue_cpu_copy(self, num_sampled, num_rejected):
                self.num_rejected = num_rejected
                self.pending.enqueue_cpu_copy(num_sampled=num_sampled, num_rejected=num_rejected)

            def process_output(self):
                return transform(self, self.pending.process_output)

        def prepare(batch, num_rejected):
            pending = inner.prepare_output(batch, num_rejected)
            return None if pending is None else Pending(pending)

        return WorkerHandle("broken", inner.worker, inner.capture_buffer, prepare, lambda: 0)

    return factory


def test_check_catches_kept_rejected_rows():
    def keep_rejected(p, process):
        p.num_rejected[:] = 0
        return process()

    result = run_trace(
        make_trace("spec_decode", seed=0), _wrapped(keep_rejected), catch_errors=True, check=False
    )
    with pytest.raises(AssertionError):
        result.check_ground_truth()


def test_check_catches_one_flipped_byte():
    count = [0]

    def flip(p, process):
        out = process()
        count[0] += 1
        if count[0] == 7 and out:
            req_id = sorted(out)[0]
            rows = out[req_id].rows.copy()
            rows.reshape(-1)[-1] ^= 1
            out[req_id].rows = rows
        return out

    with pytest.raises(AssertionError, match="wrong rows"):
        run_trace(make_trace("decode", seed=0), _wrapped(flip))


def test_check_catches_outputs_that_alias_a_reused_buffer():
    scratch = {}

    def alias(p, process):
        out = process()
        for item in out.values():
            n = len(item.rows)
            buf = scratch.setdefault(
                item.rows.shape[1:], np.zeros((4096, *item.rows.shape[1:]), item.rows.dtype)
            )
            buf[:n] = item.rows
            item.rows = buf[:n]
        return out

    with pytest.raises(AssertionError, match="wrong rows"):
        run_trace(make_trace("decode", seed=0), _wrapped(alias))


def test_check_catches_missing_output():
    def drop(p, process):
        out = process()
        out.pop(sorted(out)[0], None)
        return out

    with pytest.raises(AssertionError, match="missing"):
        run_trace(make_trace("decode", seed=0), _wrapped(drop))


def test_demo_report(capsys):
    from sim.demo import run_demo_trace

    report = run_demo_trace("preemption", workers=("vllm",))
    text = capsys.readouterr().out
    assert "bytes vLLM copies" in text and "oracle-checked" in text
    run = report["runs"]["vllm"]
    assert run["error"] is None and run["rows_checked"] == run["rows_returned"] > 0
    assert run["bytes_accepted"] <= run["bytes_copied_by_vllm"]


# ---------------------------------------------------------------- request indices


def _recording_indices(steps: list):
    """A vLLM worker factory that records each prepared batch as ``(req_ids, idx_mapping_np,
    the request ids of the batches prepared and not yet processed)``."""

    def factory(sizes):
        inner = make_vllm_worker(sizes)
        in_flight: list[list[str]] = []

        class Pending:
            def __init__(self, pending, req_ids):
                self.pending, self.req_ids = pending, req_ids

            def enqueue_cpu_copy(self, num_sampled, num_rejected):
                self.pending.enqueue_cpu_copy(num_sampled=num_sampled, num_rejected=num_rejected)

            def process_output(self):
                in_flight.remove(self.req_ids)
                return self.pending.process_output()

        def prepare(batch, num_rejected):
            assert torch.equal(batch.idx_mapping, torch.from_numpy(batch.idx_mapping_np))
            steps.append(
                (list(batch.req_ids), batch.idx_mapping_np.tolist(), [*map(list, in_flight)])
            )
            pending = inner.prepare_output(batch, num_rejected)
            if pending is None:
                return None
            in_flight.append(list(batch.req_ids))
            return Pending(pending, in_flight[-1])

        return WorkerHandle("indices", inner.worker, inner.capture_buffer, prepare, lambda: 0)

    return factory


@pytest.mark.parametrize(
    "scenario, reuses_in_flight",
    [("finish_in_flight", True), ("shared_prefix", False), ("preemption", False),
     ("multi_turn", False)],
)  # fmt: skip
def test_batches_carry_request_indices_as_model_runner_v2_assigns_them(scenario, reuses_in_flight):
    """Indices are distinct in a batch, below max_num_seqs, kept by a request while it runs,
    and (MRV2's last-freed-first-taken) one finished request's index goes to a new request
    while a step that names the old owner is still in flight: the case a device state keyed
    by index must get right."""
    trace = make_trace(scenario, seed=3)
    steps: list = []
    run_trace(trace, _recording_indices(steps))
    owner: dict[int, str] = {}
    reused_in_flight = 0
    for req_ids, indices, in_flight in steps:
        assert len(set(indices)) == len(indices)
        assert all(0 <= i < trace.config.max_num_seqs for i in indices)
        flying = {r for batch in in_flight for r in batch}
        for req_id, index in zip(req_ids, indices):
            previous = owner.get(index)
            if previous is not None and previous != req_id and previous in flying:
                reused_in_flight += 1
            owner[index] = req_id
    if reuses_in_flight:  # aborts landing while the request's steps are in flight
        assert reused_in_flight > 0, "no index was reused with its old owner's step in flight"
