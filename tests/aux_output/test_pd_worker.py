"""P/D splice on the worker: decoders whose first capture starts anywhere in a block.

Random traces, one decode-leg request at a time: its prompt KV (rows ``0 .. F-1``) came from a
prefiller, so it captures from ``F`` on, which may be mid-block; the recompute of the prompt's
tail runs in chunks that sample nothing, then it decodes. Every row it returns is the routing
oracle's, from ``F``; its partial first block never reaches the store (nor any block before
it), its whole blocks do; a later request that hits them reads them back, and one that asks
for rows of the partial block fails closed.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_worker import B, hashes, key_of, make_worker, meta, routes, run_step

from r3capture.store import BlockObjectStoreError


def _decode_leg(worker, rng: random.Random, seed: int) -> tuple[int, int]:
    """Run one decode-leg request ``d{seed}`` to its end; returns ``(F, end)``."""
    request = f"d{seed}"
    prompt = rng.randrange(5, 21)
    first = rng.randrange(0, prompt)  # the prefiller's KV covers rows 0 .. first - 1
    end, emit, sent_blocks, returned = first, first, 0, []
    chunks = []
    while end + sum(chunks) < prompt:
        chunks.append(min(rng.randrange(1, 7), prompt - end - sum(chunks)))
    steps = [(count, i == len(chunks) - 1) for i, count in enumerate(chunks)]
    steps += [(1, True)] * rng.randrange(1, 9)  # decode
    for count, samples in steps:
        complete = (end + count) // B
        new_hashes = (
            {request: hashes(seed, range(sent_blocks, complete))} if complete > sent_blocks else {}
        )
        sent_blocks = max(sent_blocks, complete)
        out = run_step(
            worker, meta({request: emit}, new_hashes), [(request, seed, end, count)],
            sampled=[1 if samples else 0],
        )  # fmt: skip
        end += count
        if samples:
            assert out[request].token_start == emit
            returned.append(out[request].rows)
            emit = end
        else:
            assert request not in out
    rows = np.concatenate(returned)
    assert np.array_equal(rows, routes(seed, first, end - first).astype(np.uint8))
    worker.begin_step(meta({}, finished=[request]))
    return first, end


@pytest.mark.parametrize("seed", range(40))
def test_decoders_return_only_their_rows_and_publish_only_whole_blocks(seed):
    rng = random.Random(seed)
    worker = make_worker(partial_first_ok=True)
    for turn in range(3):
        trace_seed = 1 + (3 * seed + turn) % 250  # one byte of the hashes
        first, end = _decode_leg(worker, rng, trace_seed)
        whole = -(-first // B)  # the first block the decoder captured whole
        # A hit reads the decoder's whole blocks back; the partial one and those before it
        # were never published.
        for block in range(end // B):
            slot = worker.store.peek_slot(key_of(0, trace_seed, block))
            assert (slot is not None) == (block >= whole), (first, end, block)
        if whole < end // B:
            hit = f"h{trace_seed}"
            start = (end // B) * B
            out = run_step(
                worker, meta({hit: whole * B}, {hit: hashes(trace_seed, range(end // B))}),
                [(hit, 99, start, 2)],
            )  # fmt: skip
            expected = np.concatenate([routes(trace_seed, whole * B, start - whole * B),
                                       routes(99, start, 2)]).astype(np.uint8)  # fmt: skip
            assert out[hit].token_start == whole * B
            assert np.array_equal(out[hit].rows, expected)
            worker.begin_step(meta({}, finished=[hit]))
        if first % B and whole < end // B:
            # Rows of the partial block exist nowhere here: a read of them fails closed.
            ask = f"p{trace_seed}"
            with pytest.raises(BlockObjectStoreError):
                asked = meta({ask: first // B * B}, {ask: hashes(trace_seed, range(end // B))})
                run_step(worker, asked, [(ask, 98, (end // B) * B, 1)])
            return  # the failed step leaves the worker as vLLM's would: start afresh
    assert worker._book.table.rings.num_partial == 0
    worker.close()
