"""Connector message types: scheduler -> worker metadata and worker -> scheduler outputs.

When vLLM 0.33.x is importable these are vLLM's own classes (so outputs cross vLLM's IPC
and reach its scheduler unchanged); otherwise they are field-for-field equivalents, which
keeps the core importable and testable without vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from r3capture.aux_output import compat
from r3capture.store import (
    KEY_WORDS,
    NO_KEY_OBJECTS,
    KeyObjects,
    join_key_objects,
    key_objects_of_hashes,
    key_rows,
)

if compat.vllm_connector_module() is not None:
    _connector = compat.vllm_connector_module()
    PackedBlockHashes = _connector.PackedBlockHashes
    AuxOutputConnectorMetadata = _connector.AuxOutputConnectorMetadata
    AuxRequestOutput = _connector.AuxRequestOutput
else:

    @dataclass
    class PackedBlockHashes:  # type: ignore[no-redef]
        """Block hashes of one request, concatenated: ``data`` holds n * ``item_size`` bytes."""

        data: bytes
        item_size: int

        def __iter__(self) -> Iterator[bytes]:
            step = self.item_size
            return (self.data[i : i + step] for i in range(0, len(self.data), step))

    @dataclass
    class AuxOutputConnectorMetadata:  # type: ignore[no-redef]
        """One scheduler step's update for the worker.

        ``requests``: scheduled request id -> emit_start (first token row to return);
        ``block_hashes``: request id -> hashes of hash blocks newly computed since the last update;
        ``finished_requests``: terminal events; ``retained/released_block_hashes``: store pins
        the scheduler adds or drops for blocks still cached on the GPU.
        """

        generation: int
        requests: dict[str, int]
        block_hashes: dict[str, PackedBlockHashes]
        finished_requests: tuple[str, ...]
        retained_block_hashes: PackedBlockHashes | None = None
        released_block_hashes: PackedBlockHashes | None = None

    @dataclass
    class AuxRequestOutput:  # type: ignore[no-redef]
        """Rows ``[n, L, K]`` (uint8/uint16) of positions ``token_start .. token_start + n``."""

        token_start: int
        rows: np.ndarray


_NO_KEY_ROWS = np.empty((0, KEY_WORDS), np.uint64)
_NO_KEY_ROWS.flags.writeable = False


def key_rows_of(block_hashes: PackedBlockHashes | None, generation: int) -> np.ndarray:
    """Store key rows (``uint64 [n, KEY_WORDS]``) of vLLM's keys
    ``vllm-artifact/{generation}/{hash.hex()}``, one per hash, in order."""
    if block_hashes is None or not block_hashes.data:
        return _NO_KEY_ROWS
    return key_rows(generation, block_hashes.data, block_hashes.item_size)


def key_objects_of(block_hashes: PackedBlockHashes | None, generation: int) -> KeyObjects:
    """``key_objects(key_rows_of(block_hashes, generation))``."""
    if block_hashes is None or not block_hashes.data:
        return NO_KEY_OBJECTS
    return key_objects_of_hashes(generation, block_hashes.data, block_hashes.item_size)


def key_objects_of_requests(
    block_hashes: Iterable[PackedBlockHashes | None], generation: int
) -> tuple[KeyObjects, list[int]]:
    """Every request's key objects, concatenated in order, and the count per request: one
    conversion over all requests' hashes (``key_rows_of_requests`` for key objects)."""
    packed = list(block_hashes)
    if len(packed) == 1 and packed[0] is not None:
        keys = key_objects_of(packed[0], generation)
        return keys, [len(keys)]
    sizes = {h.item_size for h in packed if h is not None}
    if len(sizes) > 1:
        parts = [key_objects_of(h, generation) for h in packed]
        return join_key_objects(parts), [len(part) for part in parts]
    size = sizes.pop() if sizes else 32
    data = [b"" if h is None else h.data for h in packed]
    return key_objects_of_hashes(generation, b"".join(data), size), [len(d) // size for d in data]


def key_rows_of_requests(
    block_hashes: Iterable[PackedBlockHashes | None], generation: int
) -> tuple[np.ndarray, list[int]]:
    """Every request's key rows, concatenated in order, and the count per request.

    One conversion over all requests' hashes: a speculative step completes blocks in dozens
    of requests, and a call per request cost more than the keys themselves.
    """
    packed = [h for h in block_hashes]
    sizes = {h.item_size for h in packed if h is not None}
    if len(sizes) > 1:
        parts = [key_rows_of(h, generation) for h in packed]
        return np.concatenate(parts), [len(part) for part in parts]
    size = sizes.pop() if sizes else 32
    data = [b"" if h is None else h.data for h in packed]
    return key_rows(generation, b"".join(data), size), [len(d) // size for d in data]


__all__ = [
    "AuxOutputConnectorMetadata",
    "AuxRequestOutput",
    "PackedBlockHashes",
    "key_objects_of",
    "key_objects_of_requests",
    "key_rows_of",
    "key_rows_of_requests",
]
