"""RowReader on its own: emit, materialize and place_staged against per-position lookups.

``emit``: both ways of gathering the rows (numpy's take for small outputs, the pool's
buffers for large ones) must give each request exactly its rows ``emit_start .. token_end``,
in order, whatever the counts and wherever the ring wraps.
``materialize``: a prefix hit's stored blocks, then its open block, and vLLM's refusals.
``place_staged``: each accepted staged row lands in its ring slot, and no other.
"""

from __future__ import annotations

import numpy as np
import pytest

from r3capture.aux_output.errors import AuxOutputProtocolError
from r3capture.aux_output.output_pool import OutputPool
from r3capture.aux_output.request_table import RequestTable
from r3capture.aux_output.row_reader import RowReader
from r3capture.aux_output.step_commit import CommitPlan, StepLayout
from r3capture.store import KEY_WORDS, BlockStore, key_objects

B, L, K, W = 4, 2, 3, 6  # hash block, layers, top-k, ring width (blocks)
ROW_NBYTES = L * K


def _give_slots(store: BlockStore, table: RequestTable, rows, firsts, lasts) -> np.ndarray:
    """Give each ``rows[i]`` (no blocks yet, or ending at ``firsts[i]``) new store slots for
    blocks ``firsts[i] .. lasts[i]``, as the commit does with the slots its launch took;
    returns the block counts."""
    rows, firsts, lasts = (np.asarray(a, np.int64) for a in (rows, firsts, lasts))
    counts = lasts + 1 - firsts
    table.rings.extend(rows, firsts, counts, store.allocate(int(counts.sum())))
    return counts


def _store() -> BlockStore:
    """A store of ``B``-row blocks with room for every test's slots."""
    return BlockStore(max_bytes=1 << 16, object_nbytes=B * ROW_NBYTES, reserve_slots=256)


def _reader(store: BlockStore, table: RequestTable, pool: OutputPool | None = None) -> RowReader:
    """A reader of uint8 rows ``[L, K]``; without a pool, outputs are plain arrays."""
    pool = OutputPool(max_bytes=0) if pool is None else pool
    return RowReader(
        store, table, block_size=B, shape_per_token=(L, K), dtype=np.uint8, output_pool=pool
    )


def _setup(rng: np.random.Generator, num_reqs: int, max_len: int, pool: OutputPool):
    """A store with random arena bytes, and ``num_reqs`` requests holding slots for rows
    ``emit_start .. token_end`` (some emit nothing this step)."""
    store = _store()
    table = RequestTable(ring_width=W, capacity=2)
    ids = [f"r{i}" for i in range(num_reqs)]
    rows = table.add_many(ids, [0] * num_reqs)
    emit_starts = rng.integers(0, 60, num_reqs)
    counts = rng.integers(1, max_len + 1, num_reqs)
    token_ends = emit_starts + counts
    _give_slots(store, table, rows, emit_starts // B, (token_ends - 1) // B)
    store.arena_np[:] = rng.integers(0, 256, store.arena_np.shape, dtype=np.uint8)
    reader = _reader(store, table, pool)
    # The commit's plan: about 70 % of the requests (at least one) return rows this step.
    direct = np.flatnonzero(rng.random(num_reqs) < 0.7)
    if direct.size == 0:
        direct = np.array([0])
    plan = CommitPlan(
        capture_starts=emit_starts.copy(),
        token_ends=token_ends,
        emit_starts=emit_starts,
        direct=direct.astype(np.int64),
        materialize=np.empty(0, np.int64),
        rows_written=int(counts.sum()),
    )
    qsl = np.concatenate(([0], np.cumsum(counts)))
    layout = StepLayout(ids, rows, emit_starts, qsl)
    return store, table, reader, layout, plan


def _expected(store, table, row, start: int, end: int) -> np.ndarray:
    """Rows ``start .. end`` of table row ``row``, looked up one position at a time."""
    arena = store.arena_np.view(np.uint8).reshape(-1, L, K)
    return np.stack(
        [arena[int(table.rings.ring[row, p // B % W]) * B + p % B] for p in range(start, end)]
    )


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("pooled", [False, True])
def test_emit_returns_each_requests_rows_on_every_path(seed, pooled):
    rng = np.random.default_rng(seed)
    # Pooled: every gather goes through the pool's buffers; else through numpy's take.
    pool = OutputPool(max_bytes=1 << 20, min_nbytes=1 if pooled else 1 << 20)
    num_reqs = int(rng.integers(1, 14))
    # Short emits (decode-like, often all equal) and long ones (over 64 rows in all).
    max_len = int(rng.choice([1, 3, 20]))
    store, table, reader, layout, plan = _setup(rng, num_reqs, max_len, pool)
    outputs = reader.emit(layout, plan)
    assert list(outputs) == [layout.request_ids[i] for i in plan.direct.tolist()]
    for i in plan.direct.tolist():
        out = outputs[layout.request_ids[i]]
        start, end = int(plan.emit_starts[i]), int(plan.token_ends[i])
        assert out.token_start == start
        assert out.rows.dtype == np.uint8 and out.rows.shape == (end - start, L, K)
        assert np.array_equal(out.rows, _expected(store, table, layout.rows[i], start, end))
        # The output owns its memory: the arena's slots are reused once blocks are evicted.
        assert not np.shares_memory(out.rows, store.arena_np)


def test_emit_without_emitting_requests_returns_nothing():
    rng = np.random.default_rng(0)
    pool = OutputPool(max_bytes=0)
    _, _, reader, layout, plan = _setup(rng, 3, 2, pool)
    plan.direct = np.empty(0, np.int64)
    assert reader.emit(layout, plan) == {}


def _hit(rng: np.random.Generator, stored_blocks: int, open_rows: int):
    """A request whose first ``stored_blocks`` blocks are in the store (bound to its keys,
    retained) and whose next rows (``open_rows`` of them) lie in its own unbound slots."""
    store = _store()
    table = RequestTable(ring_width=W)
    row = table.add("hit", 0)
    stored = store.allocate(stored_blocks)
    words = np.zeros((stored_blocks, KEY_WORDS), np.uint64)
    words[:, 1] = np.arange(1, stored_blocks + 1)
    keys = key_objects(words)
    store.arena_np[:] = rng.integers(0, 256, store.arena_np.shape, dtype=np.uint8)
    store.bind(keys, stored, retain_keys=keys)
    table.add_keys([row], keys, [stored_blocks])
    end = stored_blocks * B + open_rows
    if open_rows:
        _give_slots(store, table, [row], [stored_blocks], [(end - 1) // B])
    reader = _reader(store, table)
    arena = store.arena_np.view(np.uint8).reshape(-1, L, K)
    expected = [arena[int(stored[p // B]) * B + p % B] for p in range(stored_blocks * B)]
    if open_rows:
        expected += list(_expected(store, table, row, stored_blocks * B, end))
    return reader, row, np.stack(expected) if expected else None


@pytest.mark.parametrize(
    "stored_blocks, open_rows, emit_start",
    [
        (3, 2, 0),  # whole stored blocks, then the open block
        (3, 2, 8),  # from a block boundary inside the stored blocks
        (3, 2, 5),  # from inside a stored block
        (3, 3, 11),  # from the last stored row
        (1, 1, 3),
        (0, 3, 0),  # nothing stored: the open block only
        (2, 3, 9),  # from inside the open block
    ],
)
def test_materialize_reads_stored_blocks_then_the_open_block(stored_blocks, open_rows, emit_start):
    rng = np.random.default_rng(stored_blocks * 100 + emit_start)
    reader, row, expected = _hit(rng, stored_blocks, open_rows)
    token_end = stored_blocks * B + open_rows
    out = reader.materialize("hit", row, emit_start, token_end)
    assert out.shape == (token_end - emit_start, L, K)
    assert np.array_equal(out, expected[emit_start:])


def test_materialize_of_stored_blocks_only_needs_an_open_block():
    """As in vLLM: rows that end on a block boundary are in no buffer outside the store, and
    a range that ends there but starts past the stored blocks is unavailable."""
    rng = np.random.default_rng(1)
    reader, row, expected = _hit(rng, 2, 0)
    # Ending on the stored blocks' end: all from the store.
    assert np.array_equal(reader.materialize("hit", row, 1, 8), expected[1:8])
    assert np.array_equal(reader.materialize("hit", row, 4, 8), expected[4:8])
    with pytest.raises(AuxOutputProtocolError, match="buffer is missing request hit"):
        reader.materialize("hit", row, 8, 8)


def test_materialize_refuses_rows_before_the_open_block_that_are_not_stored():
    rng = np.random.default_rng(2)
    reader, row, _ = _hit(rng, 1, 6)  # rows 4..9 unbound: blocks 1 (open at 8..9) and 2
    message = r"range is unavailable: request=hit, range=\[4, 10\), available=\[8, 10\)"
    with pytest.raises(AuxOutputProtocolError, match=message):
        reader.materialize("hit", row, 0, 10)
    # An empty range, even inside the open block, as vLLM's read refuses one.
    message = r"range is unavailable: request=hit, range=\[9, 9\), available=\[8, 9\)"
    with pytest.raises(AuxOutputProtocolError, match=message):
        reader.materialize("hit", row, 9, 9)


@pytest.mark.parametrize("seed", range(20))
def test_place_staged_scatters_each_accepted_row_into_its_slot(seed):
    """Staging: the host copy holds the step's rows in step-row order; each request's
    accepted rows (``step_info``: start, accepted, status, slots taken) go to its ring slots,
    and a failed request's (status != 0) or a request without accepted rows' go nowhere."""
    rng = np.random.default_rng(seed)
    num_reqs = int(rng.integers(1, 8))
    store = _store()
    table = RequestTable(ring_width=W)
    rows = table.add_many([f"r{i}" for i in range(num_reqs)], [0] * num_reqs)
    scheduled = rng.integers(1, 9, num_reqs)
    starts = rng.integers(0, 40, num_reqs)
    taken = _give_slots(store, table, rows, starts // B, (starts + scheduled - 1) // B)
    qsl = np.concatenate(([0], np.cumsum(scheduled))).astype(np.int64)
    accepted = rng.integers(0, scheduled + 1)
    status = np.where(rng.random(num_reqs) < 0.25, 2, 0)
    # A failed request reports -1 accepted rows, as the kernel does.
    accepted = np.where(status == 0, accepted, -1)
    step_info = np.stack([starts, accepted, status, taken], axis=1).astype(np.int32)
    staged = rng.integers(0, 256, (int(qsl[-1]), L, K), dtype=np.uint8)
    before = store.arena_np.copy()
    _reader(store, table).place_staged(StepLayout([], rows, starts, qsl), step_info, staged)

    expected = before.view(np.uint8).reshape(-1, L, K).copy()
    for i in range(num_reqs):
        for j in range(max(int(accepted[i]), 0) if status[i] == 0 else 0):
            p = int(starts[i]) + j
            slot = int(table.rings.ring[rows[i], p // B % W])
            expected[slot * B + p % B] = staged[qsl[i] + j]
    assert np.array_equal(store.arena_np.view(np.uint8).reshape(-1, L, K), expected)


def test_materialize_reads_only_stored_blocks_before_the_rows_end():
    """Keys can run ahead of the rows (a prefix hit's whole prompt is hashed): stored blocks
    past ``token_end``'s block are not read; the open block comes from the request's slots."""
    rng = np.random.default_rng(3)
    reader, row, expected = _hit(rng, 3, 0)  # keys and stored rows for blocks 0..2
    table, store = reader._table, reader._store
    _give_slots(store, table, [row], [1], [1])  # block 1 open, own slot
    open_rows = _expected(store, table, row, 4, 6)
    assert not np.array_equal(open_rows, expected[4:6])  # tells the two apart
    for emit_start in (0, 2):
        out = reader.materialize("hit", row, emit_start, 6)
        assert np.array_equal(out, np.concatenate((expected[emit_start:4], open_rows)))
