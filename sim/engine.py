"""Engine-free simulator: a mini vLLM scheduler + model runner driving the capture connectors.

It follows vLLM 0.33.0's call order for the auxiliary-output connector exactly:

  schedule():  max_cache_hit / cap_external_hit / request_loading on prefix lookups,
               request_finished on preemption, then build_connector_meta
  execute:     worker.begin_step(meta) (also on steps with no tokens), write the oracle's
               int32 rows into the worker's capture buffer, worker.prepare_output(batch),
               pending.enqueue_cpu_copy(num_sampled=, num_rejected=) with arrays that are
               only filled in before process_output (as vLLM's async copies are)
  later, in step order: pending.process_output() -> update_from_output: rejected drafts
               roll back num_computed_tokens, tokens are appended (stop trimming), then
               take_output for each request that emits, request_finished on stops/aborts
  reset:       after draining in-flight steps, preempt every running request, reset the KV
               prefix cache, then the scheduler connector's reset()

Scheduler side (what vLLM's scheduler keeps): num_computed_tokens advances when scheduled;
under async scheduling (``max_concurrent_batches=2``) output placeholders and draft
placeholders make the next schedule optimistic: a decode step is scheduled with 1 + k
tokens before the previous step's rejections are known. Model-runner side (what the GPU
knows): the true positions, corrected by every rejection, and the sampled tokens. The batch
passed to the worker carries the scheduler's ``num_computed_tokens_np`` and the true
``positions``, as MRV2's InputBatch does.

Every finished request's concatenated ``take_output`` rows are checked against the routing
oracle's rows of its final token sequence (``SimResult.check_ground_truth``).

Layout: ``scheduling.SimScheduler`` (queues, KV cache, the scheduler connector; waiting
requests enter through ``admission.WaitingAdmission``),
``model_runner.SimModelRunner`` (the GPU side and the worker connector's calls),
``records`` (what they share), and ``SimEngine`` here, which steps the two in vLLM's order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from sim.kv import KVCacheDouble
from sim.model_runner import SimModelRunner
from sim.records import (
    FINISHED_ABORTED,
    FINISHED_STOPPED,
    InFlight,
    SimError,
    SimRequest,
    SimResult,
    SimStats,
    StepRecord,
)
from sim.scheduling import SimScheduler
from sim.trace import Trace
from sim.workers import WorkerHandle, WorkerSizing, make_vllm_worker

SchedulerFactory = Callable[[KVCacheDouble, Any], Any]


def r3capture_scheduler(kv: KVCacheDouble, kv_connector: Any) -> Any:
    from sim.scheduler import SchedulerConnector

    return SchedulerConnector(kv, kv_connector)


def vllm_scheduler(kv: KVCacheDouble, kv_connector: Any) -> Any:
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    return AuxOutputSchedulerConnector(kv, kv_connector)


def replay_scheduler(
    default: bool = True, inner: SchedulerFactory = vllm_scheduler
) -> SchedulerFactory:
    """Scheduler factory: ``inner``'s connector wrapped as r3capture wraps vLLM's under
    ``--aux-output-backend triton`` (``replay.ReplaySchedulerConnector``: opted-out requests
    get no rows), ``default`` being the engine's ``--aux-output-replay-default``."""

    def build(kv: KVCacheDouble, kv_connector: Any) -> Any:
        from r3capture.aux_output.replay import ReplaySchedulerConnector

        return ReplaySchedulerConnector(inner(kv, kv_connector), default=default)

    return build


class SimEngine:
    """Runs one trace through one scheduler connector and one worker connector."""

    def __init__(
        self,
        trace: Trace,
        worker: WorkerHandle,
        *,
        scheduler_factory: SchedulerFactory = r3capture_scheduler,
        threaded: bool = False,
        interleave_seed: int | None = None,
        record_metas: bool = False,
    ) -> None:
        self.trace = trace
        cfg = trace.config
        kv = KVCacheDouble(
            num_blocks=cfg.num_gpu_blocks,
            block_size=cfg.block_size,
            hash_block_size=cfg.hash_block_size,
            offload_blocks=cfg.offload_blocks,
        )
        kv_connector = object() if cfg.offload_blocks or cfg.remote_prefill else None
        # One random stream, drawn in the engine's call order (drafts, acceptances, padding).
        rng = np.random.default_rng([trace.seed, 0x5EC])
        self.result = SimResult(trace, worker.name)
        self.scheduler = SimScheduler(
            trace,
            kv,
            scheduler_factory(kv, kv_connector),
            rng,
            self.result,
            record_metas=record_metas,
        )
        self.runner = SimModelRunner(
            trace, worker, rng, self.result, threaded=threaded, interleave_seed=interleave_seed
        )
        self.inflight: deque[InFlight] = deque()

    def run(self, *, catch_errors: bool = False) -> SimResult:
        try:
            self._run()
        except Exception as exc:
            if not catch_errors:
                raise
            if self.result.error is None:
                self.result.error = SimError(self.scheduler.step_index, "engine", exc)
        finally:
            self.runner.shutdown()
        return self.result

    def _run(self) -> None:
        scheduler, stats = self.scheduler, self.result.stats
        limit = self.trace.config.max_concurrent_batches
        while True:
            scheduler.arrive()
            scheduler.abort()
            if scheduler.step_index in self.trace.reset_steps:
                self._drain()
                scheduler.reset_prefix_cache()
            stepped = None
            if scheduler.requests or scheduler.terminal_pending:
                stepped = self.runner.execute(scheduler.schedule(), scheduler.requests)
            if stepped is not None:
                self.inflight.append(stepped)
                stats.max_in_flight = max(stats.max_in_flight, len(self.inflight))
            if self.inflight and (len(self.inflight) >= limit or stepped is None):
                self._process(self.inflight.popleft())
            if scheduler.done and not self.inflight:
                return
            scheduler.step_index += 1
            if scheduler.step_index > self.trace.max_steps:
                raise RuntimeError(
                    f"trace {self.trace.name} did not finish in {self.trace.max_steps} steps"
                )

    def _drain(self) -> None:
        while self.inflight:
            self._process(self.inflight.popleft())

    def _process(self, step: InFlight) -> None:
        self.scheduler.processed_step = step.index
        output = self.runner.process(step, self.scheduler.step_index)
        self.scheduler.update_from_output(step, output)


def default_max_bytes(trace: Trace) -> int:
    """vLLM's default store size: the GPU KV blocks' worth of hash blocks of rows."""
    cfg = trace.config
    block_nbytes = cfg.hash_block_size * trace.model.row_nbytes
    return cfg.num_gpu_blocks * (cfg.block_size // cfg.hash_block_size) * block_nbytes


def worker_sizes(trace: Trace) -> WorkerSizing:
    cfg = trace.config
    return WorkerSizing.for_model(
        num_layers=trace.model.num_layers,
        top_k=trace.model.top_k,
        num_experts=trace.model.num_experts,
        hash_block_size=cfg.hash_block_size,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_concurrent_batches=cfg.max_concurrent_batches,
        max_bytes=cfg.max_bytes if cfg.max_bytes is not None else default_max_bytes(trace),
    )


def run_trace(
    trace: Trace,
    worker_factory: Callable[[WorkerSizing], WorkerHandle] = make_vllm_worker,
    *,
    scheduler_factory: SchedulerFactory = r3capture_scheduler,
    threaded: bool = False,
    interleave_seed: int | None = None,
    record_metas: bool = False,
    catch_errors: bool = False,
    check: bool = True,
) -> SimResult:
    """Run ``trace`` through a fresh worker from ``worker_factory``; with ``check`` (and no
    error) verify every request's rows against the oracle. ``catch_errors`` records the
    first error (step, phase, exception) in ``result.error`` instead of raising.
    ``process_output`` runs on an output thread with ``threaded``; with ``interleave_seed``,
    on the step thread at the call boundaries the seed draws (``sim.interleaving``);
    otherwise when the engine needs its result."""
    handle = worker_factory(worker_sizes(trace))
    try:
        engine = SimEngine(
            trace,
            handle,
            scheduler_factory=scheduler_factory,
            threaded=threaded,
            interleave_seed=interleave_seed,
            record_metas=record_metas,
        )
        result = engine.run(catch_errors=catch_errors)
    finally:
        handle.close()
    if check and result.error is None:
        result.check_ground_truth()
    return result


__all__ = [
    "FINISHED_ABORTED",
    "FINISHED_STOPPED",
    "SimEngine",
    "SimError",
    "SimRequest",
    "SimResult",
    "SimStats",
    "StepRecord",
    "default_max_bytes",
    "r3capture_scheduler",
    "replay_scheduler",
    "run_trace",
    "vllm_scheduler",
    "worker_sizes",
]
