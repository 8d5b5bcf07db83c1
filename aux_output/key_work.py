"""A step's key work, off the thread that launches the forward.

What ``begin_step`` learns about keys (new block hashes of running requests, the scheduler's
pins) is needed by nothing the next launch does: only publication, prefix-cache reads and
teardown use keys, and those run in ``process_output``. So ``RequestBook.begin`` records it
(``StepKeyWork``) and ``KeyWorkQueue`` applies it, in step order, first thing in the next
commit on the output thread, or at once when a prefix-cache reset needs every key. The
teardown of requests that finish with no step in flight is recorded the same way: their
keys are released and their slots freed in step order, off the main thread (at once only
when a launch runs short of reserve slots, or a finished id is named again). Applying
a step's work makes the same store call ``begin_step`` would have made, so the store sees
vLLM 0.33.0's sequence of calls.
"""

from __future__ import annotations

from typing import Any

from r3capture.aux_output.publisher import Publisher, join_keys
from r3capture.aux_output.request_table import RequestTable
from r3capture.aux_output.types import key_objects_of, key_objects_of_requests
from r3capture.store import NO_KEY_OBJECTS, KeyObjects


class StepKeyWork:
    """One step's key work: ``hashes[i]`` (packed block hashes) of table row ``rows[i]`` in
    ``generation``; the scheduler's pins (packed, or None) in ``pin_generation``;
    ``releases``: keys (``KeyObjects``) released at once (a reset's); ``finishing``:
    requests to tear down. Packed hashes hold immutable bytes, so keeping the objects keeps
    the hashes as the scheduler sent them."""

    __slots__ = (
        "pins_retained",
        "pins_released",
        "pin_generation",
        "rows",
        "hashes",
        "generation",
        "releases",
        "finishing",
    )

    def __init__(self, pins_retained: Any, pins_released: Any, pin_generation: int) -> None:
        self.pins_retained = pins_retained if _has_hashes(pins_retained) else None
        self.pins_released = pins_released if _has_hashes(pins_released) else None
        self.pin_generation = pin_generation
        self.rows: list[int] = []
        self.hashes: list[Any] = []
        self.generation = pin_generation
        self.releases: list[KeyObjects] = []
        self.finishing: list[str] = []


class KeyWorkQueue:
    """Recorded ``StepKeyWork``, applied in order to the request table and the publisher."""

    def __init__(self, table: RequestTable, publisher: Publisher) -> None:
        self._table = table
        self._publisher = publisher
        self._queued: list[StepKeyWork] = []
        # Requests whose teardown is recorded and not yet applied: gone for the scheduler.
        self.tearing_down: set[str] = set()

    def record(self, work: StepKeyWork) -> None:
        self._queued.append(work)
        if work.finishing:
            self.tearing_down.update(work.finishing)

    def add_step(
        self,
        metadata: Any,
        *,
        pin_generation: int,
        hash_rows: list[int] | None,
        generation: int,
        finishing: list[str],
        reset_releases: KeyObjects | None,
    ) -> None:
        """Record ``begin_step``'s key work: the packed hashes of ``metadata.block_hashes``
        for table rows ``hash_rows`` in ``generation``, its pins in ``pin_generation``, the
        requests ``finishing``. With a reset's ``reset_releases`` the work is applied now,
        after all recorded before it. A step without key work (a decode step where no
        request completes a block) records nothing, keeping that cost off the main thread."""
        retained, released = metadata.retained_block_hashes, metadata.released_block_hashes
        if reset_releases is None and not (
            hash_rows or finishing or _has_hashes(retained) or _has_hashes(released)
        ):
            return
        work = StepKeyWork(retained, released, pin_generation)
        if hash_rows:
            work.rows = hash_rows
            work.hashes = list(metadata.block_hashes.values())
            work.generation = generation
        work.finishing = finishing
        if reset_releases is None:
            self.record(work)
            return
        work.releases.append(reset_releases)
        self.apply_all()
        self.apply(work)

    def apply_all(self) -> None:
        """Apply the work of every step recorded since the last call, oldest first."""
        queued, self._queued = self._queued, []
        for work in queued:
            self.apply(work)
        self.tearing_down.clear()

    def apply_teardown(self) -> bool:
        """Apply the recorded work now if it tears requests down (their slots return to the
        store's reserve); whether it did."""
        if not self.tearing_down:
            return False
        self.apply_all()
        return True

    def apply(self, work: StepKeyWork) -> None:
        """One step's work: its new keys join their requests, and one store call is queued:
        bind the blocks now complete and keyed, retain the pins and the new keys, release
        the released pins, the reset's keys and the finished requests' keys; then the
        finished requests are torn down."""
        retains = NO_KEY_OBJECTS
        if work.rows:
            retains, counts = key_objects_of_requests(work.hashes, work.generation)
            self._table.add_keys(work.rows, retains, counts)
        releases = NO_KEY_OBJECTS
        if work.pins_retained is not None:
            # The requests' keys before the pins: of equal keys the store keeps the first
            # object it meets, and the table's are those later calls hand back. (Retains
            # commute.)
            retains = join_keys((retains, key_objects_of(work.pins_retained, work.pin_generation)))
        if work.pins_released is not None or work.releases:
            releases = join_keys(
                (key_objects_of(work.pins_released, work.pin_generation), *work.releases)
            )
        self._publisher.publish(work.rows, retains, releases, finished=work.finishing)


def _has_hashes(packed: Any) -> bool:
    """Whether packed block hashes (or None) hold any hash."""
    return packed is not None and len(packed.data) > 0
