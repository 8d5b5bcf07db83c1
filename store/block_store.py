"""Bounded store of fixed-size blocks in one arena of slots.

A *block* is ``object_nbytes`` raw bytes (for routed experts: ``hash_block_size`` token rows of
``[L, K]`` uint8/uint16 ids, C order). The store keeps blocks in one ``uint8`` arena
``[num_slots + reserve_slots, object_nbytes]`` and maps each key to the slot holding its bytes.
Its eviction and reference-count decisions are those of vLLM 0.33.0's ``BlockObjectStore``, so a
scheduler driving both sees the same hits and misses.

Keys: every method takes keys as *key rows* (``uint64 [n, KEY_WORDS]``, one row per block
hash, built by ``key_rows``; no per-key Python anywhere), as *key objects* (``KeyObjects``
from ``key_objects``: the form the store keeps; a caller that hands the same objects back
call after call spares the store their conversion and cold comparisons) or as vLLM's
strings ``vllm-artifact/{generation}/{hash.hex()}``; ``as_key_objects`` converts them once at
the boundary. Errors and introspection name keys in the string form.

Lifecycle of a block::

    allocate -> write -> bind -> retain/release -> evict

- ``allocate(n)`` hands out ``n`` unbound slots from the producer reserve (``reserve_slots``).
  Unbound slots belong to the producer: never evicted, never handed out twice. A producer
  that needs more than the reserve holds calls ``grow_reserve(extra)`` first (the arena grows
  as it does for keys, below).
- *write*: the producer fills ``arena_np[slot]`` in place (the capture kernel writes there
  directly). ``put``/``put_array`` fold allocate + write + bind into one call for callers that
  already hold the bytes.
- ``bind(keys, slots)`` gives each slot its key. A key that already exists and is referenced
  keeps its old bytes (the new slot goes back to the reserve); an existing unreferenced key is
  replaced. A key repeated in one call takes its last slot (or payload). Binding may push the
  number of keys past ``num_slots``; the least recently used unreferenced keys are then
  evicted.
- ``retain``/``release`` (the ``retain_keys``/``release_keys`` arguments) count references. A
  referenced key is never evicted. When a key's count drops to zero it becomes the most recently
  used, in release order, so the scheduler's tail-first release order is the eviction order.
  Releases are checked before anything changes: a key released more often than it is held (now,
  plus retains in the same call) raises ``KeyError`` and the store is unchanged.
- *evict*: only unreferenced keys, least recently used first; lookups (``get_array``,
  ``get_concatenated``, ``lookup_slots``) refresh recency (a no-op for referenced keys, which
  ``lookup_slots(held=True)`` does not probe for). If every key is referenced, the store
  grows instead of failing: ``num_slots`` at least doubles, a warning is logged, ``on_grow()`` is
  called before the old arena is copied, and ``arena``/``arena_np`` are replaced
  (``arena_version`` increments). A key that is gone raises ``BlockObjectStoreError``.

Every method validates its arguments before it changes anything (recency included).

Layout: ``Ledger`` (keys -> slots, references, least-recently-used order and vLLM's
publication rules), ``SlotSpace`` (the arena, its free and unbound slots, and their growth).
Every side table holds only keys that have a slot or a reference: the arena bounds the
first, the scheduler's KV-cache blocks bound the second.

Thread safety: none. The store has a single owner; the worker connector serialises every call
under its own lock. The store is synchronous: array copies are cheap, so there is no background
writer thread.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from r3capture.store.keys import (
    KEY_WORDS,
    NO_KEY_OBJECTS,
    KeyObjects,
    as_key_objects,
    key_object_string,
    key_objects,
    key_rows_from_strings,
    key_string,
)
from r3capture.store.ledger import Admission, Ledger
from r3capture.store.slot_space import SlotSpace

_UINT8 = np.dtype(np.uint8)
Keys = KeyObjects | np.ndarray | Iterable[str]


class BlockObjectStoreError(RuntimeError):
    """A requested block is not in the store (it was evicted or never published)."""


def _check_int(name: str, value: object) -> int:
    if type(value) is int:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def _checked_sizes(
    max_bytes: object, object_nbytes: object, reserve_slots: object
) -> tuple[int, int, int]:
    """``(object_nbytes, num_slots, reserve_slots)`` of a new store, as ints; the error names
    the argument that is not a valid size."""
    max_bytes = _check_int("max_bytes", max_bytes)
    object_nbytes = _check_int("object_nbytes", object_nbytes)
    reserve_slots = _check_int("reserve_slots", reserve_slots)
    if object_nbytes <= 0:
        raise ValueError(f"object_nbytes must be a positive byte count, got {object_nbytes}")
    if max_bytes < object_nbytes:
        raise ValueError(
            f"max_bytes must hold at least one object (>= object_nbytes={object_nbytes}), "
            f"got {max_bytes}"
        )
    if reserve_slots < 0:
        raise ValueError(f"reserve_slots must be >= 0, got {reserve_slots}")
    return object_nbytes, max_bytes // object_nbytes, reserve_slots


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
        self.object_nbytes, num_slots, reserve_slots = _checked_sizes(
            max_bytes, object_nbytes, reserve_slots
        )
        self._room: SlotSpace | None = SlotSpace(
            num_slots, reserve_slots, object_nbytes, pin_memory=pin_memory, on_grow=on_grow
        )
        self._arena = self._room.arena
        self._pool = self._room.pool
        self._ledger = Ledger(num_slots, self._pool)

    def put(
        self,
        objects: Iterable[tuple[str, Any]],
        *,
        retain_keys: Keys = (),
        release_keys: Keys = (),
    ) -> None:
        """Publish ``(key, payload)`` pairs: vLLM key strings, bytes-like payloads of
        ``object_nbytes``.

        Within a batch the last payload of a repeated key wins. Retains apply before
        releases. Raises ``ValueError`` for a malformed key or a payload of the wrong size and
        ``KeyError`` for a release of a key without a reference; nothing changes in any case.
        """
        self._check_open()
        rows, blocks = objects_as_arrays(objects, self.object_nbytes)
        self._publish(key_objects(rows), blocks, retain_keys, release_keys)

    def get_concatenated(self, keys: Sequence[str]) -> bytes:
        """The blocks of ``keys`` joined in order, ``len(keys) * object_nbytes`` bytes."""
        return self.get_array(keys).tobytes()

    def put_array(
        self,
        keys: Keys,
        blocks: np.ndarray,
        *,
        retain_keys: Keys = (),
        release_keys: Keys = (),
    ) -> None:
        """Publish ``blocks[i]`` under ``keys[i]`` with one vectorised copy.

        ``blocks``: any dtype, C-contiguous, leading dimension ``len(keys)``, exactly
        ``len(keys) * object_nbytes`` bytes (e.g. ``[n, B, L, K]`` uint8). Same semantics as
        ``put``.
        """
        self._check_open()
        keys = as_key_objects(keys)
        blocks = as_blocks(blocks, len(keys), self.object_nbytes)
        self._publish(keys, blocks, retain_keys, release_keys)

    def get_array(self, keys: Keys, out: np.ndarray | None = None) -> np.ndarray:
        """Gather the blocks of ``keys`` into ``uint8 [len(keys), object_nbytes]`` in one copy.

        ``out``: optional C-contiguous destination of exactly ``len(keys) * object_nbytes``
        bytes, any dtype; the returned array is its ``uint8`` view. Refreshes the recency of
        the keys; raises ``BlockObjectStoreError`` if any key is missing.
        """
        self._check_open()
        keys = as_key_objects(keys)
        blocks = None
        if out is not None:
            blocks = as_blocks(out, len(keys), self.object_nbytes, name="out", writable=True)
        slots = self._slots_of(keys, touch=True)
        if blocks is None:
            return self._arena.np[slots]
        self.gather_into(slots, blocks)
        return blocks

    def gather_into(self, slots: np.ndarray, out: np.ndarray) -> None:
        """Copy arena rows ``slots`` (int64 ``[n]``) into ``out`` (uint8 ``[n, object_nbytes]``,
        C-contiguous). No bookkeeping: callers pass slots they looked up."""
        self._check_open()
        check_writable(out, "out")
        self._arena.gather(slots, out)

    def lookup_slots(self, keys: Keys, *, held: bool = False) -> np.ndarray:
        """Slots of ``keys`` as ``int64 [len(keys)]``; refreshes their recency like a read.

        ``held=True`` promises that the caller holds a reference on every key. Referenced keys
        are not in the recency order, so the refresh would change nothing and is skipped.
        Raises ``BlockObjectStoreError`` (naming the capacity) if any key is missing.
        """
        self._check_open()
        return self._slots_of(as_key_objects(keys), touch=not held)

    def allocate(self, n: int) -> np.ndarray:
        """Take ``n`` unbound slots (``int64 [n]``) from the producer reserve.

        Raises ``RuntimeError`` when fewer than ``n`` reserve slots are left.
        """
        self._check_open()
        n = _check_int("n", n)
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        return self._room.allocate(n)

    def bind(
        self,
        keys: Keys,
        slots: np.ndarray,
        *,
        retain_keys: Keys = (),
        release_keys: Keys = (),
        retain_first_keys: Keys = NO_KEY_OBJECTS,
    ) -> None:
        """Give unbound slot ``slots[i]`` (already written) the key ``keys[i]``.

        ``put`` semantics without a copy. Every given slot leaves the reserve; a slot whose
        key is kept (existing referenced key, or an earlier duplicate in the batch) or evicted
        at once is returned to the free pool.

        ``retain_first_keys``: retained before anything else, so that the call does what a
        ``bind`` of these retains alone followed by this call would (a caller's two calls in
        one), except that a failed release check leaves the store unchanged.
        """
        self._check_open()
        keys = as_key_objects(keys)
        given = self._pool.check_unbound(slots)
        if len(given) != len(keys):
            raise ValueError(
                f"slots: expected {len(keys)} slots for {len(keys)} keys, got {len(given)}"
            )
        admitted = self._admit(keys, retain_keys, release_keys, retain_first_keys)
        self._pool.settle(given)
        if len(admitted.keys) == len(given):
            used = given
        else:
            used = [given[i] for i in admitted.positions.tolist()]
            kept = set(used)
            self._pool.push([slot for slot in given if slot not in kept])
        self._ledger.assign(admitted.keys, used)

    def free(self, slots: np.ndarray) -> None:
        """Return unbound slots (``int64 [n]`` from ``allocate``) to the reserve."""
        self._check_open()
        given = self._pool.check_unbound(slots)
        self._pool.settle(given)
        self._pool.push(given)

    @property
    def num_slots(self) -> int:
        """Capacity for bound blocks (keys); grows when every key is referenced."""
        self._check_open()
        return self._room.num_slots

    @property
    def reserve_slots(self) -> int:
        """Physical slots for a producer's unbound blocks (``grow_reserve`` adds more)."""
        self._check_open()
        return self._room.reserve_slots

    @property
    def arena(self) -> torch.Tensor:
        """``torch.uint8 [num_slots + reserve_slots, object_nbytes]`` CPU tensor, replaced
        when the store grows."""
        self._check_open()
        return self._arena.tensor

    @property
    def arena_np(self) -> np.ndarray:
        """numpy view of ``arena``, replaced with it."""
        self._check_open()
        return self._arena.np

    @property
    def arena_version(self) -> int:
        """Incremented every time ``arena`` is replaced."""
        self._check_open()
        return self._arena.version

    @property
    def num_unbound(self) -> int:
        """Slots handed out by ``allocate`` and not yet bound or freed."""
        self._check_open()
        return self._pool.num_unbound

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` (a vLLM key string or one key row) is stored; a string that is not
        a key is not stored."""
        self._check_open()
        try:
            one = key_object(key)
        except ValueError:
            if isinstance(key, str):
                return False
            raise
        return self._ledger.slot_of(one) >= 0

    def __len__(self) -> int:
        """Number of bound blocks (keys)."""
        self._check_open()
        return self._ledger.num_stored

    def ref_count(self, key: str | np.ndarray) -> int:
        """References held on ``key`` (introspection; does not touch recency)."""
        self._check_open()
        return self._ledger.refs_of(key_object(key))

    def eviction_order(self) -> list[str]:
        """Unreferenced keys, next victim first (introspection; does not touch recency)."""
        self._check_open()
        return [key_string(row) for row in self._ledger.order()]

    def peek_slot(self, key: str | np.ndarray) -> int | None:
        """Slot of ``key`` or None (introspection; does not touch recency)."""
        self._check_open()
        slot = self._ledger.slot_of(key_object(key))
        return slot if slot >= 0 else None

    def close(self) -> None:
        """Release the arena. Idempotent; every later call raises ``RuntimeError``."""
        if self._arena is None:
            return
        self._room = self._arena = self._ledger = self._pool = None

    def _check_open(self) -> None:
        if self._arena is None:
            raise RuntimeError("auxiliary output store is closed")

    def _slots_of(self, keys: KeyObjects, *, touch: bool) -> np.ndarray:
        slots = self._ledger.lookup(keys, touch=touch)
        missing = slots < 0
        if np.count_nonzero(missing):
            key = key_object_string(keys[int(np.argmax(missing))])
            raise missing_key_error(key, len(self), self.num_slots, self.object_nbytes)
        return slots

    def _publish(
        self, keys: KeyObjects, blocks: np.ndarray, retain_keys: Keys, release_keys: Keys
    ) -> None:
        admitted = self._admit(keys, retain_keys, release_keys)
        m = len(admitted.keys)
        if not m:
            return
        if m != len(keys):
            blocks = blocks[admitted.positions]
        slots = self._pool.take(m).tolist()
        self._ledger.assign(admitted.keys, slots)
        self._arena.write(slots, blocks)

    def _admit(
        self,
        keys: KeyObjects,
        retain_keys: Keys,
        release_keys: Keys,
        retain_first_keys: Keys = NO_KEY_OBJECTS,
    ) -> Admission:
        """The ledger's admission of one publication, after which the arena has room for
        every stored key (it grows when every key is referenced)."""
        retains = as_key_objects(retain_keys, name="retain_keys")
        releases = as_key_objects(release_keys, name="release_keys")
        first = as_key_objects(retain_first_keys, name="retain_first_keys")
        ledger = self._ledger
        admitted = ledger.admit(keys, retains, releases, first)
        if ledger.num_stored > ledger.num_slots:
            self._grow(max(ledger.num_stored, 2 * ledger.num_slots))
        return admitted

    def grow_reserve(self, extra: int) -> None:
        """Add ``extra`` slots to the producer reserve, for a producer whose unbound slots
        outgrew the reserve it was sized with. The arena grows like it does for keys: a
        warning is logged, ``on_grow()`` is called before the old arena is copied, and
        ``arena``/``arena_np`` are replaced (``arena_version`` increments)."""
        self._check_open()
        extra = _check_int("extra", extra)
        if extra <= 0:
            raise ValueError(f"extra must be > 0, got {extra}")
        self._room.grow_reserve(extra)

    def _grow(self, num_slots: int) -> None:
        try:
            self._room.grow_keys(num_slots)
        except BaseException:
            # The bookkeeping already counts the new keys; without room for them the store
            # would hand out wrong bytes, so it fails closed.
            self.close()
            raise
        self._ledger.num_slots = num_slots


def key_object(key: object) -> bytes:
    """One key (a vLLM key string or a ``uint64 [KEY_WORDS]`` row) as a key object."""
    if isinstance(key, np.ndarray):
        if key.shape != (KEY_WORDS,):
            raise ValueError(f"key: expected one key row [{KEY_WORDS}], got {key.shape}")
        return as_key_objects(key.reshape(1, KEY_WORDS), name="key")[0]
    if not isinstance(key, str):
        raise TypeError(f"key: expected a key string or key row, got {type(key).__name__}")
    return as_key_objects([key], name="key")[0]


def as_blocks(
    array: np.ndarray,
    n: int,
    object_nbytes: int,
    name: str = "blocks",
    *,
    writable: bool = False,
) -> np.ndarray:
    """``array`` as ``uint8 [n, object_nbytes]`` without copying; ``ValueError`` naming
    ``name`` unless it is C-contiguous, numeric, with leading dimension ``n`` and exactly
    ``n * object_nbytes`` bytes. With ``writable`` (a destination) it must also be a numpy
    array that accepts writes: anything else would be written through a copy, or not at all."""
    if writable:
        check_writable(array, name)
    arr = np.asarray(array)
    if arr.dtype is _UINT8 and arr.ndim > 1 and arr.shape[0] == n > 0:
        if arr.flags.c_contiguous and arr.size == n * object_nbytes:
            return arr.reshape(n, object_nbytes)
    if arr.dtype.hasobject or not arr.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous numeric array, got {arr.dtype}")
    expected = n * object_nbytes
    if arr.nbytes != expected or arr.ndim == 0 or arr.shape[0] != n:
        raise ValueError(
            f"{name}: expected leading dimension {n} and {n} x {object_nbytes} = "
            f"{expected} bytes, got shape {arr.shape} {arr.dtype} ({arr.nbytes} bytes)"
        )
    return arr.reshape(-1).view(np.uint8).reshape(n, object_nbytes)


def check_writable(array: object, name: str) -> None:
    """``ValueError`` naming ``name`` unless ``array`` is a numpy array that accepts writes."""
    if not isinstance(array, np.ndarray):
        raise ValueError(f"{name}: expected a writable numpy array, got {type(array).__name__}")
    if not array.flags.writeable:
        raise ValueError(f"{name}: expected a writable numpy array, got a read-only one")


def missing_key_error(key: str, used: int, num_slots: int, object_nbytes: int) -> Exception:
    """vLLM's error type for a block that is not stored, saying which setting to raise."""
    return BlockObjectStoreError(
        f"auxiliary output object {key!r} does not exist; it may have been "
        f"evicted (used={used}, limit={num_slots} objects of "
        f"{object_nbytes} bytes). Raise the aux_output max_bytes, e.g. "
        f"--aux-output-config '{{\"max_bytes\": N}}' with N > "
        f"{num_slots * object_nbytes}, when a KV cache hit needs it."
    )


def objects_as_arrays(
    objects: Iterable[tuple[str, Any]], object_nbytes: int
) -> tuple[np.ndarray, np.ndarray]:
    """``put``'s ``(key string, payload)`` pairs as key rows and ``uint8 [n, object_nbytes]``
    blocks; ``ValueError`` naming the first malformed key or payload of the wrong size."""
    keys: list[str] = []
    payloads: list[memoryview] = []
    for i, (key, payload) in enumerate(objects):
        try:
            view = memoryview(payload)
        except TypeError:
            raise TypeError(
                f"objects[{i}] ({key!r}): payload must be bytes-like, got {type(payload).__name__}"
            ) from None
        if view.nbytes != object_nbytes:
            raise ValueError(
                f"objects[{i}] ({key!r}): payload has {view.nbytes} bytes, "
                f"expected object_nbytes={object_nbytes}"
            )
        keys.append(key)
        payloads.append(view)
    try:
        rows = key_rows_from_strings(keys)
    except ValueError as error:
        raise ValueError(f"objects: {error}") from None
    blocks = np.frombuffer(b"".join(payloads), dtype=np.uint8)
    return rows, blocks.reshape(len(keys), object_nbytes)
