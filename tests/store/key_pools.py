"""Key rows for store tests: pools of near-identical keys, and structured hashes."""

from __future__ import annotations

import numpy as np

from r3capture.store import key_rows


def similar_rows(count: int, seed: int, item_sizes: tuple[int, ...] = (32,)) -> np.ndarray:
    """``count`` distinct key rows that differ as little as keys can: one random hash, then
    copies that differ from it in one byte, in the generation (0 or 7) or in the hash length
    (a shorter hash equal to the longer one's prefix). Equal bytes in every other word make a
    key compared by anything less than all of its row collide."""
    rng = np.random.default_rng(seed)
    longest = max(item_sizes)
    base = rng.bytes(longest)
    candidates = []
    for size in item_sizes:
        for generation in (0, 7):
            candidates.append(key_rows(generation, base[:size], size))
            for position in rng.choice(size, size=min(size, count), replace=False).tolist():
                varied = bytearray(base[:size])
                varied[position] ^= 1 + int(rng.integers(255))
                candidates.append(key_rows(generation, bytes(varied), size))
    rows = np.unique(np.concatenate(candidates), axis=0)
    assert len(rows) >= count, "not enough distinct candidates"
    return rng.permutation(rows)[:count]


def structured_rows(count: int, item_size: int = 32, generation: int = 0) -> np.ndarray:
    """Hashes that are all zero but for a big-endian counter in their last bytes."""
    data = np.zeros((count, item_size), np.uint8)
    counter = np.arange(count)
    data[:, -1] = counter & 0xFF
    data[:, -2] = (counter >> 8) & 0xFF
    return key_rows(generation, data.tobytes(), item_size)
