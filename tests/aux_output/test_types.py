"""Store keys from scheduler metadata: the worker's keys must be vLLM's
``vllm-artifact/{gen}/{hash.hex()}``, as key rows."""

from __future__ import annotations

import os

import numpy as np
import pytest

from r3capture.aux_output.types import (
    PackedBlockHashes,
    key_objects_of_requests,
    key_rows_of,
    key_rows_of_requests,
)
from r3capture.store import KEY_WORDS, key_objects, key_rows_from_strings, key_string


def _hashes(n: int, item_size: int = 32) -> PackedBlockHashes:
    return PackedBlockHashes(os.urandom(n * item_size), item_size)


def strings(rows: np.ndarray) -> list[str]:
    return [key_string(row) for row in rows]


def _vllm_keys(packed: PackedBlockHashes | None, generation: int) -> list[str]:
    """vLLM's own construction: one string per hash."""
    if packed is None:
        return []
    return [f"vllm-artifact/{generation}/{h.hex()}" for h in packed]


def test_key_rows_are_vllms_keys():
    packed = PackedBlockHashes(bytes(range(8)), 4)
    rows = key_rows_of(packed, 3)
    assert strings(rows) == ["vllm-artifact/3/00010203", "vllm-artifact/3/04050607"]
    assert np.array_equal(rows, key_rows_from_strings(_vllm_keys(packed, 3)))
    assert key_rows_of(None, 0).shape == (0, KEY_WORDS)


@pytest.mark.parametrize("layout", [[3, 0, 1, 5], [0, 0], [1], [], [2, None, 4]])
def test_keys_of_requests_equal_per_request_keys_in_order(layout):
    hashes = [None if n is None else _hashes(n) for n in layout]
    rows, counts = key_rows_of_requests(hashes, 7)
    expected = [_vllm_keys(h, 7) for h in hashes]
    assert counts == [len(k) for k in expected]
    assert strings(rows) == [key for per_request in expected for key in per_request]


@pytest.mark.parametrize(
    "layout", [[3, 0, 1, 5], [0, 0], [1], [], [2, None, 4], [40], [20, 20], [None]]
)
def test_key_objects_of_requests_are_the_rows_objects(layout):
    hashes = [None if n is None else _hashes(n) for n in layout]
    keys, counts = key_objects_of_requests(hashes, 7)
    rows, row_counts = key_rows_of_requests(hashes, 7)
    assert keys == key_objects(rows) and counts == row_counts
    mixed = [_hashes(2, 32), None, _hashes(3, 16)]
    keys, counts = key_objects_of_requests(mixed, 1)
    rows, row_counts = key_rows_of_requests(mixed, 1)
    assert keys == key_objects(rows) and counts == row_counts == [2, 0, 3]


def test_keys_of_requests_with_mixed_hash_sizes():
    hashes = [_hashes(2, 32), _hashes(3, 16), _hashes(1, 32)]
    rows, counts = key_rows_of_requests(hashes, 1)
    assert counts == [2, 3, 1]
    assert strings(rows) == [k for h in hashes for k in _vllm_keys(h, 1)]
    # A 16-byte hash never equals a 32-byte one that starts with the same bytes.
    short = PackedBlockHashes(bytes(16), 16)
    long = PackedBlockHashes(bytes(32), 32)
    assert not np.array_equal(key_rows_of(short, 0), key_rows_of(long, 0))
