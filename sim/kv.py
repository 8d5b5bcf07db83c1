"""A KV-cache-manager double with the parts of vLLM's that the capture connectors observe.

* GPU blocks with reference counts; freed blocks keep their hash (stay prefix-cache hits)
  until reallocated, least recently freed first; a request frees its blocks tail first,
  so its tail is evicted first (vLLM's order).
* A full KV block is cached under the hash of its last hash block; block hashes chain over
  token ids (see ``block_hashes_for``), so equal prefixes give equal hashes.
* Blocks are cached when scheduled (up to the request's known tokens), so a block being
  computed in an in-flight step is already a hit for the next request, as in vLLM.
* Optional offload tier (a KV connector double): blocks evicted from the GPU move to an LRU
  tier of ``offload_blocks`` blocks that serves external hits.

Scheduler connectors read: ``coordinator.single_type_managers[0].block_size`` and
``.block_pool``, ``coordinator.full_attention_group_id``, ``block_pool.hash_block_size``,
``block_pool.get_cached_block(hash, [0])`` and ``kv_cache_config.num_blocks``.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

ROOT_HASH = hashlib.sha256(b"r3capture-sim-root").digest()


def block_hashes_for(
    tokens: Sequence[int], hash_block_size: int, parents: Sequence[bytes] = ()
) -> list[bytes]:
    """32-byte hashes of each full hash block of ``tokens`` (chained: each covers its
    parent's hash and its own token ids as int64). ``parents`` are hashes already computed
    for the leading blocks; only the following blocks are computed and returned."""
    out: list[bytes] = []
    parent = parents[-1] if parents else ROOT_HASH
    toks = np.asarray(tokens, dtype=np.int64)
    for start in range(
        len(parents) * hash_block_size, len(toks) - hash_block_size + 1, hash_block_size
    ):
        digest = hashlib.sha256(parent + toks[start : start + hash_block_size].tobytes())
        parent = digest.digest()
        out.append(parent)
    return out


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    cached_at: int = -1  # BlockPoolDouble.now when the block got its hash


class BlockPoolDouble:
    """Blocks, the free queue (front = next to reuse) and the hash -> cached blocks map."""

    def __init__(self, num_blocks: int, hash_block_size: int) -> None:
        self.hash_block_size = hash_block_size
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, dict[int, None]] = {}
        self.on_evict: Any = None  # callable(hash) invoked when a cached block is reused
        self.now = 0  # the engine's step index, stamped on blocks as they are cached

    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: list[int]
    ) -> list[KVBlock] | None:
        """vLLM's lookup: one cached block per group (only group 0 exists), or None."""
        holders = self.cached.get(block_hash)
        if not holders or list(kv_cache_group_ids) != [0]:
            return None
        return [self.blocks[next(iter(holders))]]

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def touch(self, block: KVBlock) -> None:
        if block.ref_cnt == 0:
            del self.free_queue[block.block_id]
        block.ref_cnt += 1

    def pop_free(self) -> KVBlock:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            holders = self.cached[block.block_hash]
            del holders[block_id]
            if not holders:
                del self.cached[block.block_hash]
                if self.on_evict is not None:
                    self.on_evict(block.block_hash)
            block.block_hash = None
        block.ref_cnt = 1
        return block

    def release(self, block: KVBlock) -> None:
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self.free_queue[block.block_id] = None

    def cache(self, block: KVBlock, block_hash: bytes) -> None:
        block.block_hash = block_hash
        block.cached_at = self.now
        self.cached.setdefault(block_hash, {})[block.block_id] = None


class OffloadTierDouble:
    """LRU set of evicted KV-block keys standing in for an external KV connector."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[bytes, None] = OrderedDict()

    def add(self, key: bytes) -> None:
        self.keys[key] = None
        self.keys.move_to_end(key)
        while len(self.keys) > self.capacity:
            self.keys.popitem(last=False)

    def __contains__(self, key: bytes) -> bool:
        return key in self.keys


class KVCacheDouble:
    """Per-request block tables over ``BlockPoolDouble``, with vLLM's allocate/cache/free."""

    def __init__(
        self, *, num_blocks: int, block_size: int, hash_block_size: int, offload_blocks: int = 0
    ) -> None:
        if block_size % hash_block_size:
            raise ValueError(
                "block_size must be a multiple of hash_block_size; got "
                f"{block_size}, {hash_block_size}"
            )
        self.block_size = block_size
        self.hash_block_size = hash_block_size
        self.hashes_per_block = block_size // hash_block_size
        self.block_pool = BlockPoolDouble(num_blocks, hash_block_size)
        self.kv_cache_config = SimpleNamespace(num_blocks=num_blocks)
        manager = SimpleNamespace(block_size=block_size, block_pool=self.block_pool)
        self.coordinator = SimpleNamespace(
            single_type_managers=[manager], full_attention_group_id=0
        )
        self.offload = OffloadTierDouble(offload_blocks) if offload_blocks else None
        if self.offload is not None:
            self.block_pool.on_evict = self.offload.add
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached: dict[str, int] = {}

    def _key(self, hashes: Sequence[bytes], index: int) -> bytes | None:
        end = (index + 1) * self.hashes_per_block
        return hashes[end - 1] if end <= len(hashes) else None

    def get_computed_blocks(
        self, request: Any, max_cache_hit_length: int | None = None
    ) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of full KV blocks, capped at ``max_cache_hit_length``
        (default ``num_tokens - 1``: the last token is always recomputed)."""
        limit = request.num_tokens - 1 if max_cache_hit_length is None else max_cache_hit_length
        hits: list[KVBlock] = []
        while (len(hits) + 1) * self.block_size <= limit:
            key = self._key(request.block_hashes, len(hits))
            found = None if key is None else self.block_pool.get_cached_block(key, [0])
            if not found:
                break
            hits.append(found[0])
        return hits, len(hits) * self.block_size

    def external_hit(self, request: Any, num_local: int) -> int:
        """Tokens an offload-tier load adds after a block-aligned local hit of ``num_local``."""
        if self.offload is None:
            return 0
        limit = (request.num_tokens - 1) // self.block_size
        index = num_local // self.block_size
        count = 0
        while index + count < limit:
            key = self._key(request.block_hashes, index + count)
            if key is None or key not in self.offload:
                break
            count += 1
        return count * self.block_size

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        *,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVBlock] = (),
        num_external_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> bool:
        """Make room for the request's next tokens; False (nothing changed) when the pool
        lacks free blocks. Caches full blocks up to the tokens computed after this step,
        capped at the known tokens (drafts are never cached)."""
        blocks = self.req_blocks.setdefault(request.request_id, [])
        computed = (
            request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens
        )
        total = computed + num_new_tokens + num_lookahead_tokens
        needed = -(-total // self.block_size) - len(blocks) - len(new_computed_blocks)
        reclaimable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if needed > self.block_pool.num_free - reclaimable:
            if not blocks:
                del self.req_blocks[request.request_id]
            return False
        for block in new_computed_blocks:
            self.block_pool.touch(block)
        blocks.extend(new_computed_blocks)
        if new_computed_blocks:
            self.num_cached[request.request_id] = len(blocks)
        for _ in range(max(needed, 0)):
            blocks.append(self.block_pool.pop_free())
        if not delay_cache_blocks:
            self.cache_blocks(request, min(computed + num_new_tokens, request.num_tokens))
        return True

    def cache_blocks(self, request: Any, num_tokens: int) -> None:
        """Register the request's full blocks covering ``num_tokens`` (hashes permitting)."""
        blocks = self.req_blocks.get(request.request_id)
        if not blocks:
            return
        hashes = request.block_hashes
        full = min(num_tokens // self.block_size, len(hashes) // self.hashes_per_block, len(blocks))
        start = self.num_cached.get(request.request_id, 0)
        for index in range(start, full):
            block = blocks[index]
            if block.block_hash is None:
                self.block_pool.cache(block, self._key(hashes, index))
        if full > start:
            self.num_cached[request.request_id] = full

    def free(self, request: Any) -> None:
        """Release the request's blocks, tail first (the tail is reused first)."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_cached.pop(request.request_id, None)
        for block in reversed(blocks):
            self.block_pool.release(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        pool = self.block_pool
        if pool.num_free != len(pool.blocks):
            return False
        for block in pool.blocks:
            block.block_hash = None
        pool.cached.clear()
        return True


__all__ = ["BlockPoolDouble", "KVBlock", "KVCacheDouble", "OffloadTierDouble", "block_hashes_for"]
