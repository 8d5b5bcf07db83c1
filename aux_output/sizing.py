"""What a worker connector is sized from: one type for the factory, the simulator and the benches.

vLLM derives these numbers from its config (``factory.worker_sizing``); the simulator and the
benchmarks build them directly. Every field is validated here, once, with a message that names
it, so the worker never meets a float, a bool or a non-positive size.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

ROW_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16))


def require_int(name: str, value: object, *, minimum: int = 1) -> int:
    """``value`` as an ``int`` when it is an integer (not a bool) ``>= minimum``; else a named
    error."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def row_nbytes(shape_per_token: tuple[int, int], dtype: np.dtype) -> int:
    """Bytes of one token's row ``[L, K]`` of ``dtype``."""
    return shape_per_token[0] * shape_per_token[1] * np.dtype(dtype).itemsize


def row_dtype(num_experts: int) -> np.dtype:
    """vLLM's output dtype for routed-expert ids: uint8 up to 256 experts, else uint16."""
    num_experts = require_int("num_experts", num_experts)
    return np.dtype(np.uint8 if num_experts <= 256 else np.uint16)


@dataclass(frozen=True)
class WorkerSizing:
    """Sizes of one worker connector.

    Attributes:
        shape_per_token: ``(L, K)``: hidden layers (dense ones stay 0) and top-k.
        dtype: row dtype, ``uint8`` (<= 256 experts) or ``uint16``.
        hash_block_size: tokens per hash block ``B`` (one store object per block).
        max_num_seqs, max_num_batched_tokens, max_concurrent_batches: scheduler limits.
        max_bytes: initial store capacity for published blocks.
    """

    shape_per_token: tuple[int, int]
    dtype: np.dtype
    hash_block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_concurrent_batches: int
    max_bytes: int

    def __post_init__(self) -> None:
        shape = self.shape_per_token
        if not isinstance(shape, (tuple, list)) or len(shape) != 2:
            raise ValueError(f"shape_per_token must be (L, K), got {shape!r}")
        shape = (require_int("shape_per_token[0] (L)", shape[0]),
                 require_int("shape_per_token[1] (K)", shape[1]))  # fmt: skip
        object.__setattr__(self, "shape_per_token", shape)
        try:
            # np.dtype(None) is float64: a missing dtype must not slip through as a float.
            dtype = np.dtype(self.dtype) if self.dtype is not None else None
        except TypeError:
            dtype = None
        if dtype is None:
            raise TypeError(f"dtype must be uint8 or uint16, got {self.dtype!r}")
        if dtype not in ROW_DTYPES:
            raise ValueError(f"dtype must be uint8 or uint16, got {dtype}")
        object.__setattr__(self, "dtype", dtype)
        for name in (
            "hash_block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_concurrent_batches",
            "max_bytes",
        ):
            object.__setattr__(self, name, require_int(name, getattr(self, name)))
        if self.max_bytes < self.block_nbytes:
            raise ValueError(
                f"max_bytes must hold at least one block of {self.block_nbytes} bytes "
                f"(hash_block_size x L x K x itemsize), got {self.max_bytes}"
            )

    @classmethod
    def for_model(
        cls,
        *,
        num_layers: int,
        top_k: int,
        num_experts: int,
        hash_block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_concurrent_batches: int,
        max_bytes: int,
    ) -> WorkerSizing:
        """Sizing for a model with ``num_experts`` experts (which sets the row dtype)."""
        return cls(
            shape_per_token=(num_layers, top_k),
            dtype=row_dtype(num_experts),
            hash_block_size=hash_block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_concurrent_batches=max_concurrent_batches,
            max_bytes=max_bytes,
        )

    @property
    def num_layers(self) -> int:
        return self.shape_per_token[0]

    @property
    def top_k(self) -> int:
        return self.shape_per_token[1]

    @property
    def row_nbytes(self) -> int:
        """Bytes of one token's row ``[L, K]``."""
        return row_nbytes(self.shape_per_token, self.dtype)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one hash block of rows (one store object)."""
        return self.hash_block_size * self.row_nbytes

    @property
    def blocks_per_step(self) -> int:
        """Most hash blocks one step's rows can touch: its tokens plus each request's
        partial first block."""
        return -(-self.max_num_batched_tokens // self.hash_block_size) + self.max_num_seqs


# Most draft tokens a step's device positions may sit below the scheduler's start: a request
# reattaches at its cursor after the previous step rejected that many (the device ring keeps
# room for them).
REATTACH_TOKENS = 256


def ring_widths(max_num_batched_tokens: int, block_size: int, depth: int) -> tuple[int, int]:
    """``(W, D)``: the host ring's width (most unbound blocks one request can hold) and the
    device ring's (most blocks one launch of a request can span, with its reattach), in
    hash blocks.

    A request's unbound blocks span the steps in flight plus the one being prepared, each up
    to a full step of blocks, and the blocks waiting for their keys.
    """
    step_blocks = -(-max_num_batched_tokens // block_size) + 1
    reattach = -(-REATTACH_TOKENS // block_size)
    width = (depth + 1) * step_blocks + 1
    return width, min(width, step_blocks + 1 + reattach)


def queue_stock(sizing: WorkerSizing) -> int:
    """Free slots the device queue keeps for the launches in flight: each launch opens at most
    ``blocks_per_step`` blocks, and ``max_concurrent_batches`` launches can be in flight
    before the output thread refills."""
    return sizing.max_concurrent_batches * sizing.blocks_per_step


def queue_size(sizing: WorkerSizing) -> int:
    """Entries of the device's free-slot queue: the stock, and room for one more launch's
    blocks beside it."""
    return queue_stock(sizing) + sizing.blocks_per_step


def reserve_slots(sizing: WorkerSizing) -> int:
    """Store slots kept beyond ``max_bytes`` for unbound blocks: the queue's entries (a
    refill fills the ring), the blocks a step can touch and each request's open block for
    every step in flight and the one being prepared (vLLM's staging bound), and one step of
    blocks handed over by ``begin_step`` whose store call waits for the output thread."""
    depth = sizing.max_concurrent_batches
    return queue_size(sizing) + (depth + 1) * sizing.blocks_per_step + sizing.max_num_seqs
