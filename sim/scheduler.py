"""Scheduler-side control plane of the routed-experts capture connector.

The scheduler never touches payloads. Each step it tells the worker which requests run
(with the first token row each should return), which block hashes became final since the
last update, which requests ended, and which stored blocks to pin or unpin because the KV
cache still holds them after their requests ended. It also caps prefix-cache hits to blocks
whose rows the worker can still serve, and trims worker rows to the accepted token range.

Behaviour matches vLLM 0.33.0's ``AuxOutputSchedulerConnector`` call for call, so either
can drive either worker connector.

What the scheduler reads, duck-typed (vLLM's objects or the simulator's doubles):

* ``kv_cache_manager.coordinator.single_type_managers[g].block_size`` and ``.block_pool``,
  ``coordinator.full_attention_group_id`` (optional, default group 0),
  ``kv_cache_manager.block_pool.hash_block_size``, ``block_pool.get_cached_block(hash, [g])``,
  ``kv_cache_manager.kv_cache_config.num_blocks``.
* requests: ``request_id``, ``block_hashes`` (list of bytes, one per hash block of the
  known tokens), ``num_computed_tokens``, ``num_tokens``, ``num_prompt_tokens``,
  ``num_output_tokens``, ``sampling_params.routed_experts_prompt_start``, ``is_finished()``.
* scheduler outputs: ``num_scheduled_tokens`` (request id -> tokens, in batch order).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from r3capture.aux_output.types import (
    AuxOutputConnectorMetadata,
    AuxRequestOutput,
    PackedBlockHashes,
)


def _pack(hashes: Sequence[bytes]) -> PackedBlockHashes | None:
    """Concatenate equal-size hashes for IPC; None when there are none."""
    if not hashes:
        return None
    return PackedBlockHashes(b"".join(hashes), len(hashes[0]))


class SchedulerConnector:
    """Builds per-step worker metadata and trims worker rows; owns no payload or store.

    State:
      * per active request, how many of its hash-block hashes the worker already has;
      * terminal events (with the request's final hashes) awaiting the next metadata;
      * ``kv_pins``: KV blocks whose stored rows the scheduler keeps pinned after the
        requests that computed them ended, in least-recently-hit order, keyed by the hash
        of the KV block's last hash block and holding all of that KV block's hashes;
      * per loading request (asynchronous KV load), the KV blocks being loaded;
      * the generation (store namespace), bumped on every prefix-cache reset.
    """

    def __init__(self, kv_cache_manager: Any, kv_connector: Any | None = None) -> None:
        coordinator = kv_cache_manager.coordinator
        group = getattr(coordinator, "full_attention_group_id", None)
        self._group = group or 0
        manager = coordinator.single_type_managers[self._group]
        self._pool = manager.block_pool
        self.block_size: int = manager.block_size
        self.hash_block_size: int = kv_cache_manager.block_pool.hash_block_size
        if self.block_size % self.hash_block_size:
            raise ValueError(
                f"KV block_size must be a multiple of hash_block_size; got "
                f"block_size={self.block_size}, hash_block_size={self.hash_block_size}"
            )
        self._hashes_per_block = self.block_size // self.hash_block_size
        # An external KV tier can hold as many blocks again as the GPU; pins follow it.
        self.capacity: int = kv_cache_manager.kv_cache_config.num_blocks * (
            1 if kv_connector is None else 2
        )
        self.generation = 0
        self._num_sent: dict[str, int] = {}
        self._terminal: dict[str, PackedBlockHashes | None] = {}
        self._kv_pins: OrderedDict[bytes, Sequence[bytes]] = OrderedDict()
        self._loading: dict[str, set[bytes]] = {}
        self._to_retain: list[bytes] = []
        self._to_release: list[bytes] = []

    # ---------------------------------------------------------------- metadata

    def build_connector_meta(
        self, scheduler_output: Any, requests: Mapping[str, Any]
    ) -> AuxOutputConnectorMetadata:
        """One step's incremental update for the worker; consumes queued events."""
        emit_starts: dict[str, int] = {}
        new_hashes: dict[str, PackedBlockHashes] = {}
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = requests[req_id]
            self._num_sent.setdefault(req_id, 0)
            # Hashes of blocks this step completes travel with the step that computes them.
            packed = self._advance(request, request.num_computed_tokens + num_tokens)
            if packed is not None:
                new_hashes[req_id] = packed
            self._loading.pop(req_id, None)
            emit_starts[req_id] = self._emit_start(request)
        if len(self._num_sent) != len(emit_starts):
            # Under async scheduling a block can become final (its last token settled)
            # after the schedule that would have carried its hash; a request that is not
            # rescheduled gets a hash-only update.
            for req_id in self._num_sent:
                if req_id not in emit_starts:
                    request = requests[req_id]
                    packed = self._advance(request, request.num_computed_tokens)
                    if packed is not None:
                        new_hashes[req_id] = packed
        finished = tuple(self._terminal)
        for req_id, packed in self._terminal.items():
            if packed is not None:
                new_hashes[req_id] = packed
        self._terminal = {}
        metadata = AuxOutputConnectorMetadata(
            self.generation,
            emit_starts,
            new_hashes,
            finished,
            _pack(self._to_retain),
            _pack(self._to_release),
        )
        self._to_retain = []
        self._to_release = []
        return metadata

    @staticmethod
    def _emit_start(request: Any) -> int:
        """First token row the request still needs: its prompt start before any output,
        afterwards the row of its newest token (earlier rows were already returned)."""
        prompt_start = min(
            request.sampling_params.routed_experts_prompt_start, request.num_prompt_tokens
        )
        floor = request.num_tokens - 1 if request.num_output_tokens else 0
        return max(prompt_start, floor)

    def _advance(self, request: Any, num_tokens: int) -> PackedBlockHashes | None:
        """Hashes of the request's hash blocks fully inside ``num_tokens`` not yet sent."""
        hashes = request.block_hashes
        sent = self._num_sent[request.request_id]
        if sent > len(hashes):
            raise AssertionError(
                f"KV block-hash history shrank: request={request.request_id}, "
                f"sent={sent}, now={len(hashes)}"
            )
        keyed = min(len(hashes), num_tokens // self.hash_block_size)
        if keyed <= sent:
            return None
        self._num_sent[request.request_id] = keyed
        return _pack(hashes[sent:keyed])

    # ---------------------------------------------------------------- prefix hits

    def _kv_blocks(self, hashes: Sequence[bytes]) -> Iterator[tuple[bytes, Sequence[bytes]]]:
        """(KV-block key, the KV block's hash-block hashes) for each full KV block."""
        step = self._hashes_per_block
        for end in range(step, len(hashes) + 1, step):
            yield hashes[end - 1], hashes[end - step : end]

    def _on_gpu(self, block_hash: bytes) -> bool:
        return bool(self._pool.get_cached_block(block_hash, [self._group]))

    def max_cache_hit(self, request: Any) -> int:
        """Longest prefix (tokens) whose rows the worker can serve: leading KV blocks that
        are pinned or still cached on the GPU; never the request's last token."""
        num_blocks = 0
        for key, hashes in self._kv_blocks(request.block_hashes):
            if key in self._kv_pins:
                self._kv_pins.move_to_end(key)
            elif not self._on_gpu(hashes[-1]):
                break
            num_blocks += 1
        return min(num_blocks * self.block_size, request.num_tokens - 1)

    def cap_external_hit(self, request: Any, num_local: int, num_external: int) -> int:
        """All or nothing: keep an external KV hit only when the whole hit ends on a KV
        block boundary inside ``max_cache_hit``."""
        total = num_local + num_external
        if total % self.block_size == 0 and total <= self.max_cache_hit(request):
            return num_external
        return 0

    def request_loading(self, request: Any, num_tokens: int) -> None:
        """Protect the KV blocks of an asynchronous load from unpinning until it runs."""
        num_blocks = num_tokens // self.block_size
        keys = set()
        for index, (key, _) in enumerate(self._kv_blocks(request.block_hashes)):
            if index >= num_blocks:
                break
            keys.add(key)
        self._loading[request.request_id] = keys

    # ---------------------------------------------------------------- outputs

    def take_output(
        self, request: Any, output: Mapping[str, AuxRequestOutput] | None
    ) -> np.ndarray | None:
        """Rows ``[token_start, num_tokens - 1)`` of the worker's output for ``request``
        (uint8/uint16 ``[n, L, K]``), or None while the request has no new accepted row."""
        req_id = request.request_id
        if output is None or req_id not in output:
            raise AssertionError(f"auxiliary output worker output is missing {req_id}")
        item = output[req_id]
        token_end = request.num_tokens - 1
        count = token_end - item.token_start
        span = (
            f"request={req_id}, token_end={token_end}, output_start={item.token_start}, "
            f"output_end={item.token_start + len(item.rows)}"
        )
        if count < 0:
            if request.is_finished():
                raise AssertionError(
                    f"finished auxiliary output output has no accepted token range: {span}"
                )
            return None
        if count > len(item.rows):
            raise AssertionError(
                f"auxiliary output worker output has an invalid token range: {span}"
            )
        return item.rows[:count]

    # ---------------------------------------------------------------- lifecycle

    def request_finished(self, request: Any) -> None:
        """Queue the terminal event (finish, abort or preemption) with the final hashes and
        pin the request's KV blocks the GPU still caches."""
        req_id = request.request_id
        self._loading.pop(req_id, None)
        num_blocks = request.num_computed_tokens // self.block_size
        for index, (key, hashes) in enumerate(self._kv_blocks(request.block_hashes)):
            if index >= num_blocks:
                break
            if key not in self._kv_pins and self._on_gpu(hashes[-1]):
                self._kv_pins[key] = hashes
                self._to_retain.extend(hashes)
        self._unpin_excess()
        if req_id in self._num_sent:
            self._terminal[req_id] = self._advance(request, request.num_computed_tokens)
            del self._num_sent[req_id]

    def _unpin_excess(self) -> None:
        """Unpin the least recently hit blocks beyond capacity, skipping those the GPU still
        caches or a load is bringing in."""
        excess = len(self._kv_pins) - self.capacity
        if excess <= 0:
            return
        loading = set()
        for keys in self._loading.values():
            loading |= keys
        victims = []
        for key, hashes in self._kv_pins.items():
            if len(victims) == excess:
                break
            if key not in loading and not self._on_gpu(hashes[-1]):
                victims.append(key)
        for key in victims:
            self._to_release.extend(self._kv_pins.pop(key))

    def reset(self) -> None:
        """After a prefix-cache reset: new store namespace; the worker drops its request
        state on the generation change, so every hash is sent again."""
        self._num_sent.clear()
        self._terminal.clear()
        self.generation += 1
        for hashes in self._kv_pins.values():
            self._to_release.extend(hashes)
        self._kv_pins.clear()


__all__ = ["SchedulerConnector"]
