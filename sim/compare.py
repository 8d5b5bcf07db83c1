"""Differential helpers: run two connectors on the same inputs and report the first
difference (scheduler calls compared call by call; worker runs compared step by step)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from typing import Any

import numpy as np

from sim.engine import SimResult, StepRecord, run_trace, vllm_scheduler
from sim.trace import Trace
from sim.workers import make_vllm_worker


class ConnectorMismatch(AssertionError):
    """Two connectors answered the same call differently."""


def _packed(value: Any) -> tuple[bytes, int] | None:
    return None if value is None else (bytes(value.data), int(value.item_size))


def normalize_meta(meta: Any) -> tuple:
    """Plain, order-preserving form of AuxOutputConnectorMetadata for equality checks."""
    return (
        int(meta.generation),
        tuple((k, int(v)) for k, v in meta.requests.items()),
        tuple((k, _packed(v)) for k, v in meta.block_hashes.items()),
        tuple(meta.finished_requests),
        _packed(meta.retained_block_hashes),
        _packed(meta.released_block_hashes),
    )


def same_error(reference: BaseException | None, candidate: BaseException | None) -> bool:
    """Both absent, or the same kind: equal class names (each package has its own
    BlockObjectStoreError) or the candidate is an instance of the reference's class
    (a protocol-error subclass of vLLM's AssertionError)."""
    if reference is None or candidate is None:
        return reference is candidate
    return type(reference).__name__ == type(candidate).__name__ or isinstance(
        candidate, type(reference)
    )


class TeeSchedulerConnector:
    """Forwards every scheduler-connector call to ``primary`` (whose answer the engine
    uses) and ``shadow``, and raises ConnectorMismatch when answers or errors differ."""

    def __init__(self, primary: Any, shadow: Any) -> None:
        self.primary = primary
        self.shadow = shadow
        self.calls: dict[str, int] = {}

    def _both(self, name: str, args: tuple, normalize: Callable[[Any], Any] = lambda x: x) -> Any:
        self.calls[name] = self.calls.get(name, 0) + 1
        errors: list[BaseException | None] = []
        results = []
        for connector in (self.primary, self.shadow):
            try:
                results.append(getattr(connector, name)(*args))
                errors.append(None)
            except Exception as exc:  # noqa: BLE001 - compared below, then re-raised
                results.append(None)
                errors.append(exc)
        if not same_error(errors[0], errors[1]):
            raise ConnectorMismatch(f"{name}: errors differ: {errors[0]!r} vs {errors[1]!r}")
        if errors[0] is not None:
            raise errors[0]
        left, right = normalize(results[0]), normalize(results[1])
        if not _equal(left, right):
            raise ConnectorMismatch(f"{name} #{self.calls[name]}: {left!r} != {right!r}")
        return results[0]

    def build_connector_meta(self, scheduler_output: Any, requests: Any) -> Any:
        return self._both("build_connector_meta", (scheduler_output, requests), normalize_meta)

    def max_cache_hit(self, request: Any) -> int:
        return self._both("max_cache_hit", (request,))

    def cap_external_hit(self, request: Any, num_local: int, num_external: int) -> int:
        return self._both("cap_external_hit", (request, num_local, num_external))

    def request_loading(self, request: Any, num_tokens: int) -> None:
        self._both("request_loading", (request, num_tokens))

    def take_output(self, request: Any, output: Any) -> np.ndarray | None:
        return self._both("take_output", (request, output), _rows_key)

    def request_finished(self, request: Any) -> None:
        self._both("request_finished", (request,))

    def reset(self) -> None:
        self._both("reset", ())


def _rows_key(rows: np.ndarray | None) -> Any:
    if rows is None:
        return None
    return (rows.dtype.str, rows.shape, rows.tobytes())


def _equal(a: Any, b: Any) -> bool:
    return bool(a == b)


def diff_results(reference: SimResult, candidate: SimResult) -> str | None:
    """First difference between two runs of one trace (per-step worker outputs, then the
    error: step, phase and kind), or None when they agree byte for byte."""
    for a, b in zip(reference.steps, candidate.steps):
        if a.req_ids != b.req_ids:
            return f"step {a.index}: batches differ: {a.req_ids} vs {b.req_ids}"
        if a.outputs.keys() != b.outputs.keys():
            return (
                f"step {a.index}: output requests differ: {sorted(a.outputs)} vs "
                f"{sorted(b.outputs)}"
            )
        for req_id, left in a.outputs.items():
            right = b.outputs[req_id]
            if left[:3] != right[:3]:
                return (
                    f"step {a.index} {req_id}: (token_start, dtype, shape) "
                    f"{left[:3]} vs {right[:3]}"
                )
            if left[3] != right[3]:
                return f"step {a.index} {req_id}: rows differ (token_start {left[0]})"
    ra, rb = reference.error, candidate.error
    if len(reference.steps) != len(candidate.steps) and (ra is None) == (rb is None):
        return f"processed steps differ: {len(reference.steps)} vs {len(candidate.steps)}"
    if (ra is None) != (rb is None):
        left = ra and (ra.step, ra.phase, ra.exc)
        right = rb and (rb.step, rb.phase, rb.exc)
        return f"errors differ: {left!r} vs {right!r}"
    if ra is not None and rb is not None:
        if (ra.step, ra.phase) != (rb.step, rb.phase) or not same_error(ra.exc, rb.exc):
            return (
                f"errors differ: step {ra.step} {ra.phase} {ra.kind}: {ra.exc} vs "
                f"step {rb.step} {rb.phase} {rb.kind}: {rb.exc}"
            )
    return None


def run_vllm_all_opted_in(trace: Trace) -> SimResult:
    """``trace`` through vLLM 0.33.0's scheduler connector and worker with every request
    wanting its rows (vLLM has no per-request switch): what ``diff_opted_in`` compares a run
    of ``trace`` with. Errors caught, nothing checked."""
    return run_trace(
        trace.all_opted_in(),
        make_vllm_worker,
        scheduler_factory=vllm_scheduler,
        catch_errors=True,
        check=False,
    )


def diff_opted_in(
    reference: SimResult, candidate: SimResult, opted_out: Collection[str]
) -> str | None:
    """First difference between a run of a trace where every request wants its rows
    (``reference``) and a run of it where ``opted_out`` want none (``candidate``), or None
    when: every step's batch is the same, its outputs are the reference's less those of
    ``opted_out`` (which get none) and byte-identical, every request's ``take_output``
    rows and final tokens are the reference's, and ``opted_out`` got no rows at all."""
    opted_out = frozenset(opted_out)
    steps = [
        StepRecord(
            step.index,
            step.req_ids,
            {k: v for k, v in step.outputs.items() if k not in opted_out},
        )
        for step in reference.steps
    ]
    diff = diff_results(dataclasses.replace(reference, steps=steps), candidate)
    if diff is not None:
        return diff
    for req_id in sorted(opted_out & candidate.emitted.keys()):
        return f"{req_id} opted out of rows but got {len(candidate.emitted[req_id])} chunks"
    if reference.final_tokens != candidate.final_tokens:
        return "final tokens differ"
    for req_id, chunks in reference.emitted.items():
        if req_id in opted_out:
            continue
        got = [(start, rows.tobytes()) for start, rows in candidate.emitted.get(req_id, [])]
        if got != [(start, rows.tobytes()) for start, rows in chunks]:
            return f"{req_id}: take_output rows differ"
    return None


def only_reference_fails(reference: SimResult, candidate: SimResult) -> bool:
    """Whether two runs of one trace that ``diff_results`` tells apart differ because the
    reference failed: the candidate ran clean with every row the routing oracle's, and the
    reference raised or returned some other row. vLLM 0.33.0's worker does either for a
    request resumed after a preemption while a step of its earlier run is in flight
    (``tests/aux_output/test_resumed_requests.py``); r3capture does not follow it there."""
    if candidate.error is not None:
        return False
    try:
        candidate.check_ground_truth()
    except AssertionError:
        return False
    if reference.error is not None:
        return True
    try:
        reference.check_ground_truth()
    except AssertionError:
        return True
    return False


def tee_factory(
    primary: Callable[[Any, Any], Any], shadow: Callable[[Any, Any], Any]
) -> Callable[[Any, Any], TeeSchedulerConnector]:
    """Scheduler factory for ``run_trace`` that builds both connectors on the same KV
    cache manager and compares them call by call."""
    return lambda kv, kv_connector: TeeSchedulerConnector(
        primary(kv, kv_connector), shadow(kv, kv_connector)
    )


__all__ = [
    "ConnectorMismatch",
    "TeeSchedulerConnector",
    "diff_opted_in",
    "diff_results",
    "normalize_meta",
    "only_reference_fails",
    "run_vllm_all_opted_in",
    "same_error",
    "tee_factory",
]
