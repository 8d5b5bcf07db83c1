"""The store's room: how many slots it has for keyed blocks and for a producer, and growing it.

A store of ``num_slots`` keys and ``reserve_slots`` producer slots holds one arena of
``num_slots + reserve_slots`` physical slots (``Arena``) and one account of which are free or
unbound (``SlotPool``). The two always have the same size: ``grow_keys`` and
``grow_reserve`` replace the arena with a larger copy and extend the pool together, and
log why the store grew.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from r3capture.store.arena import Arena
from r3capture.store.slot_pool import SlotPool

logger = logging.getLogger(__name__)


class SlotSpace:
    """``num_slots`` keyed and ``reserve_slots`` producer slots of ``object_nbytes`` each
    (ints, already checked): the ``arena`` that holds their bytes and the ``pool`` of free
    and unbound slots. Both grow in place and are never rebound, so an owner may keep
    references to them. ``pin_memory``/``on_grow``: as ``Arena`` takes them."""

    def __init__(
        self,
        num_slots: int,
        reserve_slots: int,
        object_nbytes: int,
        *,
        pin_memory: bool,
        on_grow: Callable[[], None] | None,
    ) -> None:
        self.num_slots = num_slots
        self.reserve_slots = reserve_slots
        self.object_nbytes = object_nbytes
        physical = num_slots + reserve_slots
        self.arena = Arena(physical, object_nbytes, pin_memory=pin_memory, on_grow=on_grow)
        self.pool = SlotPool(physical)

    def allocate(self, n: int) -> np.ndarray:
        """``n`` (an int >= 0) unbound slots, ``int64 [n]``, from the producer reserve;
        ``RuntimeError`` when the producer would then hold more than the reserve."""
        if self.pool.num_unbound + n > self.reserve_slots:
            raise RuntimeError(
                f"allocate({n}): the producer reserve of reserve_slots={self.reserve_slots} "
                f"slots is exhausted ({self.pool.num_unbound} unbound); bind or free slots "
                "first or raise reserve_slots"
            )
        return self.pool.allocate(n)

    def grow_keys(self, num_slots: int) -> None:
        """Room for ``num_slots`` keys (more than now): every key is referenced."""
        self._warn(self.num_slots, num_slots, "objects", "every object is referenced")
        self._replace(num_slots, self.reserve_slots)

    def grow_reserve(self, extra: int) -> None:
        """``extra`` (an int > 0) more producer slots."""
        self._warn(
            self.reserve_slots,
            self.reserve_slots + extra,
            "slots",
            "the producer holds more unbound slots than it was sized for",
            what="reserve ",
        )
        self._replace(self.num_slots, self.reserve_slots + extra)

    def _replace(self, num_slots: int, reserve_slots: int) -> None:
        """A larger arena of ``num_slots + reserve_slots`` slots, every slot's bytes kept."""
        self.arena.grow(num_slots + reserve_slots)
        self.num_slots, self.reserve_slots = num_slots, reserve_slots
        self.pool.grow(num_slots + reserve_slots)

    def _warn(self, old: int, new: int, unit: str, cause: str, *, what: str = "") -> None:
        logger.warning(
            "auxiliary output store %sgrows from %d to %d %s (%d bytes): %s",
            what,
            old,
            new,
            unit,
            new * self.object_nbytes,
            cause,
        )
