"""Key rows: layout, round trips with vLLM's key strings, and rejected input."""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3capture.store import KEY_WORDS, as_key_rows, key_rows, key_rows_from_strings, key_string
from r3capture.store.keys import (
    MAX_GENERATION,
    KeyObjects,
    as_key_objects,
    join_key_objects,
    key_objects,
    key_objects_of_hashes,
    key_strings,
    rows_of_key_objects,
)


def vllm_key(generation: int, digest: bytes) -> str:
    """vLLM 0.33.0's key for a block hash (``f"vllm-artifact/{generation}/{hash.hex()}"``)."""
    return f"vllm-artifact/{generation}/{digest.hex()}"


def expected_row(generation: int, digest: bytes) -> list[int]:
    """The documented layout, built with struct: word 0 = generation << 8 | len, then the
    hash zero-padded to 32 bytes as four little-endian words."""
    words = struct.unpack("<4Q", digest.ljust(32, b"\0"))
    return [generation << 8 | len(digest), *words]


@pytest.mark.parametrize("item_size", [1, 7, 16, 31, 32], ids=lambda s: f"{s}B")
@pytest.mark.parametrize("generation", [0, 1, 10, 123456789, MAX_GENERATION], ids=str)
def test_layout_and_round_trip(item_size, generation):
    rng = np.random.default_rng(item_size * 1000 + generation % 997)
    digests = [rng.bytes(item_size) for _ in range(5)]
    rows = key_rows(generation, b"".join(digests), item_size)
    assert rows.dtype == np.uint64 and rows.shape == (5, KEY_WORDS) and rows.flags.c_contiguous
    assert rows.tolist() == [expected_row(generation, d) for d in digests]
    strings = [vllm_key(generation, d) for d in digests]
    assert key_strings(rows) == strings
    assert [key_string(row) for row in rows] == strings
    parsed = key_rows_from_strings(strings)
    assert parsed.dtype == np.uint64 and parsed.flags.c_contiguous
    np.testing.assert_array_equal(parsed, rows)


@pytest.mark.parametrize("item_size", [1, 7, 16, 31, 32], ids=lambda s: f"{s}B")
@pytest.mark.parametrize("count", [1, 2, 32, 33, 70, 600])
def test_key_objects_straight_from_hashes_are_the_rows_objects(item_size, count):
    """Straight from the hashes, the objects ``key_objects`` makes of the same hashes' rows,
    with the documented layout."""
    rng = np.random.default_rng(item_size * 100 + count)
    for generation in (0, 5, MAX_GENERATION):
        data = rng.bytes(item_size * count)
        made = key_objects_of_hashes(generation, data, item_size)
        assert type(made) is KeyObjects
        assert made == key_objects(key_rows(generation, data, item_size))
        digests = [data[i : i + item_size] for i in range(0, len(data), item_size)]
        assert [struct.unpack("<5Q", key) for key in made] == [
            tuple(expected_row(generation, d)) for d in digests
        ]


@pytest.mark.parametrize("item_size", [0, 33])
def test_key_objects_from_hashes_refuse_what_key_rows_refuses(item_size):
    with pytest.raises(ValueError, match=f"block hash of {item_size} bytes"):
        key_objects_of_hashes(0, bytes(66), item_size)
    with pytest.raises(ValueError, match="generation must be in 0"):
        key_objects_of_hashes(-1, bytes(16), 16)
    with pytest.raises(ValueError, match="not a whole number of 16-byte hashes"):
        key_objects_of_hashes(0, bytes(40), 16)


def test_a_short_hash_is_not_a_longer_one_ending_in_zeros():
    short = key_rows(0, b"\x01", 1)
    longer = key_rows(0, b"\x01\x00", 2)
    assert not np.array_equal(short, longer)
    assert key_string(short[0]) == "vllm-artifact/0/01"
    assert key_string(longer[0]) == "vllm-artifact/0/0100"


def test_empty_inputs():
    assert key_rows(3, b"", 32).shape == (0, KEY_WORDS)
    assert key_rows_from_strings([]).shape == (0, KEY_WORDS)
    assert as_key_rows(()).shape == (0, KEY_WORDS)


def test_mixed_generations_and_lengths_parse_key_by_key():
    digests = [b"\xab", b"\x01\x02", bytes(32), b"\xff" * 16]
    keys = [vllm_key(g, d) for g, d in zip([9, 10, 0, MAX_GENERATION], digests)]
    # Same length as a neighbour, different generation: the batch path must not merge them.
    keys += [vllm_key(10, b"\xcd"), vllm_key(MAX_GENERATION, b"\xcd")]
    digests += [b"\xcd", b"\xcd"]
    expected = [expected_row(int(k.split("/")[1]), d) for k, d in zip(keys, digests)]
    assert key_rows_from_strings(keys).tolist() == expected
    assert key_strings(key_rows_from_strings(keys)) == keys


@settings(max_examples=200, deadline=None)
@given(
    data=st.lists(
        st.tuples(st.integers(0, 2**20), st.binary(min_size=1, max_size=32)), max_size=12
    ),
    uniform=st.booleans(),
)
def test_strings_round_trip(data, uniform):
    if uniform and data:  # one generation and one hash length: the all-at-once path
        generation, first = data[0]
        data = [(generation, digest.ljust(len(first), b"\0")[: len(first)]) for _, digest in data]
    keys = [vllm_key(g, d) for g, d in data]
    rows = key_rows_from_strings(keys)
    assert rows.tolist() == [expected_row(g, d) for g, d in data]
    assert key_strings(rows) == keys
    assert as_key_rows(iter(keys)).tolist() == rows.tolist()


def test_as_key_rows_passes_arrays_through():
    rows = key_rows(1, bytes(range(64)), 32)
    assert as_key_rows(rows) is rows
    strided = np.zeros((2, 2 * KEY_WORDS), np.uint64)[:, ::2]
    copied = as_key_rows(strided)
    assert copied.flags.c_contiguous and copied.shape == (2, KEY_WORDS)


@pytest.mark.parametrize(
    "key",
    [
        "a",
        "vllm-artifact/0/",
        "vllm-artifact/0/abc",  # odd number of hex digits
        "vllm-artifact/0/AB",  # vLLM writes lowercase
        "vllm-artifact/01/ab",  # not vLLM's decimal form
        "vllm-artifact/-1/ab",
        "vllm-artifact//ab",
        "vllm-artifact/0/ab cd",
        "vllm-artifact/0/ab/cd",
        "vllm_artifact/0/ab",
        " vllm-artifact/0/ab",
        "vllm-artifact/0/" + "00" * 33,  # 33-byte hash
        f"vllm-artifact/{MAX_GENERATION + 1}/ab",
        "vllm-artifact/0/é0",
        b"vllm-artifact/0/ab",
        None,
    ],
    ids=[
        "letter",
        "empty-hash",
        "odd-hex",
        "uppercase",
        "leading-zero",
        "negative-gen",
        "no-gen",
        "space",
        "extra-slash",
        "prefix",
        "leading-space",
        "33-bytes",
        "huge-gen",
        "non-ascii",
        "bytes",
        "none",
    ],
)
def test_malformed_key_strings_are_named(key):
    good = [vllm_key(0, b"\xab"), vllm_key(0, b"\xcd")]
    for batch in ([key], good + [key], [good[0], key, good[1]]):
        with pytest.raises(ValueError, match=re.escape(repr(key))):
            key_rows_from_strings(batch)
    with pytest.raises(ValueError, match=r"^release_keys: .*not a store key"):
        as_key_rows(good + [key], name="release_keys")


@pytest.mark.parametrize("item_size", [0, 33, -1, 64], ids=str)
def test_bad_item_size(item_size):
    with pytest.raises(
        ValueError,
        match=f"block hash of {item_size} bytes; r3capture supports hashes of up to 32 bytes",
    ):
        key_rows(0, bytes(64), item_size)


def test_bad_key_rows_arguments():
    with pytest.raises(ValueError, match="not a whole number of 16-byte hashes"):
        key_rows(0, bytes(40), 16)
    with pytest.raises(ValueError, match="generation must be in 0"):
        key_rows(-1, bytes(16), 16)
    with pytest.raises(ValueError, match="generation must be in 0"):
        key_rows(MAX_GENERATION + 1, bytes(16), 16)
    for generation in (True, 1.0, "1", None):
        with pytest.raises(TypeError, match="generation must be an int"):
            key_rows(generation, bytes(16), 16)
    with pytest.raises(TypeError, match="item_size must be an int"):
        key_rows(0, bytes(16), 16.0)


@pytest.mark.parametrize(
    "array",
    [
        np.zeros((2, KEY_WORDS), np.int64),
        np.zeros((2, KEY_WORDS - 1), np.uint64),
        np.zeros(KEY_WORDS, np.uint64),
        np.zeros((1, 2, KEY_WORDS), np.uint64),
    ],
    ids=["int64", "four-words", "1-D", "3-D"],
)
def test_as_key_rows_rejects_other_arrays(array):
    with pytest.raises(ValueError, match=r"retain_keys: expected key rows uint64 \[n, 5\]"):
        as_key_rows(array, name="retain_keys")


def test_as_key_rows_rejects_a_single_string():
    with pytest.raises(TypeError, match="got one string"):
        as_key_rows(vllm_key(0, b"\xab"))


def test_key_string_rejects_non_rows():
    with pytest.raises(ValueError, match="expected uint64"):
        key_string(np.zeros(4, np.uint64))
    with pytest.raises(ValueError, match="item_size 0"):
        key_string(np.zeros(KEY_WORDS, np.uint64))


def test_key_objects_round_trip_and_pass_through():
    rows = key_rows(7, bytes(range(64)), 32)
    objects = key_objects(rows)
    assert [len(key) for key in objects] == [KEY_WORDS * 8] * 2
    assert rows_of_key_objects(objects).tolist() == rows.tolist()
    assert as_key_objects(objects) is objects  # kept objects reach the store as they are
    assert as_key_objects(rows) == objects  # rows and strings become equal objects
    assert as_key_objects([key_string(row) for row in rows]) == objects
    joined = join_key_objects([objects[1:], reversed(objects)])
    assert type(joined) is KeyObjects and [id(k) for k in joined] == [
        id(objects[1]),
        id(objects[1]),
        id(objects[0]),
    ]
    assert as_key_objects(()) == () and len(rows_of_key_objects(())) == 0


def test_loose_bytes_are_not_key_objects():
    """Only ``key_objects`` makes keys the store takes unchecked; bytes in a plain list are
    refused with the argument's name, not taken for keys."""
    loose = list(key_objects(key_rows(0, b"\xab" * 32, 32)))
    with pytest.raises(TypeError, match="release_keys: bytes keys must come as KeyObjects"):
        as_key_objects(loose, name="release_keys")
