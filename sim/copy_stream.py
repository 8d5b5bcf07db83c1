"""vLLM's asynchronous output copy, as the simulator's model runner needs it on a GPU.

Model Runner V2 (``async_utils.AsyncOutput``) makes its copy stream wait for the main
stream, calls ``enqueue_cpu_copy`` with that stream current, records a blocking CUDA event
on it, and synchronizes that event on the output thread before ``process_output``. A worker
connector relies on that event alone to know its device-to-host copies (and, for direct
writes, its kernel) have finished. ``OutputCopies`` does the same for a capture buffer on a
CUDA device and nothing on a CPU, where every copy is done when the call returns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class OutputCopies:
    """Runs ``enqueue_cpu_copy`` the way vLLM's engine does for ``device``."""

    def __init__(self, device: torch.device) -> None:
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def enqueue(self, enqueue: Callable[[], Any]) -> torch.cuda.Event | None:
        """Call ``enqueue`` on the copy stream once it has waited for the main stream; the
        event to synchronize before the step's ``process_output`` (None on a CPU)."""
        stream = self._stream
        if stream is None:
            enqueue()
            return None
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            enqueue()
        event = torch.cuda.Event(blocking=True)
        event.record(stream)
        return event

    @staticmethod
    def after(event: torch.cuda.Event | None, process: Callable[[], Any]) -> Callable[[], Any]:
        """``process`` preceded by the wait for ``event`` (the output thread's order)."""
        if event is None:
            return process

        def run() -> Any:
            event.synchronize()
            return process()

        return run
