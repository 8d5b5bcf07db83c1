"""Pre-built step traces for the host-side step benchmark.

A trace is a list of :class:`Step` records: exactly what a worker connector receives in one
engine step (scheduler metadata, the batch layout, the router rows the forward wrote, the
sampled and rejected counts). Building them up front keeps trace generation out of the
timed region, and both connectors replay the very same records.

Scheduling is synchronous (one step in flight) and follows the scheduler connector's rules:
hashes are sent for blocks the step completes (``(computed + scheduled) // B``), emit_start
is ``0`` until a request has output and ``num_tokens - 1`` afterwards, and terminal events
carry the request's remaining hashes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from bench.models import ModelShape
from r3capture.aux_output.types import AuxOutputConnectorMetadata, PackedBlockHashes


@dataclass
class Step:
    metadata: AuxOutputConnectorMetadata
    req_ids: list[str]
    query_start_loc: np.ndarray  # int32 [R + 1]
    num_computed: np.ndarray  # int32 [R]
    rows: np.ndarray  # int32 [num_rows, L, K]
    num_sampled: np.ndarray  # int32 [R]
    num_rejected: np.ndarray  # int32 [R]
    timed: bool

    def input_batch(self) -> SimpleNamespace:
        """What the model runner's InputBatch carries that a worker connector reads."""
        import torch

        counts = np.diff(self.query_start_loc)
        first = np.repeat(self.num_computed.astype(np.int64) - self.query_start_loc[:-1], counts)
        positions = np.arange(self.num_rows, dtype=np.int64) + first
        return SimpleNamespace(
            req_ids=self.req_ids,
            num_reqs=len(self.req_ids),
            query_start_loc_np=self.query_start_loc,
            num_computed_tokens_np=self.num_computed,
            positions=torch.from_numpy(positions),
        )

    @property
    def num_rows(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def accepted_rows(self) -> int:
        return self.num_rows - int(self.num_rejected.sum())


@dataclass
class _Request:
    req_id: str
    content: str  # requests sharing a content prefix share tokens, hashes and routes
    prompt_len: int
    max_output: int
    spec_k: int
    computed: int = 0
    outputs: int = 0
    hashes_sent: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.outputs

    @property
    def done(self) -> bool:
        return self.outputs >= self.max_output


@dataclass
class _Builder:
    shape: ModelShape
    block_size: int
    seed: int
    steps: list[Step] = field(default_factory=list)
    finished: list[_Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def block_hash(self, content: str, index: int) -> bytes:
        return hashlib.blake2b(f"{content}/{index}".encode(), digest_size=32).digest()

    def routes(self, content: str, start: int, count: int) -> np.ndarray:
        """int32 ``[count, L, K]``: a function of (content, position, layer) only."""
        L, K, E = self.shape.num_layers, self.shape.top_k, self.shape.num_experts
        salt = int.from_bytes(hashlib.blake2b(content.encode(), digest_size=4).digest(), "little")
        pos = np.arange(start, start + count, dtype=np.int64)[:, None, None]
        layer = np.arange(L, dtype=np.int64)[None, :, None]
        slot = np.arange(K, dtype=np.int64)[None, None, :]
        return ((pos * 2654435761 + layer * 40503 + salt) % E + slot * 7).astype(np.int32) % E

    def new_hashes(self, request: _Request, upto_tokens: int) -> PackedBlockHashes | None:
        known = request.num_tokens // self.block_size
        count = min(known, upto_tokens // self.block_size)
        if count <= request.hashes_sent:
            return None
        data = b"".join(
            self.block_hash(request.content, i) for i in range(request.hashes_sent, count)
        )
        request.hashes_sent = count
        return PackedBlockHashes(data, 32)

    def step(self, batch: list[tuple[_Request, int]], *, timed: bool, spec: bool = False) -> None:
        """Schedule ``(request, num_tokens)`` pairs as one step and advance them."""
        finished = tuple(r.req_id for r in self.finished)
        hashes: dict[str, PackedBlockHashes] = {}
        for request in self.finished:
            packed = self.new_hashes(request, request.computed)
            if packed is not None:
                hashes[request.req_id] = packed
        self.finished = []
        emit = {}
        for request, count in batch:
            packed = self.new_hashes(request, request.computed + count)
            if packed is not None:
                hashes[request.req_id] = packed
            emit[request.req_id] = 0 if request.outputs == 0 else request.num_tokens - 1
        metadata = AuxOutputConnectorMetadata(0, emit, hashes, finished)
        counts = np.array([count for _, count in batch], dtype=np.int32)
        qsl = np.zeros(len(batch) + 1, dtype=np.int32)
        np.cumsum(counts, out=qsl[1:])
        rows = [self.routes(r.content, r.computed, c) for r, c in batch]
        num_sampled = np.zeros(len(batch), dtype=np.int32)
        num_rejected = np.zeros(len(batch), dtype=np.int32)
        for i, (request, count) in enumerate(batch):
            if request.computed + count >= request.num_tokens:
                # A finished prompt or a decode samples one token plus the accepted drafts.
                drafts = count - 1 if spec else 0
                num_rejected[i] = self.rng.integers(0, drafts + 1) if drafts else 0
                num_sampled[i] = 1 + drafts - num_rejected[i]
        self.steps.append(
            Step(
                metadata,
                [r.req_id for r, _ in batch],
                qsl,
                np.array([r.computed for r, _ in batch], dtype=np.int32),
                np.concatenate(rows) if rows else np.zeros((0, 1, 1), np.int32),
                num_sampled,
                num_rejected,
                timed,
            )
        )
        for i, (request, count) in enumerate(batch):
            accepted = count - int(num_rejected[i])
            request.computed += accepted
            if num_sampled[i]:
                # Accepted drafts plus the bonus token extend the sequence.
                request.outputs += int(num_sampled[i])
            if request.done:
                self.finished.append(request)

    def prefill(self, requests: list[_Request], budget: int, *, timed: bool) -> None:
        pending = list(requests)
        while pending:
            batch, left = [], budget
            for request in pending:
                count = min(request.prompt_len - request.computed, left)
                if count > 0:
                    batch.append((request, count))
                    left -= count
                if left == 0:
                    break
            self.step(batch, timed=timed)
            pending = [r for r in pending if r.computed < r.prompt_len]

    def decode(self, requests: list[_Request], *, timed: bool) -> None:
        active = [r for r in requests if not r.done]
        while active:
            spec = any(r.spec_k for r in active)
            self.step([(r, 1 + r.spec_k) for r in active], timed=timed, spec=spec)
            active = [r for r in active if not r.done]

    def drain(self) -> None:
        if self.finished:
            self.step([], timed=False)


def _requests(prefix: str, n: int, prompt: int, output: int, spec_k: int = 0) -> list[_Request]:
    return [_Request(f"{prefix}{i}", f"{prefix}{i}", prompt, output, spec_k) for i in range(n)]


def build_trace(preset: str, shape: ModelShape, *, block_size: int = 16, seed: int = 0):
    """``(steps, max_num_batched_tokens, max_num_seqs)`` for one benchmark preset.

    decode: 256 requests x 1 token per step; prefill: 8192-token chunks of 16k prompts;
    multi-turn: 32 second turns per step hitting their first turns' ~2k-token prefix;
    speculative: 256 requests,
    k=3 drafts, about half rejected; mixed: one 4096-token chunk beside 128 decodes.
    """
    b = _Builder(shape, block_size, seed)
    if preset == "decode":
        reqs = _requests("d", 256, 112, 48)
        b.prefill(reqs, 8192, timed=False)
        b.decode(reqs, timed=True)
    elif preset == "prefill":
        reqs = _requests("p", 4, 16384, 1)
        b.prefill(reqs, 8192, timed=True)
    elif preset == "multi-turn":
        # 8 rounds of 32 conversations; every second turn hits the prefix cache on all of
        # the first turn's complete blocks (same content: same hashes and routes), and the
        # timed steps are those prefix-hit prefills, which materialize ~2k stored rows each.
        for round_ in range(8):
            first = _requests(f"m{round_}-", 32, 2000, 4)
            b.prefill(first, 65536, timed=False)
            b.decode(first, timed=False)
            b.drain()
            second = [
                _Request(
                    f"{r.req_id}-t2",
                    r.content,
                    r.num_tokens + 96,
                    1,
                    0,
                    computed=r.computed // block_size * block_size,
                )
                for r in first
            ]
            b.prefill(second, 65536, timed=True)
            b.drain()
    elif preset == "speculative":
        reqs = _requests("s", 256, 112, 64, spec_k=3)
        b.prefill(reqs, 8192, timed=False)
        b.decode(reqs, timed=True)
    elif preset == "mixed":
        decodes = _requests("x", 128, 112, 32)
        b.prefill(decodes, 8192, timed=False)
        long = _Request("long", "long", 4096 * 8, 1, 0)
        while not all(r.done for r in decodes):
            batch = [(r, 1) for r in decodes if not r.done]
            count = min(4096, long.prompt_len - long.computed)
            if count > 0:
                batch.append((long, count))
            b.step(batch, timed=True)
    else:
        raise ValueError(f"unknown preset {preset!r}")
    b.drain()
    max_tokens = max(step.num_rows for step in b.steps)
    max_seqs = max(len(step.req_ids) for step in b.steps)
    return b.steps, max(max_tokens, 1), max(max_seqs, 1)


PRESETS = ("decode", "prefill", "multi-turn", "speculative", "mixed")
