"""Store-key construction: the worker's keys must be vLLM's ``vllm-artifact/{gen}/{hex}``."""

from __future__ import annotations

import os

import pytest

from r3capture.aux_output.types import PackedBlockHashes, block_keys, block_keys_of_requests


def _hashes(n: int, item_size: int = 32) -> PackedBlockHashes:
    return PackedBlockHashes(os.urandom(n * item_size), item_size)


def test_block_keys_format():
    packed = PackedBlockHashes(bytes(range(8)), 4)
    assert block_keys(packed, 3) == ["vllm-artifact/3/00010203", "vllm-artifact/3/04050607"]
    assert block_keys(None, 0) == []


@pytest.mark.parametrize(
    "layout",
    [
        [3, 0, 1, 5],
        [0, 0],
        [1],
        [],
        [2, None, 4],
    ],
)
def test_keys_of_requests_equal_per_request_keys_in_order(layout):
    hashes = {f"r{i}": None if n is None else _hashes(n) for i, n in enumerate(layout)}
    keys, counts = block_keys_of_requests(hashes, 7)
    expected = [block_keys(h, 7) for h in hashes.values()]
    assert counts == [len(k) for k in expected]
    assert keys == [key for per_request in expected for key in per_request]


def test_keys_of_requests_with_mixed_hash_sizes():
    hashes = {"a": _hashes(2, 32), "b": _hashes(3, 8), "c": _hashes(1, 32)}
    keys, counts = block_keys_of_requests(hashes, 1)
    assert counts == [2, 3, 1]
    assert keys == [k for h in hashes.values() for k in block_keys(h, 1)]
    assert len(keys[2]) == len("vllm-artifact/1/") + 16
