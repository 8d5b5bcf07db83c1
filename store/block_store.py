"""Bounded store of fixed-size blocks in one arena of slots.

A *block* is ``object_nbytes`` raw bytes (for routed experts: ``hash_block_size`` token rows of
``[L, K]`` uint8/uint16 ids, C order). The store keeps blocks in one ``uint8`` arena
``[num_slots + reserve_slots, object_nbytes]`` and maps each key (``vllm-artifact/{gen}/{hash}``)
to the slot holding its bytes. Its eviction and reference-count decisions are those of vLLM
0.33.0's ``BlockObjectStore``, so a scheduler driving both sees the same hits and misses.

Lifecycle of a block::

    allocate -> write -> bind -> retain/release -> evict

- ``allocate(n)`` hands out ``n`` unbound slots from the producer reserve (``reserve_slots``).
  Unbound slots belong to the producer: never evicted, never handed out twice.
- *write*: the producer fills ``arena_np[slot]`` in place (the capture kernel writes there
  directly). ``put``/``put_array`` fold allocate + write + bind into one call for callers that
  already hold the bytes.
- ``bind(keys, slots)`` gives each slot its key. A key that already exists and is referenced
  keeps its old bytes (the new slot goes back to the reserve); an existing unreferenced key is
  replaced. Binding may push the number of keys past ``num_slots``; the least recently used
  unreferenced keys are then evicted.
- ``retain``/``release`` (the ``retain_keys``/``release_keys`` arguments) count references. A
  referenced key is never evicted. When a key's count drops to zero it becomes the most recently
  used, in release order, so the scheduler's tail-first release order is the eviction order.
- *evict*: only unreferenced keys, least recently used first; lookups (``get_array``,
  ``get_concatenated``, ``lookup_slots``) refresh recency (a no-op for referenced keys, which
  ``lookup_slots(held=True)`` does not probe for). If every key is referenced, the store
  grows instead of failing: ``num_slots`` at least doubles, a warning is logged, ``on_grow()`` is
  called before the old arena is copied, and ``arena``/``arena_np`` are replaced
  (``arena_version`` increments). A key that is gone raises ``BlockObjectStoreError``.

Every side table (key -> slot, LRU, free slots, unbound slots) is bounded by the arena.
Reference counts are kept per key the scheduler retains; the scheduler bounds those by its own
KV-cache blocks.

Thread safety: none. The store has a single owner; the worker connector serialises every call
under its own lock. The store is synchronous: array copies are cheap, so there is no background
writer thread.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from itertools import filterfalse, islice, repeat
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

_pin_noop_logged = False
_UINT8 = np.dtype(np.uint8)


class BlockObjectStoreError(RuntimeError):
    """A requested block is not in the store (it was evicted or never published)."""


def _new_arena(num_slots: int, object_nbytes: int, pin_memory: bool) -> torch.Tensor:
    return torch.empty((num_slots, object_nbytes), dtype=torch.uint8, pin_memory=pin_memory)


class BlockStore:
    """Bounded store of fixed-size blocks in one arena of slots.

    Args:
        max_bytes: initial capacity in bytes; ``num_slots = max_bytes // object_nbytes`` keys.
        object_nbytes: size of every block in bytes.
        reserve_slots: extra physical slots for blocks a producer has allocated but not bound.
            They do not count towards ``num_slots``, so eviction decisions match vLLM's.
        pin_memory: allocate the arena in page-locked memory (only when CUDA is available;
            otherwise a no-op, logged once).
        on_grow: called before the arena is replaced on growth (e.g. to wait for in-flight
            device writes into the old arena).

    Attributes:
        arena: ``torch.uint8 [num_slots + reserve_slots, object_nbytes]`` CPU tensor.
        arena_np: numpy view of ``arena``. Both are replaced when the store grows.
        arena_version: incremented every time ``arena`` is replaced.
        num_slots: capacity for bound blocks (keys); grows when every key is referenced.
    """

    def __init__(
        self,
        *,
        max_bytes: int,
        object_nbytes: int,
        reserve_slots: int = 0,
        pin_memory: bool = False,
        on_grow: Callable[[], None] | None = None,
    ) -> None:
        if object_nbytes <= 0:
            raise ValueError(f"object_nbytes must be a positive byte count, got {object_nbytes}")
        if max_bytes < object_nbytes:
            raise ValueError(
                f"max_bytes must hold at least one object (>= object_nbytes={object_nbytes}), "
                f"got {max_bytes}"
            )
        if reserve_slots < 0:
            raise ValueError(f"reserve_slots must be >= 0, got {reserve_slots}")
        if pin_memory and not torch.cuda.is_available():
            global _pin_noop_logged
            if not _pin_noop_logged:
                _pin_noop_logged = True
                logger.info("pin_memory requested but CUDA is not available: arena is not pinned")
            pin_memory = False
        self.object_nbytes = int(object_nbytes)
        self.num_slots = int(max_bytes) // self.object_nbytes
        self.reserve_slots = int(reserve_slots)
        self._pin_memory = pin_memory
        self._on_grow = on_grow
        self._arena: torch.Tensor | None = _new_arena(
            self.num_slots + self.reserve_slots, self.object_nbytes, pin_memory
        )
        self._arena_np: np.ndarray | None = self._arena.numpy()
        self.arena_version = 0
        self._slots: dict[str, int] = {}
        # Unreferenced keys, oldest first. Not a plain dict: evicting from the head of one
        # leaves dead entries that every later scan from the head walks over.
        self._lru: OrderedDict[str, None] = OrderedDict()
        self._refs: dict[str, int] = {}
        # Freed slots form a stack; taking n slots takes the top n in the order they were
        # pushed, so a run freed together (an evicted batch) comes back as the same run and is
        # written with one slice. Never-used slots, from _next_slot up, come after.
        self._free: list[int] = []
        self._next_slot = 0
        self._unbound: set[int] = set()

    def put(
        self,
        objects: Iterable[tuple[str, Any]],
        *,
        retain_keys: Iterable[str] = (),
        release_keys: Iterable[str] = (),
    ) -> None:
        """Publish ``(key, payload)`` pairs; each payload is bytes-like of ``object_nbytes``.

        Within a batch the last payload of a repeated key wins. Retains apply before
        releases. Raises ``ValueError`` for a payload of the wrong size and ``KeyError`` for a
        release of a key without a reference; nothing changes in either case.
        """
        self._check_open()
        keys: list[str] = []
        payloads: list[memoryview] = []
        for i, (key, payload) in enumerate(objects):
            view = memoryview(payload)
            if view.nbytes != self.object_nbytes:
                raise ValueError(
                    f"objects[{i}] ({key!r}): payload has {view.nbytes} bytes, "
                    f"expected object_nbytes={self.object_nbytes}"
                )
            keys.append(key)
            payloads.append(view)
        rows = np.frombuffer(b"".join(payloads), dtype=np.uint8).reshape(
            len(keys), self.object_nbytes
        )
        self._put_rows(keys, rows, retain_keys, release_keys)

    def get_concatenated(self, keys: Sequence[str]) -> bytes:
        """The blocks of ``keys`` joined in order, ``len(keys) * object_nbytes`` bytes."""
        return self.get_array(keys).tobytes()

    def put_array(
        self,
        keys: Sequence[str],
        blocks: np.ndarray,
        *,
        retain_keys: Iterable[str] = (),
        release_keys: Iterable[str] = (),
    ) -> None:
        """Publish ``blocks[i]`` under ``keys[i]`` with one vectorised copy.

        ``blocks``: any dtype, C-contiguous, leading dimension ``len(keys)``, exactly
        ``len(keys) * object_nbytes`` bytes (e.g. ``[n, B, L, K]`` uint8). Same semantics as
        ``put``.
        """
        self._check_open()
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        rows = self._as_rows(blocks, len(keys))
        self._put_rows(keys, rows, retain_keys, release_keys)

    def get_array(self, keys: Sequence[str], out: np.ndarray | None = None) -> np.ndarray:
        """Gather the blocks of ``keys`` into ``uint8 [len(keys), object_nbytes]`` in one copy.

        ``out``: optional C-contiguous destination of exactly ``len(keys) * object_nbytes``
        bytes, any dtype; the returned array is its ``uint8`` view. Refreshes the recency of
        the keys; raises ``BlockObjectStoreError`` if any key is missing.
        """
        slots = self.lookup_slots(keys)
        if out is None:
            return self._arena_np[slots]
        rows = self._as_rows(out, len(slots), name="out")
        self.gather_into(slots, rows)
        return rows

    def gather_into(self, slots: np.ndarray, out: np.ndarray) -> None:
        """Copy arena rows ``slots`` (int64 ``[n]``) into ``out`` (uint8 ``[n, object_nbytes]``,
        C-contiguous). No bookkeeping: callers pass slots they looked up."""
        if len(slots) < 16:
            # Few blocks: numpy's fancy indexing has the smaller fixed cost.
            out[...] = self._arena_np[slots]
            return
        # torch's row gather copies each slot with one memcpy; np.take(axis=0, out=) goes
        # element-wise through a buffered iterator and is ~4x slower for 6 KiB rows.
        torch.index_select(self._arena, 0, torch.from_numpy(slots), out=torch.from_numpy(out))

    def lookup_slots(self, keys: Sequence[str], *, held: bool = False) -> np.ndarray:
        """Slots of ``keys`` as ``int64 [len(keys)]``; refreshes their recency like a read.

        ``held=True`` promises that the caller holds a reference on every key. Referenced keys
        are never in the LRU, so the refresh would change nothing and is skipped (it costs a
        probe of the LRU per key). Raises ``BlockObjectStoreError`` (naming the capacity) if
        any key is missing.
        """
        self._check_open()
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        try:
            slots = np.fromiter(map(self._slots.__getitem__, keys), np.int64, count=len(keys))
        except KeyError as error:
            raise BlockObjectStoreError(
                f"auxiliary output object {error.args[0]!r} does not exist; it may have been "
                f"evicted (used={len(self._slots)}, limit={self.num_slots} objects of "
                f"{self.object_nbytes} bytes). Raise the aux_output max_bytes, e.g. "
                f"--aux-output-config '{{\"max_bytes\": N}}' with N > "
                f"{self.num_slots * self.object_nbytes}, when a KV cache hit needs it."
            ) from None
        if self._lru and not held:
            self._touch(keys)
        return slots

    def allocate(self, n: int) -> np.ndarray:
        """Take ``n`` unbound slots (``int64 [n]``) from the producer reserve.

        Raises ``RuntimeError`` when fewer than ``n`` reserve slots are left.
        """
        self._check_open()
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if len(self._unbound) + n > self.reserve_slots:
            raise RuntimeError(
                f"allocate({n}): the producer reserve of reserve_slots={self.reserve_slots} "
                f"slots is exhausted ({len(self._unbound)} unbound); bind or free slots first "
                "or raise reserve_slots"
            )
        slots = self._take_slots(n)
        self._unbound.update(slots)
        return np.array(slots, dtype=np.int64)

    def bind(
        self,
        keys: Sequence[str],
        slots: np.ndarray,
        *,
        retain_keys: Iterable[str] = (),
        release_keys: Iterable[str] = (),
    ) -> None:
        """Give unbound slot ``slots[i]`` (already written) the key ``keys[i]``.

        ``put`` semantics without a copy. Every given slot leaves the reserve; a slot whose
        key is kept (existing referenced key, or an earlier duplicate in the batch) or evicted
        at once is returned to the free pool.
        """
        self._check_open()
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        slot_list, distinct = self._check_unbound(slots)
        if len(slot_list) != len(keys):
            raise ValueError(
                f"slots: expected {len(keys)} slots for {len(keys)} keys, got {len(slot_list)}"
            )
        survivors = self._admit(keys, retain_keys, release_keys)
        self._unbound -= distinct
        if len(survivors) == len(slot_list):
            used = slot_list
        else:
            used = [slot_list[i] for i in _positions(keys, survivors)]
            kept = set(used)
            self._free.extend(slot for slot in slot_list if slot not in kept)
        self._slots.update(zip(survivors, used))

    def free(self, slots: np.ndarray) -> None:
        """Return unbound slots (``int64 [n]`` from ``allocate``) to the reserve."""
        self._check_open()
        slot_list, distinct = self._check_unbound(slots)
        self._unbound -= distinct
        self._free.extend(slot_list)

    @property
    def arena(self) -> torch.Tensor:
        self._check_open()
        return self._arena

    @property
    def arena_np(self) -> np.ndarray:
        self._check_open()
        return self._arena_np

    @property
    def num_unbound(self) -> int:
        """Slots handed out by ``allocate`` and not yet bound or freed."""
        self._check_open()
        return len(self._unbound)

    def __contains__(self, key: object) -> bool:
        self._check_open()
        return key in self._slots

    def __len__(self) -> int:
        """Number of bound blocks (keys)."""
        self._check_open()
        return len(self._slots)

    def ref_count(self, key: str) -> int:
        """References held on ``key`` (introspection; does not touch recency)."""
        self._check_open()
        return self._refs.get(key, 0)

    def eviction_order(self) -> list[str]:
        """Unreferenced keys, next victim first (introspection; does not touch recency)."""
        self._check_open()
        return list(self._lru)

    def peek_slot(self, key: str) -> int | None:
        """Slot of ``key`` or None (introspection; does not touch recency)."""
        self._check_open()
        return self._slots.get(key)

    def close(self) -> None:
        """Release the arena. Idempotent; every later call raises ``RuntimeError``."""
        if self._arena is None:
            return
        self._arena = None
        self._arena_np = None
        self._slots.clear()
        self._lru.clear()
        self._refs.clear()
        self._free.clear()
        self._unbound.clear()

    def _check_open(self) -> None:
        if self._arena is None:
            raise RuntimeError("auxiliary output store is closed")

    def _as_rows(self, array: np.ndarray, n: int, name: str = "blocks") -> np.ndarray:
        """``array`` as ``uint8 [n, object_nbytes]`` without copying."""
        arr = np.asarray(array)
        if arr.dtype is _UINT8 and arr.ndim > 1 and arr.shape[0] == n > 0:
            if arr.flags.c_contiguous and arr.size == n * self.object_nbytes:
                return arr.reshape(n, self.object_nbytes)
        if arr.dtype.hasobject or not arr.flags.c_contiguous:
            raise ValueError(f"{name}: expected a C-contiguous numeric array, got {arr.dtype}")
        expected = n * self.object_nbytes
        if arr.nbytes != expected or arr.ndim == 0 or arr.shape[0] != n:
            raise ValueError(
                f"{name}: expected leading dimension {n} and {n} x {self.object_nbytes} = "
                f"{expected} bytes, got shape {arr.shape} {arr.dtype} ({arr.nbytes} bytes)"
            )
        return arr.reshape(-1).view(np.uint8).reshape(n, self.object_nbytes)

    def _check_unbound(self, slots: np.ndarray) -> tuple[list[int], set[int]]:
        """``slots`` as a list and a set, after checking they are distinct unbound slots."""
        arr = np.asarray(slots)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ValueError(f"slots: expected a 1-D integer array, got {arr.shape} {arr.dtype}")
        slot_list = arr.tolist()
        distinct = set(slot_list)
        if not distinct <= self._unbound:
            stray = sorted(distinct - self._unbound)
            raise ValueError(f"slots: {stray} are not unbound slots from allocate()")
        if len(distinct) != len(slot_list):
            raise ValueError(f"slots: each slot may appear once, got {slot_list}")
        return slot_list, distinct

    def _take_slots(self, n: int) -> list[int]:
        """``n`` free physical slots, recently freed ones first."""
        free = self._free
        reused = min(n, len(free))
        slots = free[len(free) - reused :]
        del free[len(free) - reused :]
        if reused < n:
            start = self._next_slot
            self._next_slot = start + n - reused
            assert self._next_slot <= self.num_slots + self.reserve_slots, "arena overcommitted"
            slots.extend(range(start, self._next_slot))
        return slots

    def _put_rows(
        self,
        keys: Sequence[str],
        rows: np.ndarray,
        retain_keys: Iterable[str],
        release_keys: Iterable[str],
    ) -> None:
        survivors = self._admit(keys, retain_keys, release_keys)
        m = len(survivors)
        if not m:
            return
        if m != len(keys):
            rows = rows[_positions(keys, survivors)]
        slots = self._take_slots(m)
        self._slots.update(zip(survivors, slots))
        first = slots[0]
        if slots[-1] - first == m - 1 and slots == list(range(first, first + m)):
            self._arena_np[first : first + m] = rows
        else:
            self._arena_np[np.array(slots, dtype=np.int64)] = rows

    def _admit(
        self, keys: Sequence[str], retain_keys: Iterable[str], release_keys: Iterable[str]
    ) -> list[str]:
        """Apply a publication's bookkeeping; return the keys that need a slot, in batch order.

        On return eviction and growth are done with those keys counted; the caller binds them
        to slots in ``_slots``. Keys referenced at the start of the call keep their bytes.
        """
        slots, lru, refs = self._slots, self._lru, self._refs
        retains = tuple(retain_keys)
        releases = tuple(release_keys)
        # Whether each key is released at most once: checked once, used by the release too.
        distinct = self._check_releases(retains, releases) if releases else True
        unique = dict.fromkeys(keys)
        present = list(filter(slots.__contains__, unique)) if slots else None
        if present:
            replaced = list(filter(lru.__contains__, present))
            if replaced:
                deque(map(lru.__delitem__, replaced), maxlen=0)
                self._free.extend(map(slots.pop, replaced))
            pending = list(filterfalse(slots.__contains__, unique))
        else:
            pending = list(unique)
        if retains:
            self._retain(retains)
        terminal = self._release(releases, distinct) if releases else []
        lru.update(zip(filterfalse(refs.__contains__, pending) if refs else pending, repeat(None)))
        if terminal:
            self._touch(terminal)

        excess = len(slots) + len(pending) - self.num_slots
        if excess > 0:
            protected = unique.keys() - set(terminal) if terminal else unique.keys()
            evicted_new = self._evict(excess, protected)
            if evicted_new:
                pending = [key for key in pending if key not in evicted_new]
        bound = len(slots) + len(pending)
        if bound > self.num_slots:
            self._grow(max(bound, 2 * self.num_slots))
        return pending

    def _release(self, releases: tuple[str, ...], distinct: bool) -> list[str]:
        """Drop one reference per occurrence (retains of the call already applied); return
        the keys whose last reference went, in order, after appending the stored ones to the
        LRU in that order. ``distinct``: no key occurs twice in ``releases``."""
        refs, lru, slots = self._refs, self._lru, self._slots
        counts = list(map(refs.__getitem__, releases))
        if distinct and counts.count(1) == len(counts):
            # A finishing request lets go of its own blocks: every count drops to zero.
            deque(map(refs.__delitem__, releases), maxlen=0)
            lru.update(zip(filter(slots.__contains__, releases), repeat(None)))
            return list(releases)
        terminal: list[str] = []
        for key in releases:
            count = refs[key] - 1
            if count:
                refs[key] = count
                continue
            del refs[key]
            if key in slots:
                lru[key] = None
            terminal.append(key)
        return terminal

    def _retain(self, retains: tuple[str, ...]) -> None:
        """Add one reference per occurrence; a key's first reference takes it off the LRU.

        A prefix hit pins thousands of keys at once, so the per-key work stays in C
        (``Counter``, set algebra, ``map``) except for keys that were already referenced.
        """
        refs, lru = self._refs, self._lru
        if len(retains) < 64:
            # A step's few new hashes: a plain loop beats the set algebra's fixed cost.
            for key in retains:
                count = refs.get(key, 0)
                if not count:
                    lru.pop(key, None)
                refs[key] = count + 1
            return
        distinct = set(retains)
        # Each key once is the usual case: then no counting is needed.
        counts = None if len(distinct) == len(retains) else Counter(retains)
        keys = distinct if counts is None else counts.keys()
        held = keys & refs.keys() if refs else ()
        for key in held:
            refs[key] += 1 if counts is None else counts[key]
        fresh = keys - held if held else keys
        if lru:
            deque(map(lru.pop, fresh, repeat(None)), maxlen=0)
        refs.update(zip(fresh, repeat(1) if counts is None else map(counts.__getitem__, fresh)))

    def _touch(self, keys: Sequence[str]) -> None:
        """Make the unreferenced ones of ``keys`` most recently used, one after another."""
        lru = self._lru
        deque(map(lru.move_to_end, filter(lru.__contains__, keys)), maxlen=0)

    def _check_releases(self, retains: tuple[str, ...], releases: tuple[str, ...]) -> bool:
        """Raise ``KeyError`` if a key is released more often than it is referenced (held, or
        retained in this call). Returns whether every key occurs once in ``releases``."""
        distinct = set(releases)
        if len(distinct) == len(releases):
            # Each key released once: it needs one reference, held already or retained in
            # this call (a finishing request's last hashes). Checked in C, no per-key loop.
            unheld = distinct - self._refs.keys()
            if not unheld or unheld <= set(retains):
                return True
        added = Counter(retains)
        for key, count in Counter(releases).items():
            held = self._refs.get(key, 0) + added[key]
            if held < count:
                raise KeyError(
                    f"release_keys: {key!r} released {count} time(s) but holds {held} reference(s)"
                )
        return len(distinct) == len(releases)

    def _evict(self, excess: int, protected: Any) -> set[str]:
        """Evict ``excess`` unreferenced keys, oldest first, skipping ``protected``.

        Returns the evicted keys that had no slot yet (batch keys released in the same call).
        """
        lru, slots = self._lru, self._slots
        victims = list(islice(lru, excess))
        if len(victims) < excess or not protected.isdisjoint(victims):
            victims = []
            for key in lru:
                if key not in protected:
                    victims.append(key)
                    if len(victims) == excess:
                        break
        deque(map(lru.__delitem__, victims), maxlen=0)
        freed = list(map(slots.pop, victims, repeat(-1)))
        if -1 not in freed:
            self._free.extend(freed)
            return set()
        self._free.extend(slot for slot in freed if slot >= 0)
        return {key for key, slot in zip(victims, freed) if slot < 0}

    def _grow(self, num_slots: int) -> None:
        logger.warning(
            "auxiliary output store grows from %d to %d objects (%d bytes): every object is "
            "referenced",
            self.num_slots,
            num_slots,
            num_slots * self.object_nbytes,
        )
        try:
            if self._on_grow is not None:
                self._on_grow()
            arena = _new_arena(num_slots + self.reserve_slots, self.object_nbytes, self._pin_memory)
            arena[: self.num_slots + self.reserve_slots].copy_(self._arena)
        except BaseException:
            # The bookkeeping already counts the new keys; without room for them the store
            # would hand out wrong bytes, so it fails closed.
            self.close()
            raise
        self._arena, self._arena_np = arena, arena.numpy()
        self.num_slots = num_slots
        self.arena_version += 1


def _positions(keys: Sequence[str], survivors: list[str]) -> list[int]:
    """Batch position of each survivor; a repeated key's last position (its payload wins)."""
    last = dict(zip(keys, range(len(keys))))
    return list(map(last.__getitem__, survivors))
