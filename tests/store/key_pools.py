"""Key rows for store tests: pools that collide in the index, and structured hashes."""

from __future__ import annotations

import numpy as np

from r3capture.store import key_rows
from r3capture.store.key_index import bucket_hash

HOME_BITS = 8  # keys sharing the top 8 hash bits share a home in every table of <= 256 buckets


def colliding_rows(count: int, seed: int, item_sizes: tuple[int, ...] = (32,)) -> np.ndarray:
    """``count`` distinct key rows (hashes of the given sizes, generations 0 and 7) whose
    hashes agree in the top ``HOME_BITS`` bits: they all home at one bucket of any small
    table, so the index probes, records reaches and rebuilds on every few operations."""
    rng = np.random.default_rng(seed)
    per = 300 * count
    candidates = np.concatenate(
        [key_rows(g, rng.bytes(size * per), size) for size in item_sizes for g in (0, 7)]
    )
    tops = (bucket_hash(candidates) >> np.uint64(64 - HOME_BITS)).astype(np.int64)
    chosen = candidates[tops == np.bincount(tops).argmax()][:count]
    assert len(chosen) == count, "not enough candidates share a home"
    return rng.permutation(chosen)


def structured_rows(count: int, item_size: int = 32, generation: int = 0) -> np.ndarray:
    """Hashes that are all zero but for a big-endian counter in their last bytes."""
    data = np.zeros((count, item_size), np.uint8)
    counter = np.arange(count)
    data[:, -1] = counter & 0xFF
    data[:, -2] = (counter >> 8) & 0xFF
    return key_rows(generation, data.tobytes(), item_size)
