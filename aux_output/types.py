"""Connector message types: scheduler -> worker metadata and worker -> scheduler outputs.

When vLLM 0.33.x is importable these are vLLM's own classes (so outputs cross vLLM's IPC
and reach its scheduler unchanged); otherwise they are field-for-field equivalents, which
keeps the core importable and testable without vLLM.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from r3capture.aux_output import compat

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


def block_keys(block_hashes: PackedBlockHashes | None, generation: int) -> list[str]:
    """Store keys ``vllm-artifact/{generation}/{hash.hex()}`` for each hash, in order."""
    if block_hashes is None:
        return []
    prefix = f"vllm-artifact/{generation}/"
    # One hex() for the whole buffer, then string slices: prefix hits carry thousands.
    text, width = block_hashes.data.hex(), 2 * block_hashes.item_size
    return [prefix + text[i : i + width] for i in range(0, len(text), width)]


def block_keys_of_requests(
    block_hashes: dict[str, PackedBlockHashes | None], generation: int
) -> tuple[list[str], list[int]]:
    """Every request's store keys, concatenated in the dict's order, and the count per request.

    One ``hex()`` over all requests' hashes: a speculative step completes blocks in dozens of
    requests, and a call per request cost more than the keys themselves.
    """
    datas = [b"" if h is None else h.data for h in block_hashes.values()]
    sizes = {h.item_size for h in block_hashes.values() if h is not None}
    if len(sizes) > 1:
        per_request = [block_keys(h, generation) for h in block_hashes.values()]
        return [key for keys in per_request for key in keys], [len(k) for k in per_request]
    item_size = sizes.pop() if sizes else 1
    keys = block_keys(PackedBlockHashes(b"".join(datas), item_size), generation)
    return keys, [len(data) // item_size for data in datas]


__all__ = [
    "AuxOutputConnectorMetadata",
    "AuxRequestOutput",
    "PackedBlockHashes",
    "block_keys",
    "block_keys_of_requests",
]
