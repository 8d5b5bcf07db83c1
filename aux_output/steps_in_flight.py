"""Steps launched and not yet settled, and the teardown of requests that finish under them.

As in vLLM, a finished request is torn down once no step in flight covers it: at once when
none does, else when the last one that does settles. ``StepsInFlight`` keeps the launched
steps' layouts, oldest first, and which finished requests wait for one of them.

A request preempted (vLLM's scheduler reports a preemption as a finish) and scheduled again
while a step of its earlier run is in flight gets a new row. The scheduler treats it as a
new request: its emit start, its block hashes sent again from block 0, its first step at its
prefix hit. The earlier run's row lives on, unnamed, until its steps settle. vLLM 0.33.0's
scheduler resumes a request that early only with a KV connector whose hand-off must be
delivered, and the worker can meet it only with three or more steps in flight (pipeline
parallelism, which vLLM's own backend refuses with routed experts); vLLM's worker keeps the
earlier run's state there and fails the resumed run's capture or returns other blocks' rows
(``tests/aux_output/test_resumed_requests.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from r3capture.aux_output.request_table import RequestTable
from r3capture.aux_output.step_commit import StepLayout


class StepsInFlight:
    """The layouts of launched steps not yet settled, oldest first, for one request table."""

    def __init__(self, table: RequestTable) -> None:
        self._table = table
        self.layouts: list[StepLayout] = []
        # Finished requests whose teardown waits for a step in flight.
        self._deferred = 0
        # All False between calls of ``covers``, which marks and unmarks rows in flight
        # (a set-membership test without np.isin's sorts).
        self._marks = np.zeros(0, bool)

    def __len__(self) -> int:
        return len(self.layouts)

    def add(self, layout: StepLayout) -> None:
        self.layouts.append(layout)

    @property
    def has_deferred(self) -> bool:
        """Whether a finished request's teardown waits for a step in flight."""
        return self._deferred > 0

    def rows(self) -> np.ndarray:
        """Table rows of every request with a step in flight (int64, with repeats)."""
        if not self.layouts:
            return np.empty(0, np.int64)
        return np.concatenate([layout.rows for layout in self.layouts])

    def covers(self, rows: np.ndarray) -> np.ndarray:
        """Which of ``rows`` (int64 table rows) have a step in flight (bool, aligned)."""
        marks = self._marks
        if len(marks) < self._table.capacity:
            marks = self._marks = np.zeros(self._table.capacity, bool)
        in_flight = self.rows()
        marks[in_flight] = True
        covered = marks[rows]
        marks[in_flight] = False
        return covered

    def finish(self, request_ids: Iterable[str]) -> list[str]:
        """Mark ``request_ids`` finished; returns those no step in flight covers, to tear
        down now (the others are torn down by ``settle``)."""
        table = self._table
        in_flight: set[int] = set()
        for layout in self.layouts:
            in_flight.update(layout.rows.tolist())
        now = []
        for request_id in request_ids:
            row = table.index[request_id]
            table.mark_finished(row)
            if row in in_flight:
                self._deferred += 1
            else:
                now.append(request_id)
        return now

    def detach_resumed(self, requests: dict[str, int], rows: np.ndarray) -> bool:
        """Detach the rows of scheduled ``requests`` (their rows: ``rows``, int64 ``[R]``)
        that finished under a step still in flight, so that adding them again gives them
        new rows; whether there were any."""
        if not self._deferred:
            return False
        table = self._table
        resumed = table.finished[rows].nonzero()[0]
        if not resumed.size:
            return False
        request_ids = list(requests)
        for i in resumed.tolist():
            table.detach(request_ids[i])
        return True

    def settle(self, layout: StepLayout, *, teardown: bool) -> tuple[list[str], list[int]]:
        """``layout``'s step leaves flight. With ``teardown``, returns the requests (ids and
        rows) that finished while it was in flight and that no other step covers: to tear
        down now, by row (a resumed request's id names its new row)."""
        self.layouts.remove(layout)
        if not teardown or not self._deferred:
            return [], []
        rows = layout.rows
        done = (self._table.finished[rows] & ~self.covers(rows)).nonzero()[0]
        if not done.size:
            return [], []
        self._deferred -= len(done)
        return [layout.request_ids[i] for i in done.tolist()], rows[done].tolist()
