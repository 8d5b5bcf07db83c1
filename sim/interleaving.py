"""A deterministic output thread: ``process_output`` calls run where a seed puts them.

In vLLM, ``process_output`` of step N runs on the output thread once its copy completes,
so it may come before, between or after the step thread's calls for the steps after N.
The simulator's threaded mode leaves that order to the OS scheduler: a run shows one
order, and which one cannot be chosen again. ``DrawnInterleaving`` stands in for the output
thread on the step thread: each queued ``process_output`` runs, in step order, at a call
boundary the seed draws (before a ``begin_step``, ``prepare_output`` or
``enqueue_cpu_copy``), and at the latest when the engine needs its result. Two workers run
with one seed see the same order of whole calls, the order a worker that holds one lock
per call can see, so their results can be compared step for step, errors included.
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Callable
from typing import Any

import numpy as np

# How readily a queued call runs at a boundary: from an output thread that lags (most calls
# run when the engine needs them) to one that runs each call as soon as it is queued.
EAGERNESS = (0.1, 0.5, 0.9)


class DrawnInterleaving:
    """Queued ``process_output`` calls, run on the calling thread at drawn call boundaries.

    Args:
        seed: draws the eagerness (one of ``EAGERNESS``) and, at each boundary, how many
            queued calls run there.
    """

    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)
        self.eagerness = float(self._rng.choice(EAGERNESS))
        self._queue: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            collections.deque()
        )

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Queue ``fn`` (a step's ``process_output``); its future resolves when it runs."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.append((fn, future))
        return future

    def boundary(self) -> None:
        """A step-thread call is about to start: run none, some or all queued calls first."""
        while self._queue and self._rng.random() < self.eagerness:
            self._run_oldest()

    def run_through(self, future: concurrent.futures.Future) -> None:
        """Run queued calls, oldest first, until ``future``'s has run."""
        while not future.done():
            self._run_oldest()

    def shutdown(self, wait: bool = True) -> None:
        """Nothing to stop (the executor interface the runner also uses for threads)."""

    def _run_oldest(self) -> None:
        fn, future = self._queue.popleft()
        try:
            future.set_result(fn())
        except Exception as exc:
            future.set_exception(exc)
