"""Store keys as rows of five ``uint64`` words.

vLLM names a block's auxiliary output ``vllm-artifact/{generation}/{hash.hex()}``. The store
keeps the same information as one *key row* of ``KEY_WORDS = 5`` little-endian ``uint64`` words::

    word 0       generation << 8 | item_size      item_size = hash length in bytes, 1..32
    words 1..4   the hash bytes, zero-padded to 32 bytes

A batch of keys is a C-contiguous ``uint64 [n, KEY_WORDS]`` array. Two keys are the same key
exactly when their rows are equal (word 0 tells a short hash from a longer one that ends in zero
bytes). ``key_rows`` builds rows from a buffer of packed hashes without per-key Python;
``key_rows_from_strings`` and ``key_string`` convert from and to vLLM's string form (the
vLLM-compatible API, error messages and introspection).

Inside the store a key is one immutable 40-byte ``bytes`` object, its row's bytes, so the
tables are plain dicts. ``KeyObjects`` is a batch of them, made only by ``key_objects`` from
rows. A caller that keeps one batch's objects and hands the same objects back later (the worker
keeps each request's keys from the step their hashes arrive to the request's release) saves the
store a new object per key per call, and lets its dict lookups match by identity and a cached
hash instead of comparing 40 bytes in memory the call has not touched (``bench.run host_step``,
the full-store family). ``as_key_objects`` is the one conversion every public store method
applies to the keys it is given: key objects pass through, rows and strings are converted.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Sequence
from itertools import chain

import numpy as np

KEY_WORDS = 5
MAX_HASH_BYTES = 32
# Word 0 holds the generation above the 8 bits of item_size.
MAX_GENERATION = (1 << 56) - 1

_ROW_BYTES = KEY_WORDS * 8
_WORD = np.dtype("<u8")
_KEY_OBJECT = np.dtype((np.void, _ROW_BYTES))
_PREFIX = "vllm-artifact/"
_NO_ROWS = np.zeros((0, KEY_WORDS), dtype=_WORD)
_NO_ROWS.flags.writeable = False
# Canonical form only (no leading zeros, lowercase hex), so that key_string(parse(s)) == s.
# The hex digits' count must also be even (checked apart: a repeated pair group is 5x slower).
_KEY_RE = re.compile(r"vllm-artifact/(0|[1-9][0-9]{0,16})/([0-9a-f]{2,64})")
# ASCII byte -> hex digit value; 255 for anything that is not a lowercase hex digit.
_HEX_VALUE = np.full(256, 255, dtype=np.uint8)
_HEX_VALUE[np.frombuffer(b"0123456789abcdef", np.uint8)] = np.arange(16, dtype=np.uint8)

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("r3capture's key rows assume a little-endian host")


def _check_item_size(item_size: object) -> int:
    if isinstance(item_size, bool) or not isinstance(item_size, (int, np.integer)):
        raise TypeError(f"item_size must be an int, got {type(item_size).__name__}")
    if not 1 <= item_size <= MAX_HASH_BYTES:
        raise ValueError(
            f"block hash of {item_size} bytes; r3capture supports hashes of up to "
            f"{MAX_HASH_BYTES} bytes"
        )
    return int(item_size)


def _check_generation(generation: object) -> int:
    if isinstance(generation, bool) or not isinstance(generation, (int, np.integer)):
        raise TypeError(f"generation must be an int, got {type(generation).__name__}")
    if not 0 <= generation <= MAX_GENERATION:
        raise ValueError(f"generation must be in 0..{MAX_GENERATION}, got {generation}")
    return int(generation)


def key_rows(generation: int, data: bytes, item_size: int) -> np.ndarray:
    """Key rows ``uint64 [len(data) // item_size, KEY_WORDS]`` of the concatenated hashes in
    ``data`` (each ``item_size`` bytes), all of one ``generation``."""
    generation = _check_generation(generation)
    item_size = _check_item_size(item_size)
    hashes = np.frombuffer(data, dtype=np.uint8)
    if hashes.size % item_size:
        raise ValueError(
            f"data: {hashes.size} bytes is not a whole number of {item_size}-byte hashes"
        )
    n = hashes.size // item_size
    buffer = np.zeros((n, _ROW_BYTES), dtype=np.uint8)
    buffer[:, 8 : 8 + item_size] = hashes.reshape(n, item_size)
    rows = buffer.view(_WORD)
    rows[:, 0] = generation << 8 | item_size
    return rows


def key_string(row: np.ndarray) -> str:
    """vLLM's string form ``vllm-artifact/{generation}/{hash.hex()}`` of one key row."""
    words = np.asarray(row)
    if words.dtype != _WORD or words.shape != (KEY_WORDS,):
        raise ValueError(f"key row: expected uint64 [{KEY_WORDS}], got {words.dtype} {words.shape}")
    head = int(words[0])
    item_size = head & 0xFF
    if not 1 <= item_size <= MAX_HASH_BYTES:
        raise ValueError(f"key row {words.tolist()}: word 0 holds item_size {item_size}")
    return f"{_PREFIX}{head >> 8}/{words[1:].tobytes()[:item_size].hex()}"


def key_strings(rows: np.ndarray) -> list[str]:
    """``key_string`` of every row of ``uint64 [n, KEY_WORDS]`` (introspection)."""
    return [key_string(row) for row in rows]


def key_rows_from_strings(keys: Sequence[str]) -> np.ndarray:
    """Parse vLLM's key strings into key rows ``uint64 [len(keys), KEY_WORDS]``.

    Raises ``ValueError`` naming the first key that is not exactly
    ``vllm-artifact/{generation}/{hash.hex()}`` with a hash of 1 to 32 bytes.
    """
    keys = keys if isinstance(keys, (list, tuple)) else list(keys)
    if not keys:
        return np.zeros((0, KEY_WORDS), dtype=_WORD)
    rows = _parse_uniform(keys)
    return rows if rows is not None else _parse_each(keys)


def as_key_rows(keys: np.ndarray | Iterable[str], name: str = "keys") -> np.ndarray:
    """``keys`` as C-contiguous key rows: a ``uint64 [n, KEY_WORDS]`` array passes through,
    an iterable of vLLM key strings is parsed."""
    if isinstance(keys, np.ndarray):
        if keys.ndim != 2 or keys.shape[1] != KEY_WORDS or keys.dtype != _WORD:
            raise ValueError(
                f"{name}: expected key rows uint64 [n, {KEY_WORDS}], got {keys.dtype} "
                f"{list(keys.shape)}"
            )
        return keys if keys.flags.c_contiguous else np.ascontiguousarray(keys)
    if isinstance(keys, (str, bytes)):
        raise TypeError(f"{name}: expected key rows or a sequence of key strings, got one string")
    if keys == ():
        return _NO_ROWS  # the default of every retain_keys / release_keys argument
    try:
        return key_rows_from_strings(keys)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None


class KeyObjects(tuple):
    """A batch of store keys, one 40-byte ``bytes`` per key row (the row's little-endian
    words). Made by ``key_objects``, or from the items of other ``KeyObjects`` (a slice,
    ``join_key_objects``), so the store takes its items without checking each one again."""

    __slots__ = ()


NO_KEY_OBJECTS = KeyObjects()


def key_objects(rows: np.ndarray) -> KeyObjects:
    """The key objects of key rows ``uint64 [n, KEY_WORDS]``, made in C."""
    return _objects_of(as_key_rows(rows, name="rows"))


def _objects_of(rows: np.ndarray) -> KeyObjects:
    """``key_objects`` of rows ``as_key_rows`` returned."""
    if not len(rows):
        return NO_KEY_OBJECTS
    return KeyObjects(rows.view(_KEY_OBJECT).reshape(-1).tolist())


def key_objects_of_hashes(generation: int, data: bytes, item_size: int) -> KeyObjects:
    """``key_objects(key_rows(generation, data, item_size))``: the key objects of the
    concatenated hashes in ``data``, in order.

    One bytes concatenation per key. Key work runs once a step on a cold cache, where this
    beats the rows' dozen numpy calls (up to a few hundred hashes, several times over) and
    a split and join through ``struct`` (a decode step's one or two hashes); the numpy rows
    win only warm, beyond a few hundred hashes, on steps that take milliseconds."""
    generation = _check_generation(generation)
    item_size = _check_item_size(item_size)
    if len(data) % item_size:
        raise ValueError(
            f"data: {len(data)} bytes is not a whole number of {item_size}-byte hashes"
        )
    if not data:
        return NO_KEY_OBJECTS
    head = (generation << 8 | item_size).to_bytes(8, "little")
    if item_size == MAX_HASH_BYTES:
        return KeyObjects([head + data[i : i + item_size] for i in range(0, len(data), item_size)])
    pad = bytes(MAX_HASH_BYTES - item_size)
    return KeyObjects(
        [head + data[i : i + item_size] + pad for i in range(0, len(data), item_size)]
    )


def join_key_objects(parts: Iterable[Sequence[bytes]]) -> KeyObjects:
    """Key objects (each part a ``KeyObjects`` or a slice of one) concatenated in order, the
    same objects."""
    return KeyObjects(chain.from_iterable(parts))


def rows_of_key_objects(keys: Sequence[bytes]) -> np.ndarray:
    """The inverse of ``key_objects``: ``uint64 [len(keys), KEY_WORDS]`` (read-only)."""
    if not len(keys):
        return _NO_ROWS
    return np.frombuffer(b"".join(keys), dtype=_WORD).reshape(len(keys), KEY_WORDS)


def key_object_string(key: bytes) -> str:
    """vLLM's string form of one key object."""
    return key_string(rows_of_key_objects([key])[0])


def as_key_objects(keys: KeyObjects | np.ndarray | Iterable[str], name: str = "keys") -> KeyObjects:
    """``keys`` as key objects: ``KeyObjects`` pass through, key rows and vLLM key strings
    are converted. Anything else raises naming ``name``: ``TypeError`` for bytes that did
    not come from ``key_objects``, ``ValueError`` for malformed rows or strings."""
    if type(keys) is KeyObjects:
        return keys
    if isinstance(keys, (list, tuple)) and keys and isinstance(keys[0], bytes):
        raise TypeError(
            f"{name}: bytes keys must come as KeyObjects (from key_objects), got "
            f"{type(keys).__name__}"
        )
    return _objects_of(as_key_rows(keys, name))


def _bad_key(key: object) -> ValueError:
    return ValueError(
        f"{key!r} is not a store key 'vllm-artifact/{{generation}}/{{hash hex}}' with a hash "
        f"of 1 to {MAX_HASH_BYTES} bytes"
    )


def _parse_each(keys: Sequence[str]) -> np.ndarray:
    """One regular-expression match per key: any mix of generations and hash lengths."""
    packed = []
    for key in keys:
        match = _KEY_RE.fullmatch(key) if isinstance(key, str) else None
        if match is None or len(match[2]) % 2 or int(match[1]) > MAX_GENERATION:
            raise _bad_key(key)
        digest = bytes.fromhex(match[2])
        head = int(match[1]) << 8 | len(digest)
        packed.append(head.to_bytes(8, "little") + digest.ljust(MAX_HASH_BYTES, b"\0"))
    return np.frombuffer(b"".join(packed), dtype=_WORD).reshape(len(keys), KEY_WORDS).copy()


def _parse_uniform(keys: Sequence[str]) -> np.ndarray | None:
    """All keys at once when they share the first key's ``vllm-artifact/{generation}/`` and
    its length (one generation, one hash length: the usual batch); None when they do not or
    when any key is malformed (the caller then parses key by key)."""
    first = keys[0]
    match = _KEY_RE.fullmatch(first) if isinstance(first, str) else None
    if match is None or len(match[2]) % 2 or int(match[1]) > MAX_GENERATION:
        return None
    width, start = len(first), match.start(2)
    try:
        text = "".join(keys).encode("ascii")
    except (TypeError, UnicodeEncodeError):
        return None
    n = len(keys)
    if len(text) != width * n:
        return None
    chars = np.frombuffer(text, dtype=np.uint8).reshape(n, width)
    # Every row starts with the first key's prefix, and the prefix's 'v' can only start a
    # key: so the rows are the keys, whatever their individual lengths were.
    if chars[:, :start].tobytes() != first[:start].encode("ascii") * n:
        return None
    hexdigits = chars[:, start:].tobytes()
    if hexdigits.translate(None, b"0123456789abcdef"):
        return None  # uppercase, whitespace or another character
    item_size = (width - start) // 2
    buffer = np.zeros((n, _ROW_BYTES), dtype=np.uint8)
    buffer[:, 8 : 8 + item_size] = np.frombuffer(
        bytes.fromhex(hexdigits.decode("ascii")), dtype=np.uint8
    ).reshape(n, item_size)
    rows = buffer.view(_WORD)
    rows[:, 0] = int(match[1]) << 8 | item_size
    return rows
