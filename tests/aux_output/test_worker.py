"""TritonAuxOutputWorker: step-by-step behaviour, its data paths, and its errors.

The byte-for-byte comparison with vLLM 0.33.0's connector over whole generated traces lives
in test_differential.py; these tests pin down the worker's own mechanisms: the three row
placements (device positions + direct writes, device staging, no positions), emitted rows
never aliasing reusable memory, store growth waiting for device writes, and every error.
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from r3capture.aux_output.errors import AuxOutputProtocolError
from r3capture.aux_output.sizing import WorkerSizing
from r3capture.aux_output.types import AuxOutputConnectorMetadata, PackedBlockHashes
from r3capture.aux_output.worker import TritonAuxOutputWorker
from r3capture.store import BlockStore, as_key_objects, key_string, rows_of_key_objects
from sim import make_trace, make_vllm_worker, run_trace
from sim.request_indices import RequestIndices
from sim.trace import SCENARIOS
from sim.workers import make_r3capture_worker, r3capture_worker_factory

B, L, K = 4, 3, 2
ROW_BYTES = L * K


def routes(seed: int, start: int, count: int) -> np.ndarray:
    """int32 ``[count, L, K]`` rows, distinct per (seed, position)."""
    p = np.arange(start, start + count)[:, None, None]
    return ((p * 7 + np.arange(L)[None, :, None] * 3 + np.arange(K) + seed * 11) % 251).astype(
        np.int32
    )


def hashes(seed: int, blocks: range) -> PackedBlockHashes:
    return PackedBlockHashes(b"".join(bytes([seed, b]) * 4 for b in blocks), 8)


def key_of(generation: int, seed: int, block: int) -> str:
    """vLLM's key string of block ``block`` of ``hashes(seed, ...)`` in ``generation``."""
    return f"vllm-artifact/{generation}/{(bytes([seed, block]) * 4).hex()}"


SIZES = dict(
    shape_per_token=(L, K),
    dtype="uint8",
    hash_block_size=B,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    max_concurrent_batches=2,
    max_bytes=B * ROW_BYTES * 64,
)


def make_worker(**overrides) -> TritonAuxOutputWorker:
    sizes = dict(SIZES)
    options = dict(kernel_impl="reference")
    for name, value in overrides.items():
        (sizes if name in sizes else options)[name] = value
    return TritonAuxOutputWorker(WorkerSizing(**sizes), **options)


_INDICES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def batch_of(worker: TritonAuxOutputWorker, **fields) -> SimpleNamespace:
    """An input batch as Model Runner V2 hands it over: host and device query_start_loc, and
    each request's index (held while the worker tracks the request, as MRV2 holds it until
    the request finishes)."""
    fields.setdefault("query_start_loc", torch.as_tensor(fields["query_start_loc_np"]))
    if "idx_mapping" not in fields:
        indices = _INDICES.setdefault(worker, RequestIndices(worker.sizing.max_num_seqs))
        indices.free([r for r in list(indices.of) if not worker._book.is_tracked(r)])
        for request_id in fields["req_ids"]:
            if request_id not in indices.of:
                indices.add(request_id)
        fields["idx_mapping_np"], fields["idx_mapping"] = indices.mapping(fields["req_ids"])
    return SimpleNamespace(**fields)


def run_step(worker, metadata, batch, rejected=None, sampled=None, padding=0, indices=None):
    """One synchronous step: rows of ``batch`` = [(req_id, seed, token_start, count)].
    ``padding``: entries past the batch's requests in the host arrays (vLLM reads only the
    first ``num_reqs``), filled with values no request has. ``indices``: the batch's
    ``idx_mapping`` (default: as MRV2 hands them out)."""
    started = start_step(worker, metadata, batch, rejected, padding, indices)
    return finish_step(started, sampled)


def start_step(worker, metadata, batch, rejected=None, padding=0, indices=None):
    """``begin_step`` and ``prepare_output`` of ``run_step``'s step; returns its
    ``PendingStep`` and host rejected counts, for ``finish_step``."""
    worker.begin_step(metadata)
    qsl = np.full(len(batch) + 1 + padding, 10**6, np.int32)
    qsl[0] = 0
    np.cumsum([count for *_, count in batch], out=qsl[1 : len(batch) + 1])
    rows = [routes(seed, start, count) for _, seed, start, count in batch]
    if rows:
        worker.capture_buffer[: qsl[len(batch)]] = torch.from_numpy(np.concatenate(rows))
    fields = dict(
        req_ids=[r for r, *_ in batch],
        query_start_loc_np=qsl,
        num_computed_tokens_np=np.array([s for _, _, s, _ in batch] + [-7] * padding, np.int32),
        positions=torch.from_numpy(
            np.concatenate([np.arange(s, s + c) for _, _, s, c in batch] or [np.zeros(0)])
        ).long(),
    )
    if indices is not None:
        fields["idx_mapping_np"] = np.array(indices, np.intp)
        fields["idx_mapping"] = torch.tensor(indices, dtype=torch.int64)
    n = len(batch)
    rejected = np.zeros(n, np.int32) if rejected is None else np.asarray(rejected, np.int32)
    # What the plugin does: the step's device rejected counts reach the kernel.
    worker.set_step_num_rejected(torch.from_numpy(rejected))
    return worker.prepare_output(batch_of(worker, **fields)), rejected


def finish_step(started, sampled=None):
    """The copy and ``process_output`` of the step ``start_step`` launched."""
    pending, rejected = started
    n = len(rejected)
    sampled = np.ones(n, np.int32) if sampled is None else np.asarray(sampled, np.int32)
    pending.enqueue_cpu_copy(num_sampled=sampled, num_rejected=rejected)
    return pending.process_output()


def meta(requests, block_hashes=None, finished=(), generation=0):
    return AuxOutputConnectorMetadata(generation, requests, block_hashes or {}, tuple(finished))


@pytest.mark.parametrize("destination", ["direct", "staging"])
def test_prefill_then_speculative_decode(destination):
    worker = make_worker(destination=destination)
    out = run_step(worker, meta({"a": 0}, {"a": hashes(1, range(2))}), [("a", 1, 0, 10)])
    assert out["a"].token_start == 0
    assert out["a"].rows.dtype == np.uint8
    assert np.array_equal(out["a"].rows, routes(1, 0, 10).astype(np.uint8))
    # Two complete keyed blocks went to the store without a copy; the open block did not.
    assert len(worker.store) == 2
    out = run_step(worker, meta({"a": 10}), [("a", 1, 10, 4)], rejected=[2], sampled=[2])
    assert out["a"].token_start == 10
    assert np.array_equal(out["a"].rows, routes(1, 10, 2).astype(np.uint8))
    if destination == "direct":
        # 10 prefill rows, then 2 of 4 speculative rows: rejected rows never reach the host.
        assert worker.transfer_stats == {"steps": 2, "rows": 12, "bytes": 12 * ROW_BYTES}
    else:
        # The staging copy moves every scheduled row.
        assert worker.transfer_stats == {"steps": 2, "rows": 14, "bytes": 14 * ROW_BYTES}
    stored = worker.store.get_array([key_of(0, 1, 1)])
    assert stored.tobytes() == routes(1, 4, 4).astype(np.uint8).tobytes()
    worker.close()


@pytest.mark.parametrize(
    "drafts, kernel_reads_counts",
    [(0, False), (2, True), (None, True), (np.int64(0), True)],
    ids=["no-drafts", "drafts", "field-absent", "not-an-int"],
)
def test_rejected_counts_reach_the_kernel_only_for_a_batch_with_drafts(
    monkeypatch, drafts, kernel_reads_counts
):
    """A batch whose ``num_draft_tokens`` is the int 0 cannot reject a row: the kernel is
    launched without its (all-zero) counts. Drafts, no such field, or a value of another type
    keep them. The rows returned are the same either way."""
    from r3capture.kernels import GatherAllocLaunch

    counts_seen = []
    launch = GatherAllocLaunch.launch_checked
    monkeypatch.setattr(
        GatherAllocLaunch, "launch_checked", lambda *a: (counts_seen.append(a[5]), launch(*a))
    )
    worker = make_worker()
    worker.begin_step(meta({"a": 0}))
    worker.capture_buffer[:3] = torch.from_numpy(routes(1, 0, 3))
    fields = dict(
        req_ids=["a"],
        query_start_loc_np=np.array([0, 3], np.int32),
        num_computed_tokens_np=np.array([0], np.int32),
        positions=torch.arange(3),
    )
    if drafts is not None:
        fields["num_draft_tokens"] = drafts
    worker.set_step_num_rejected(torch.zeros(1, dtype=torch.int32))
    pending = worker.prepare_output(batch_of(worker, **fields))
    pending.enqueue_cpu_copy(num_sampled=np.ones(1, np.int32), num_rejected=np.zeros(1, np.int32))
    out = pending.process_output()
    assert [counts is not None for counts in counts_seen] == [kernel_reads_counts]
    assert np.array_equal(out["a"].rows, routes(1, 0, 3).astype(np.uint8))
    worker.close()


def test_a_step_without_requests_launches_nothing(monkeypatch):
    """An empty step launches no kernel (and so takes no launch serial); the steps around it
    still write their rows."""
    from r3capture.kernels import GatherAllocLaunch

    launches = []
    launch = GatherAllocLaunch.launch_checked
    monkeypatch.setattr(
        GatherAllocLaunch, "launch_checked", lambda *a: (launches.append(a[1]), launch(*a))
    )
    worker = make_worker()
    out = run_step(worker, meta({"a": 0}), [("a", 1, 0, 3)])
    assert np.array_equal(out["a"].rows, routes(1, 0, 3).astype(np.uint8))
    assert run_step(worker, meta({}), []) == {}
    out = run_step(worker, meta({"a": 3}), [("a", 1, 3, 2)])
    assert np.array_equal(out["a"].rows, routes(1, 3, 2).astype(np.uint8))
    assert [shape.launch for shape in launches] == [1, 2]
    worker.close()


@pytest.mark.parametrize("step_fails", [False, True])
def test_a_request_finishing_with_a_step_in_flight_is_torn_down_by_that_step(step_fails):
    """Two steps in flight (async scheduling); a finishes while its second step is in
    flight. As in vLLM, a keeps its state and its keys until that step is processed, which
    returns its row and then tears it down (keys released, slots freed); b is untouched.
    A step whose commit fails tears nothing down, as in vLLM (a stays tracked)."""
    worker = make_worker()
    run_step(
        worker,
        meta({"a": 0, "b": 0}, {"a": hashes(1, range(2))}),
        [("a", 1, 0, 8), ("b", 2, 0, 3)],
    )
    first = start_step(worker, meta({"a": 8, "b": 3}), [("a", 1, 8, 1), ("b", 2, 3, 1)])
    second = start_step(worker, meta({"a": 9, "b": 4}), [("a", 1, 9, 1), ("b", 2, 4, 1)])
    finish_step(first)
    worker.begin_step(meta({}, finished=["a"]))
    a_keys = [key_of(0, 1, b) for b in range(2)]
    assert worker.num_active_requests() == 2
    assert [worker.store.ref_count(key) for key in a_keys] == [1, 1]
    if step_fails:
        pending, _ = second
        with pytest.raises(AuxOutputProtocolError, match="rejected-token count"):
            finish_step((pending, np.array([2, 0], np.int32)))  # 2 of a's 1 row rejected
        assert worker.num_active_requests() == 2
        assert [worker.store.ref_count(key) for key in a_keys] == [1, 1]
        return
    out = finish_step(second)
    assert np.array_equal(out["a"].rows, routes(1, 9, 1).astype(np.uint8))
    assert np.array_equal(out["b"].rows, routes(2, 4, 1).astype(np.uint8))
    assert worker.num_active_requests() == 1
    assert [worker.store.ref_count(key) for key in a_keys] == [0, 0]
    # b's rows go on where they were; once b is gone too, no slot is left out of the store.
    out = run_step(worker, meta({"b": 5}), [("b", 2, 5, 1)])
    assert np.array_equal(out["b"].rows, routes(2, 5, 1).astype(np.uint8))
    assert run_step(worker, meta({}, finished=["b"]), []) == {}
    assert worker.num_active_requests() == 0
    assert worker.store.num_unbound == worker._book.queued_slots  # only the queue's stock
    worker.close()


def test_a_step_without_requests_applies_its_key_work_and_counts_no_rows():
    """A finish-only step: its process_output releases the finished request's keys (vLLM
    releases them in that step too), and the step is counted with no rows moved."""
    worker = make_worker()
    run_step(worker, meta({"a": 0}, {"a": hashes(1, range(2))}), [("a", 1, 0, 8)])
    assert [worker.store.ref_count(key_of(0, 1, b)) for b in range(2)] == [1, 1]
    before = dict(worker.transfer_stats)
    assert run_step(worker, meta({}, finished=["a"]), []) == {}
    assert [worker.store.ref_count(key_of(0, 1, b)) for b in range(2)] == [0, 0]
    assert worker.transfer_stats == {**before, "steps": before["steps"] + 1}
    worker.close()


def test_emitted_rows_do_not_alias_reused_slots():
    worker = make_worker(max_bytes=B * ROW_BYTES * 2)
    out = run_step(worker, meta({"a": 0}, {"a": hashes(1, range(1))}), [("a", 1, 0, 4)])
    first = out["a"].rows
    snapshot = first.copy()
    assert not np.shares_memory(first, worker.store.arena_np)
    worker.begin_step(meta({}, finished=["a"]))
    # New keyed blocks evict a's block; its slot is handed out again and rewritten.
    for seed in (3, 4, 5):
        out = run_step(
            worker,
            meta({f"r{seed}": 0}, {f"r{seed}": hashes(seed, range(1))}),
            [(f"r{seed}", seed, 0, 4)],
        )
        assert not np.shares_memory(out[f"r{seed}"].rows, worker.store.arena_np)
    assert key_of(0, 1, 0) not in worker.store
    assert np.array_equal(first, snapshot)
    worker.close()


def test_single_row_step_after_rejection_reattaches_at_the_cursor():
    """Async scheduling: the scheduler assumed every draft was accepted and schedules the
    next token at 12, but two were rejected, so the row belongs at position 10."""
    worker = make_worker()
    run_step(worker, meta({"a": 0}, {"a": hashes(1, range(2))}), [("a", 1, 0, 8)])
    out = run_step(worker, meta({"a": 8}), [("a", 1, 8, 4)], rejected=[2], sampled=[2])
    assert out["a"].token_start == 8 and len(out["a"].rows) == 2
    worker.begin_step(meta({"a": 10}))
    worker.capture_buffer[:1] = torch.from_numpy(routes(1, 10, 1))
    fields = dict(
        req_ids=["a"],
        query_start_loc_np=np.array([0, 1], np.int32),
        num_computed_tokens_np=np.array([12], np.int32),  # the scheduler's optimistic view
        positions=torch.tensor([10]),  # the model runner's corrected position
    )
    worker.set_step_num_rejected(torch.zeros(1, dtype=torch.int32))
    pending = worker.prepare_output(batch_of(worker, **fields))
    pending.enqueue_cpu_copy(num_sampled=np.ones(1, np.int32), num_rejected=np.zeros(1, np.int32))
    out = pending.process_output()
    assert out["a"].token_start == 10
    assert np.array_equal(out["a"].rows, routes(1, 10, 1).astype(np.uint8))
    worker.close()


def test_request_id_reused_after_finishing_starts_fresh():
    """A batch whose ids equal the previous batch's reuses that batch's table rows only while
    no request came or went: ids that finished and return are new requests."""
    worker = make_worker()
    batch = [("a", 1, 0, 3), ("b", 2, 0, 3)]
    run_step(worker, meta({"a": 0, "b": 0}), batch)
    out = run_step(worker, meta({"a": 3, "b": 3}), [("a", 1, 3, 1), ("b", 2, 3, 1)])
    assert out["a"].token_start == 3 and out["b"].token_start == 3
    worker.begin_step(meta({}, finished=["a", "b"]))
    # Same ids, same order as the last scheduled batch, but new requests from position 0.
    out = run_step(worker, meta({"a": 0, "b": 0}), [("a", 5, 0, 2), ("b", 6, 0, 2)])
    assert out["a"].token_start == 0 and out["b"].token_start == 0
    assert np.array_equal(out["a"].rows, routes(5, 0, 2).astype(np.uint8))
    assert np.array_equal(out["b"].rows, routes(6, 0, 2).astype(np.uint8))
    worker.close()


def test_prefix_hit_materializes_from_the_store():
    worker = make_worker()
    run_step(worker, meta({"a": 0}, {"a": hashes(1, range(2))}), [("a", 1, 0, 9)])
    run_step(worker, meta({"a": 9}, finished=()), [("a", 1, 9, 1)])
    # Request b shares a's first two blocks (same hashes) and starts computing at 8.
    out = run_step(worker, meta({"b": 0}, {"b": hashes(1, range(3))}), [("b", 1, 8, 5)])
    assert out["b"].token_start == 0
    assert np.array_equal(out["b"].rows, routes(1, 0, 13).astype(np.uint8))
    worker.close()


def test_a_decoders_partial_first_block_is_returned_and_never_published():
    """P/D splice: a decoder's first capture starts inside a hash block (the prefiller
    trimmed the prompt, its KV covers rows 0..5). Its rows come back from row 6; the partial
    block 1 (rows 4..7) never reaches the store, so a later hit on it fails closed rather
    than returning rows 4 and 5 that nobody captured; the next whole block is published."""
    worker = make_worker(partial_first_ok=True)
    out = run_step(worker, meta({"d": 6}, {"d": hashes(2, range(3))}), [("d", 2, 6, 4)])
    assert out["d"].token_start == 6
    assert np.array_equal(out["d"].rows, routes(2, 6, 4).astype(np.uint8))
    # Block 1 is complete and its rows returned: it left the ring, unpublished.
    assert worker._book.table.rings.num_partial == 0
    assert worker.store.peek_slot(key_of(0, 2, 1)) is None
    out = run_step(worker, meta({"d": 10}), [("d", 2, 10, 2)])
    assert np.array_equal(out["d"].rows, routes(2, 10, 2).astype(np.uint8))
    assert worker.store.peek_slot(key_of(0, 2, 1)) is None
    assert worker.store.ref_count(key_of(0, 2, 2)) == 1
    # A hit on block 2 reads the decoder's rows of it; one on block 1 fails closed.
    out = run_step(worker, meta({"e": 8}, {"e": hashes(2, range(4))}), [("e", 5, 12, 2)])
    expected = np.concatenate([routes(2, 8, 4), routes(5, 12, 2)]).astype(np.uint8)
    assert out["e"].token_start == 8 and np.array_equal(out["e"].rows, expected)
    with pytest.raises(Exception, match="evicted|max_bytes"):
        run_step(worker, meta({"f": 4}, {"f": hashes(2, range(4))}), [("f", 6, 12, 2)])
    worker.close()


def test_a_partial_first_block_waits_for_its_rows_to_be_returned():
    """A chunk that samples nothing completes the partial block without returning its rows:
    the block stays unpublished (and keeps the blocks after it unpublished) until a later
    step returns them, then leaves."""
    worker = make_worker(partial_first_ok=True)
    run_step(worker, meta({"d": 6}, {"d": hashes(2, range(3))}), [("d", 2, 6, 4)], sampled=[0])
    assert worker._book.table.rings.num_partial == 1
    assert worker.store.peek_slot(key_of(0, 2, 1)) is None
    out = run_step(worker, meta({"d": 6}), [("d", 2, 10, 2)])
    assert out["d"].token_start == 6
    assert np.array_equal(out["d"].rows, routes(2, 6, 6).astype(np.uint8))
    assert worker._book.table.rings.num_partial == 0
    assert worker.store.peek_slot(key_of(0, 2, 1)) is None
    assert worker.store.ref_count(key_of(0, 2, 2)) == 1
    worker.close()


def test_a_first_capture_inside_a_block_is_refused_without_pd_splice():
    worker = make_worker()
    with pytest.raises(AuxOutputProtocolError, match="hash-block boundary"):
        run_step(worker, meta({"d": 6}), [("d", 2, 6, 4)])
    worker.close()


def test_a_partial_first_block_blocks_publication_until_it_leaves():
    """Until the partial first block leaves, no block of the request is published (blocks
    are published in order); a decoder torn down before it completes frees its slot."""
    worker = make_worker(partial_first_ok=True)
    unbound = worker.store.num_unbound
    run_step(worker, meta({"d": 5}, {"d": hashes(2, range(2))}), [("d", 2, 5, 1)])
    assert worker._book.table.rings.num_partial == 1
    assert worker.store.peek_slot(key_of(0, 2, 1)) is None
    worker.begin_step(meta({}, finished=["d"]))
    run_step(worker, meta({"g": 0}), [("g", 3, 0, 1)])
    assert worker._book.table.rings.num_partial == 0
    assert worker.num_active_requests() == 1
    assert worker.store.num_unbound <= unbound + 1  # g's open block, nothing of d's
    worker.close()


def test_a_prefix_cache_reset_drops_every_request_and_starts_a_new_key_namespace():
    """As vLLM's worker does on a generation bump: every request is dropped (a live one too)
    and its keys released, key work recorded before the bump is applied before it, and the
    same hashes name new keys, whose hits return the new generation's rows."""
    worker = make_worker()
    first = meta({"a": 0, "x": 0}, {"a": hashes(1, range(2)), "x": hashes(3, range(1))})
    run_step(worker, first, [("a", 1, 0, 9), ("x", 3, 0, 5)])
    old_keys = [key_of(0, 1, 0), key_of(0, 1, 1), key_of(0, 3, 0)]
    assert [worker.store.ref_count(key) for key in old_keys] == [1, 1, 1]
    # a's teardown is recorded with no commit after it; x is still live at the bump.
    worker.begin_step(meta({}, finished=["a"]))
    out = run_step(
        worker, meta({"b": 0}, {"b": hashes(1, range(2))}, generation=1), [("b", 2, 0, 8)]
    )
    assert np.array_equal(out["b"].rows, routes(2, 0, 8).astype(np.uint8))
    assert worker.num_active_requests() == 1
    assert [worker.store.ref_count(key) for key in old_keys] == [0, 0, 0]
    assert [worker.store.ref_count(key_of(1, 1, b)) for b in range(2)] == [1, 1]
    # Slots held now are b's alone: those of a worker that only ever ran b's step.
    alone = make_worker()
    run_step(alone, meta({"b": 0}, {"b": hashes(1, range(2))}), [("b", 2, 0, 8)])
    held = [w.store.num_unbound - w._book.queued_slots for w in (worker, alone)]
    assert held[0] == held[1]
    # A hit on the same hashes in the new generation reads b's blocks, not a's.
    hit = meta({"c": 0}, {"c": hashes(1, range(3))}, generation=1)
    out = run_step(worker, hit, [("c", 4, 8, 2)])
    expected = np.concatenate([routes(2, 0, 8), routes(4, 8, 2)]).astype(np.uint8)
    assert np.array_equal(out["c"].rows, expected)
    worker.close()
    alone.close()


def test_evicted_prefix_fails_closed_naming_max_bytes():
    from r3capture.store import BlockObjectStoreError

    worker = make_worker(max_bytes=B * ROW_BYTES * 2)
    run_step(worker, meta({"a": 0}, {"a": hashes(1, range(2))}), [("a", 1, 0, 8)])
    worker.begin_step(meta({}, finished=["a"]))
    # Two other blocks push a's unreferenced blocks out of a two-object store.
    run_step(worker, meta({"c": 0}, {"c": hashes(3, range(2))}), [("c", 3, 0, 8)])
    with pytest.raises(BlockObjectStoreError, match="max_bytes"):
        run_step(worker, meta({"b": 0}, {"b": hashes(1, range(2))}), [("b", 1, 8, 2)])


@pytest.mark.parametrize(
    "case, match",
    [
        ("backwards", "moved backwards"),
        ("mid-block", "not contiguous"),
        ("rejected", "rejected-token count"),
        ("emit-ahead", "emit cursor moved ahead"),
        ("run-and-finish", "cannot run and finish"),
    ],
)
def test_protocol_violations_raise(case, match):
    worker = make_worker()
    run_step(worker, meta({"a": 0}), [("a", 1, 0, 6)])
    with pytest.raises(AuxOutputProtocolError, match=match):
        if case == "backwards":
            run_step(worker, meta({"a": 6}), [("a", 1, 3, 1)])
        elif case == "mid-block":
            run_step(worker, meta({"z": 0}), [("z", 2, 5, 2)])
        elif case == "rejected":
            run_step(worker, meta({"a": 6}), [("a", 1, 6, 2)], rejected=[3])
        elif case == "emit-ahead":
            worker.begin_step(meta({"a": 9}))
        else:
            worker.begin_step(meta({"a": 6}, finished=["a"]))


def test_outputs_in_flight_are_bounded():
    worker = make_worker(max_concurrent_batches=1)
    worker.begin_step(meta({"a": 0}))
    batch = batch_of(
        worker,
        req_ids=["a"],
        query_start_loc_np=np.array([0, 1]),
        num_computed_tokens_np=np.array([0]),
        positions=torch.zeros(1, dtype=torch.int64),
    )
    worker.prepare_output(batch)
    with pytest.raises(AuxOutputProtocolError, match="not consumed in order"):
        worker.prepare_output(batch)


def test_a_step_is_processed_once():
    """The worker's one account of the steps in flight refuses a second ``process_output``
    of a step, and the step's place in flight is free again after the first."""
    worker = make_worker(max_concurrent_batches=1)
    started = start_step(worker, meta({"a": 0}), [("a", 1, 0, 1)])
    pending = started[0]
    assert finish_step(started)["a"].rows.shape[0] == 1
    with pytest.raises(AuxOutputProtocolError, match="already processed"):
        pending.process_output()
    assert len(run_step(worker, meta({"a": 1}), [("a", 1, 1, 1)])["a"].rows) == 1


def test_warmup_and_non_output_ranks_skip_the_data_plane():
    worker = make_worker()
    batch = batch_of(
        worker,
        req_ids=["a"],
        query_start_loc_np=np.array([0, 1]),
        num_computed_tokens_np=np.array([0]),
        positions=torch.zeros(1, dtype=torch.int64),
    )
    worker.begin_step(None)
    assert worker.prepare_output(batch) is None
    other_rank = make_worker(is_output_rank=False)
    other_rank.begin_step(meta({"a": 0}))
    assert other_rank.prepare_output(batch) is None
    assert other_rank.store is None
    assert other_rank.capture_buffer.shape == (32, L, K)


def test_store_growth_waits_for_device_writes_first():
    worker = make_worker(max_bytes=B * ROW_BYTES)
    calls = []
    # The store's on_grow is the worker's wait for its device writes.
    worker.device_side.wait_idle = lambda: calls.append(len(worker.store))
    # Request a holds references to three keyed blocks: the one-object store must grow.
    out = run_step(worker, meta({"a": 0}, {"a": hashes(1, range(3))}), [("a", 1, 0, 12)])
    assert calls, "the store grew without waiting for in-flight device writes"
    assert np.array_equal(out["a"].rows, routes(1, 0, 12).astype(np.uint8))
    # The next launch writes into the grown arena, where the next emit reads.
    out = run_step(worker, meta({"a": 12}), [("a", 1, 12, 2)])
    assert np.array_equal(out["a"].rows, routes(1, 12, 2).astype(np.uint8))


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        ({"dtype": "int32"}, ValueError, "dtype must be uint8 or uint16, got int32"),
        ({"dtype": None}, TypeError, "dtype must be uint8 or uint16"),
        ({"hash_block_size": 0}, ValueError, "hash_block_size must be >= 1, got 0"),
        ({"hash_block_size": 2.5}, TypeError, "hash_block_size must be an integer, got float"),
        ({"hash_block_size": True}, TypeError, "hash_block_size must be an integer, got bool"),
        ({"max_num_seqs": 2.5}, TypeError, "max_num_seqs must be an integer, got float"),
        ({"max_num_batched_tokens": "4"}, TypeError, "max_num_batched_tokens must be an int"),
        ({"max_concurrent_batches": None}, TypeError, "max_concurrent_batches must be an int"),
        ({"shape_per_token": (3.5, 5)}, TypeError, "shape_per_token\\[0\\] \\(L\\) must be an"),
        ({"shape_per_token": (3,)}, ValueError, "shape_per_token must be \\(L, K\\)"),
        ({"max_bytes": 5}, ValueError, "max_bytes must hold at least one block of 24 bytes"),
        (
            {"capture_buffer": torch.zeros(32, L + 1, K, dtype=torch.int32)},
            ValueError,
            "capture_buffer has shape \\(32, 4, 2\\)",
        ),
        (
            {"capture_buffer": torch.zeros(32, L, K, dtype=torch.float32)},
            ValueError,
            "capture_buffer has dtype torch.float32",
        ),
        (
            {"capture_buffer": torch.zeros(31, L, K, dtype=torch.int32)},
            ValueError,
            "capture_buffer has shape \\(31, 3, 2\\) \\(at least \\[32, 3, 2\\]\\)",
        ),
        (
            {"capture_buffer": torch.zeros(K, L, 32, dtype=torch.int32).transpose(0, 2)},
            ValueError,
            "capture_buffer has a non-contiguous layout",
        ),
        (
            {"capture_buffer": torch.zeros(32, L, K, dtype=torch.int32, device="meta")},
            ValueError,
            "capture_buffer has device meta \\(cpu\\)",
        ),
        (
            {"capture_buffer": np.zeros((32, L, K), np.int32)},
            TypeError,
            "capture_buffer must be a torch.Tensor, got ndarray",
        ),
        ({"kernel_impl": "cuda"}, ValueError, "kernel_impl must be auto\\|triton\\|reference"),
        ({"destination": "host"}, ValueError, "destination must be auto\\|direct\\|staging"),
    ],
    ids=lambda v: None if isinstance(v, (dict, type)) else "",
)
def test_bad_construction_is_rejected_with_the_argument_named(overrides, error, message):
    with pytest.raises(error, match=message):
        make_worker(**overrides)


@pytest.mark.parametrize(
    "positions, message",
    [
        (None, "a torch.Tensor; got 'NoneType'"),
        (torch.zeros(3, 2, dtype=torch.int64), "1-D; got shape \\(3, 2\\)"),
        (torch.zeros(3), "dtype int32/int64; got shape \\(3,\\), dtype torch.float32"),
        (torch.zeros(1, dtype=torch.int64), "of length >= num_rows \\(3\\); got shape \\(1,\\)"),
    ],
    ids=["missing", "mrope-2d", "float", "short"],
)
def test_prepare_output_needs_the_device_positions(positions, message):
    """Rows are placed at the device's positions (async reattachment); a batch without them
    is refused before anything changes, and so is one without the device query_start_loc."""
    worker = make_worker()
    worker.begin_step(meta({"a": 0}))
    batch = batch_of(
        worker,
        req_ids=["a"],
        query_start_loc_np=np.array([0, 3]),
        num_computed_tokens_np=np.array([0]),
        positions=positions,
    )
    with pytest.raises(ValueError, match="input_batch.positions must.*" + message):
        worker.prepare_output(batch)
    batch.positions, batch.query_start_loc = torch.arange(3), None
    with pytest.raises(ValueError, match="input_batch.query_start_loc must.*got 'NoneType'"):
        worker.prepare_output(batch)
    batch.query_start_loc = torch.tensor([0, 3])
    batch.positions = torch.arange(3)
    pending = worker.prepare_output(batch)
    pending.enqueue_cpu_copy(num_sampled=np.ones(1, np.int32), num_rejected=np.zeros(1, np.int32))
    assert pending.process_output()["a"].rows.shape == (3, L, K)


def test_triton_kernel_under_the_interpreter_matches_vllm():
    trace = make_trace("async_spec", seed=0, size="tiny")
    theirs = run_trace(trace, make_vllm_worker, check=False)

    def factory(sizes):
        return make_r3capture_worker(sizes, kernel_impl="triton")

    ours = run_trace(trace, factory)
    assert [s.outputs for s in ours.steps] == [s.outputs for s in theirs.steps]


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_key_the_worker_reads_is_referenced(scenario, monkeypatch):
    """The worker reads stored blocks with ``lookup_slots(held=True)``, which skips the LRU
    refresh. That is exact only if every key read holds a reference (referenced keys are
    never in the LRU); check it on every scenario, fail-closed ones included."""
    original = BlockStore.lookup_slots
    reads = []

    def checked(store, keys, *, held=False):
        if held:
            strings = map(key_string, rows_of_key_objects(as_key_objects(keys)))
            unreferenced = [k for k in strings if store.ref_count(k) == 0]
            assert not unreferenced, f"read without a reference: {unreferenced[:3]}"
            reads.append(len(keys))
        return original(store, keys, held=held)

    monkeypatch.setattr(BlockStore, "lookup_slots", checked)
    for seed in range(3):
        run_trace(
            make_trace(scenario, seed=seed),
            r3capture_worker_factory(kernel_impl="reference"),
            catch_errors=True,
            check=False,
        )
    if scenario in ("chunked_prefill", "multi_turn", "shared_prefix"):
        assert reads, "the scenario should read stored blocks"


def test_async_decode_takes_one_slot_per_block_and_flags_each_request_fresh_once(monkeypatch):
    """Two steps in flight (MRV2's async scheduling): the kernel gives a request a new slot
    exactly when its token enters a new block, the host learns it at the commit, no
    request's unbound range grows beyond the blocks of the steps in flight, and only a
    request's first launch flags it as new to its index."""
    from r3capture.aux_output.device_side import DeviceSide

    fresh_launches = []
    launch = DeviceSide.launch

    def recording(self, *args, fresh, **kwargs):
        fresh_launches.append(fresh)
        return launch(self, *args, fresh=fresh, **kwargs)

    monkeypatch.setattr(DeviceSide, "launch", recording)
    worker = make_worker(max_concurrent_batches=2, max_num_seqs=3)
    table = worker._book.table
    names, seeds, lengths = ["a", "b", "c"], [1, 2, 3], [3, 5, 6]
    prefill_hashes = {n: hashes(s, range(ln // B)) for n, s, ln in zip(names, seeds, lengths)}
    run_step(worker, meta({n: 0 for n in names}, prefill_hashes),
             [(n, s, 0, ln) for n, s, ln in zip(names, seeds, lengths)])  # fmt: skip
    assert fresh_launches == [True]
    in_flight = []
    outputs = {n: [] for n in names}
    rows = table.rows(names)
    for step in range(40):
        starts = [ln + step for ln in lengths]
        # The scheduler sends a block's hash with the step that computes its last token.
        completed = {
            n: hashes(s, [t // B]) for n, s, t in zip(names, seeds, starts) if (t + 1) % B == 0
        }
        worker.begin_step(meta(dict(zip(names, starts)), completed))
        worker.capture_buffer[:3] = torch.from_numpy(
            np.concatenate([routes(s, t, 1) for s, t in zip(seeds, starts)])
        )
        batch = batch_of(
            worker,
            req_ids=names,
            query_start_loc_np=np.arange(4, dtype=np.int32),
            num_computed_tokens_np=np.array(starts, np.int32),
            positions=torch.tensor(starts, dtype=torch.int64),
        )
        worker.set_step_num_rejected(torch.zeros(3, dtype=torch.int32))
        pending = worker.prepare_output(batch)
        sampled, rejected = np.ones(3, np.int32), np.zeros(3, np.int32)
        pending.enqueue_cpu_copy(num_sampled=sampled, num_rejected=rejected)
        in_flight.append((pending, starts))
        if len(in_flight) == 2:
            done, done_starts = in_flight.pop(0)
            for name, out in done.process_output().items():
                outputs[name].append(out)
            # Committed through done_starts: each request's slots end at its token's block.
            assert table.rings.end[rows].tolist() == [t // B + 1 for t in done_starts]
            assert (table.rings.end[rows] - table.rings.base[rows]).max() <= 2
    for name, out in in_flight.pop()[0].process_output().items():
        outputs[name].append(out)
    assert fresh_launches == [True] + [False] * 40
    for name, seed, length in zip(names, seeds, lengths):
        got = np.concatenate([o.rows for o in outputs[name]])
        assert outputs[name][0].token_start == length
        assert np.array_equal(got, routes(seed, length, 40).astype(np.uint8))
    worker.close()


def _long_prefills_without_keys(worker, names: list[str]) -> None:
    """Each of ``names`` prefills 96 rows in three 32-row steps, and no block hash ever
    arrives: every block stays unbound, and each row comes back right."""
    for seed, name in enumerate(names):
        for step in range(3):
            start = 32 * step
            out = run_step(worker, meta({name: start}), [(name, seed, start, 32)])
            assert np.array_equal(out[name].rows, routes(seed, start, 32).astype(np.uint8))


def test_blocks_waiting_for_their_keys_grow_the_slot_reserve_instead_of_failing():
    """Unbound blocks (their keys have not arrived) hold slots beside the queue's stock; when
    the reserve runs out, refilling the queue grows the store (waiting for device writes
    first) instead of failing, and every request's rows still come back right."""
    worker = make_worker(max_num_seqs=2)
    reserve = worker.store.reserve_slots
    _long_prefills_without_keys(worker, ["a", "b"])
    assert worker.store.num_unbound > reserve
    assert worker.store.reserve_slots >= worker.store.num_unbound
    for seed, name in enumerate(["a", "b"]):
        out = run_step(worker, meta({name: 96}), [(name, seed, 96, 1)])
        assert np.array_equal(out[name].rows, routes(seed, 96, 1).astype(np.uint8))
    worker.close()


def _four_new_requests_write_their_rows(worker, step: int) -> list[str]:
    """One step of four new requests, 3 rows each (seeds ``4 * step + i``); checks each one's
    rows and returns their ids."""
    names = [f"s{step}r{i}" for i in range(4)]
    out = run_step(worker, meta({n: 0 for n in names}), [(n, step * 4 + i, 0, 3) for i, n in
                                                         enumerate(names)])  # fmt: skip
    for i, name in enumerate(names):
        assert np.array_equal(out[name].rows, routes(step * 4 + i, 0, 3).astype(np.uint8))
    return names


def test_a_launch_after_the_arena_grew_writes_rows_into_its_new_slots():
    """Refilling the queue can grow the store's arena; launches after it must write the rows
    that land in slots past the old arena there, not refuse them."""
    worker = make_worker(max_num_seqs=2, max_bytes=B * ROW_BYTES * 4)  # a small first arena
    store, queue = worker.store, worker._book.launcher.queue
    beyond_old_arena = []
    allocate = queue._allocate

    def watched_allocate(n):
        physical = store.arena.shape[0]
        slots = allocate(n)
        beyond_old_arena.append(int(slots.max()) >= physical)
        return slots

    queue._allocate = watched_allocate
    _long_prefills_without_keys(worker, ["a", "b"])
    assert any(beyond_old_arena), "no refill took slots past the arena it started with"
    worker.close()


def test_finished_requests_free_their_slots_before_the_reserve_grows():
    """Teardown of requests that finish with no step in flight is recorded for the output
    thread; a launch that runs short of reserve slots applies it first, so a batch that
    replaces a finished one does not grow the store."""
    worker = make_worker()
    reserve = worker.store.reserve_slots
    for step in range(3):
        names = _four_new_requests_write_their_rows(worker, step)
        worker.begin_step(meta({}, finished=names))
        assert worker.num_active_requests() == 4  # recorded, not yet applied
    assert worker.store.reserve_slots == reserve
    worker.close()


@pytest.mark.parametrize("destination", ["direct", "staging"])
def test_a_failed_step_that_took_slots_leaves_the_queue_account_right(destination):
    """A step whose kernel took new slots but whose process_output fails (here: host counts
    vLLM never sends) still hands those slots to its request when it leaves flight, so the
    next commits read the slots later launches took, not the failed step's: rows stay right."""
    worker = make_worker(destination=destination)
    run_step(worker, meta({"a": 0}), [("a", 1, 0, 3)])
    pending, _ = start_step(worker, meta({"a": 3}), [("a", 1, 3, 6)])  # blocks 0-2: 2 new
    pending.enqueue_cpu_copy(num_sampled=np.ones(1, np.int32), num_rejected=np.ones(1))
    with pytest.raises(ValueError, match="num_rejected must be a 1-D integer numpy array"):
        pending.process_output()
    queue = worker._book.launcher.queue
    assert queue.committed == 3  # one slot in the first step, two in the failed one
    out = run_step(worker, meta({"b": 0}), [("b", 2, 0, 9)])
    assert np.array_equal(out["b"].rows, routes(2, 0, 9).astype(np.uint8))
    worker.close()
