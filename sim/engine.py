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
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from sim.kv import KVCacheDouble, block_hashes_for
from sim.oracle import SEED, RoutingOracle, prefix_hashes
from sim.trace import VOCAB, RequestSpec, Trace
from sim.workers import WorkerHandle, WorkerSizing, make_vllm_worker

WAITING = "waiting"
RUNNING = "running"
PREEMPTED = "preempted"
LOADING = "loading"
FINISHED_STOPPED = "finished_stopped"
FINISHED_ABORTED = "finished_aborted"
_FINISHED = (FINISHED_STOPPED, FINISHED_ABORTED)


class SimRequest:
    """Scheduler-side request with the attributes the scheduler connectors read."""

    def __init__(self, spec: RequestSpec, hash_block_size: int) -> None:
        self.spec = spec
        self.request_id = spec.req_id
        self.prompt_token_ids = list(spec.prompt)
        self.all_token_ids = list(spec.prompt)
        self.hash_block_size = hash_block_size
        self.block_hashes: list[bytes] = block_hashes_for(self.all_token_ids, hash_block_size)
        self.sampling_params = SimpleNamespace(routed_experts_prompt_start=spec.prompt_start)
        self.max_tokens = spec.max_tokens
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.spec_token_ids: list[int] = []
        self.status = WAITING
        self.num_in_flight_tokens = 0
        self.num_stale_output_tokens = 0
        self.drop_stale_output = False
        self.load_ready_step = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    def is_finished(self) -> bool:
        return self.status in _FINISHED

    def append_output_token(self, token: int) -> None:
        self.all_token_ids.append(token)
        if len(self.all_token_ids) % self.hash_block_size == 0:
            self.block_hashes.extend(
                block_hashes_for(self.all_token_ids, self.hash_block_size, self.block_hashes)
            )


class _GpuRequest:
    """Model-runner view: every token sampled so far and the true computed count."""

    def __init__(self, tokens: list[int], computed: int) -> None:
        self.tokens = tokens
        self.computed = computed
        self._hashes = np.empty(0, np.uint64)

    def hash_before(self, position: int) -> int:
        """Rolling prefix hash of tokens[:position] (SEED for position 0)."""
        if position == 0:
            return SEED
        if len(self._hashes) < position:
            have = len(self._hashes)
            prev = SEED if have == 0 else int(self._hashes[-1])
            ext = prefix_hashes(np.asarray(self.tokens[have:position], np.int64), prev)
            self._hashes = np.concatenate([self._hashes, ext])
        return int(self._hashes[position - 1])


@dataclass
class SimStats:
    """Counters of what a run exercised (tests assert the scenario did its job)."""

    steps: int = 0
    forward_steps: int = 0
    partial_prefills: int = 0
    empty_steps: int = 0
    rows_scheduled: int = 0
    rows_accepted: int = 0
    bytes_copied_vllm: int = 0
    bytes_accepted: int = 0
    drafts: int = 0
    rejected_drafts: int = 0
    reattach_rows: int = 0
    preemptions: int = 0
    stale_outputs: int = 0
    prefix_hit_tokens: int = 0
    same_step_hit_blocks: int = 0
    in_flight_hit_blocks: int = 0
    external_hit_tokens: int = 0
    external_hits_capped: int = 0
    async_loads: int = 0
    hash_only_updates: int = 0
    finished_in_flight: int = 0
    aborts: int = 0
    resets: int = 0
    emitted_rows: int = 0
    max_in_flight: int = 0
    worker_seconds: float = 0.0


@dataclass
class StepRecord:
    """One processed step: batch request ids and the worker's outputs as
    ``req_id -> (token_start, dtype str, shape, raw bytes)`` (copied when recorded)."""

    index: int
    req_ids: tuple[str, ...]
    outputs: dict[str, tuple[int, str, tuple[int, ...], bytes]]


@dataclass
class SimError:
    """The first error of a run: engine step index, the worker call (``begin_step``,
    ``prepare_output``, ``enqueue_cpu_copy``, ``process_output``) or ``engine``, and the
    exception."""

    step: int
    phase: str
    exc: BaseException

    @property
    def kind(self) -> str:
        return type(self.exc).__name__


@dataclass
class SimResult:
    """What a run produced.

    ``steps``: per processed forward step, the worker's outputs (for differential tests);
    ``metas``: the scheduler metadata of every step (when recorded); ``emitted``: per
    request, each non-None ``take_output`` result as ``(token_start, rows)`` (the arrays
    themselves, so outputs that alias reused buffers are caught by the final check);
    ``emit_start``: first token_start per request; ``final_tokens`` / ``finish_status``:
    per finished or aborted request; ``error``: the first error (``catch_errors=True``).
    """

    trace: Trace
    worker_name: str
    steps: list[StepRecord] = field(default_factory=list)
    metas: list[Any] = field(default_factory=list)
    emitted: dict[str, list[tuple[int, np.ndarray]]] = field(default_factory=dict)
    emit_start: dict[str, int] = field(default_factory=dict)
    final_tokens: dict[str, list[int]] = field(default_factory=dict)
    finish_status: dict[str, str] = field(default_factory=dict)
    error: SimError | None = None
    stats: SimStats = field(default_factory=SimStats)

    def rows(self, req_id: str) -> np.ndarray:
        """The request's concatenated take_output rows ``[n, L, K]``."""
        chunks = [rows for _, rows in self.emitted.get(req_id, [])]
        model = self.trace.model
        if not chunks:
            return np.empty((0, model.num_layers, model.top_k), model.dtype)
        return np.concatenate(chunks)

    def check_ground_truth(self) -> int:
        """Assert every request's rows equal the oracle's for its final tokens; returns the
        number of rows checked. Rows are contiguous from the first emit start; a request
        that finished normally covers ``[emit_start, num_tokens - 1)`` exactly."""
        if self.error is not None:
            raise AssertionError(
                f"run failed at step {self.error.step} ({self.error.phase}): "
                f"{self.error.kind}: {self.error.exc}"
            )
        model = self.trace.model
        oracle = RoutingOracle(
            model.num_layers, model.top_k, model.num_experts, model.num_dense_layers
        )
        checked = 0
        for req_id, tokens in self.final_tokens.items():
            chunks = self.emitted.get(req_id, [])
            start = self.emit_start.get(req_id)
            cursor = start
            for token_start, rows in chunks:
                if token_start != cursor:
                    raise AssertionError(
                        f"{req_id}: output chunk starts at {token_start}, "
                        f"expected {cursor} (emit start {start})"
                    )
                if rows.dtype != model.dtype or rows.shape[1:] != (model.num_layers, model.top_k):
                    raise AssertionError(
                        f"{req_id}: rows {rows.dtype}{rows.shape}, expected "
                        f"{model.dtype}[n, {model.num_layers}, {model.top_k}]"
                    )
                cursor += len(rows)
            got = self.rows(req_id)
            if self.finish_status[req_id] == FINISHED_STOPPED:
                if start is None or cursor != len(tokens) - 1:
                    raise AssertionError(
                        f"{req_id}: rows cover [{start}, {cursor}), expected "
                        f"[{start}, {len(tokens) - 1})"
                    )
            if start is None:
                continue
            want = oracle.expected(np.asarray(tokens), start, start + len(got))
            if not np.array_equal(got, want):
                bad = np.flatnonzero((got != want).reshape(len(got), -1).any(axis=1))
                raise AssertionError(
                    f"{req_id}: {len(bad)} wrong rows, first at position "
                    f"{start + int(bad[0])} (rows start {start})"
                )
            checked += len(got)
        return checked


@dataclass
class _Scheduled:
    index: int
    num_scheduled: dict[str, int]
    spec: dict[str, int]
    computed_before: dict[str, int]
    meta: Any


@dataclass
class _InFlight:
    index: int
    req_ids: list[str]
    num_scheduled: dict[str, int]
    spec: dict[str, int]
    sampled: dict[str, list[int]]
    num_sampled: np.ndarray
    num_rejected: np.ndarray
    num_sampled_final: np.ndarray
    num_rejected_final: np.ndarray
    pending: Any
    future: concurrent.futures.Future | None = None


SchedulerFactory = Callable[[KVCacheDouble, Any], Any]


def r3capture_scheduler(kv: KVCacheDouble, kv_connector: Any) -> Any:
    from sim.scheduler import SchedulerConnector

    return SchedulerConnector(kv, kv_connector)


def vllm_scheduler(kv: KVCacheDouble, kv_connector: Any) -> Any:
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    return AuxOutputSchedulerConnector(kv, kv_connector)


class SimEngine:
    """Runs one trace through one scheduler connector and one worker connector."""

    def __init__(
        self,
        trace: Trace,
        worker: WorkerHandle,
        *,
        scheduler_factory: SchedulerFactory = r3capture_scheduler,
        threaded: bool = False,
        record_metas: bool = False,
    ) -> None:
        self.trace = trace
        cfg = self.cfg = trace.config
        model = trace.model
        self.oracle = RoutingOracle(
            model.num_layers, model.top_k, model.num_experts, model.num_dense_layers
        )
        self.kv = KVCacheDouble(
            num_blocks=cfg.num_gpu_blocks,
            block_size=cfg.block_size,
            hash_block_size=cfg.hash_block_size,
            offload_blocks=cfg.offload_blocks,
        )
        kv_connector = object() if cfg.offload_blocks else None
        self.aux = scheduler_factory(self.kv, kv_connector)
        self.worker = worker
        self.is_async = cfg.max_concurrent_batches > 1
        self.threaded = threaded
        self.record_metas = record_metas
        self.rng = np.random.default_rng([trace.seed, 0x5EC])
        self.result = SimResult(trace, worker.name)
        self.stats = self.result.stats
        self.requests: dict[str, SimRequest] = {}
        self.running: list[SimRequest] = []
        self.waiting: list[SimRequest] = []
        self.gpu: dict[str, _GpuRequest] = {}
        self.inflight: deque[_InFlight] = deque()
        self.step_index = 0
        self.terminal_pending = False
        self._unarrived = {spec.req_id: spec for spec in trace.requests}
        self._processed_step = -1
        self._finished_at: dict[str, int] = {}
        self._executor = (
            concurrent.futures.ThreadPoolExecutor(1, "sim-output") if threaded else None
        )

    # ------------------------------------------------------------------ driver

    def run(self, *, catch_errors: bool = False) -> SimResult:
        try:
            self._run()
        except Exception as exc:
            if not catch_errors:
                raise
            if self.result.error is None:
                self.result.error = SimError(self.step_index, "engine", exc)
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
        return self.result

    def _run(self) -> None:
        limit = self.cfg.max_concurrent_batches
        while True:
            self._arrive()
            self._abort()
            if self.step_index in self.trace.reset_steps:
                self._drain()
                self._reset_prefix_cache()
            stepped = None
            if self.requests or self.terminal_pending:
                stepped = self._execute(self._schedule())
            if stepped is not None:
                self.inflight.append(stepped)
                self.stats.max_in_flight = max(self.stats.max_in_flight, len(self.inflight))
            if self.inflight and (len(self.inflight) >= limit or stepped is None):
                self._process(self.inflight.popleft())
            if (
                not self._unarrived
                and not self.requests
                and not self.inflight
                and not self.terminal_pending
            ):
                return
            self.step_index += 1
            if self.step_index > self.trace.max_steps:
                raise RuntimeError(
                    f"trace {self.trace.name} did not finish in {self.trace.max_steps} steps"
                )

    def _drain(self) -> None:
        while self.inflight:
            self._process(self.inflight.popleft())

    def _call(self, phase: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            self.result.error = SimError(self.step_index, phase, exc)
            raise
        finally:
            self.stats.worker_seconds += time.perf_counter() - t0

    # ------------------------------------------------------------------ arrivals, aborts

    def _arrive(self) -> None:
        for req_id, spec in list(self._unarrived.items()):
            if spec.after is None:
                due = spec.arrival_step
            elif spec.after in self._finished_at:
                due = self._finished_at[spec.after] + 1 + spec.arrival_step
            else:
                continue
            if due <= self.step_index:
                del self._unarrived[req_id]
                request = SimRequest(spec, self.cfg.hash_block_size)
                self.requests[req_id] = request
                self.waiting.append(request)

    def _abort(self) -> None:
        for request in list(self.requests.values()):
            abort = request.spec.abort_step
            if abort is not None and abort <= self.step_index:
                self.stats.aborts += 1
                self._finish(request, FINISHED_ABORTED)

    def _finish(self, request: SimRequest, status: str) -> None:
        """vLLM's _free_request: the connector hears about it before the KV blocks go."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        if request.num_in_flight_tokens:
            self.stats.finished_in_flight += 1
        self.aux.request_finished(request)
        self.terminal_pending = True
        self.kv.free(request)
        del self.requests[request.request_id]
        self.gpu.pop(request.request_id, None)
        self.result.final_tokens[request.request_id] = list(request.all_token_ids)
        self.result.finish_status[request.request_id] = status
        self._finished_at[request.request_id] = self.step_index

    def _preempt(self, request: SimRequest, drop_stale_output: bool = False) -> None:
        self.stats.preemptions += 1
        self.aux.request_finished(request)
        self.terminal_pending = True
        self.kv.free(request)
        request.status = PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        # In-flight output is delivered later as stale (tokens kept, counters untouched)
        # unless dropped; an undrained dropped share stays dropped.
        request.drop_stale_output = drop_stale_output or (
            request.drop_stale_output and request.num_stale_output_tokens > 0
        )
        request.num_stale_output_tokens = request.num_in_flight_tokens
        request.num_output_placeholders = 0
        self.gpu.pop(request.request_id, None)
        self.waiting.insert(0, request)

    def _reset_prefix_cache(self) -> None:
        """vLLM's reset_prefix_cache(reset_running_requests=True) with nothing in flight."""
        while self.running:
            self._preempt(self.running.pop(), drop_stale_output=True)
        if not self.kv.reset_prefix_cache():
            raise RuntimeError("KV prefix-cache reset refused: blocks still in use")
        self.aux.reset()
        self.stats.resets += 1

    # ------------------------------------------------------------------ scheduling

    def _schedule(self) -> _Scheduled:
        cfg = self.cfg
        kv = self.kv
        kv.block_pool.now = self.step_index
        k = cfg.num_spec_tokens
        budget = cfg.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        spec: dict[str, int] = {}
        computed_before: dict[str, int] = {}
        preempted = False

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if (
                self.is_async
                and request.num_output_placeholders > 0
                and request.num_computed_tokens + 2 - request.num_output_placeholders
                >= request.num_prompt_tokens + request.max_tokens
            ):
                index += 1  # the in-flight steps already reach max_tokens
                continue
            n = (
                request.num_tokens_with_spec
                + request.num_output_placeholders
                - request.num_computed_tokens
            )
            if cfg.long_prefill_token_threshold:
                n = min(n, cfg.long_prefill_token_threshold)
            n = min(n, budget)
            if n <= 0:
                index += 1
                continue
            allocated = kv.allocate_slots(request, n, num_lookahead_tokens=k)
            while not allocated:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                allocated = kv.allocate_slots(request, n, num_lookahead_tokens=k)
            if not allocated:
                break
            req_id = request.request_id
            computed_before[req_id] = request.num_computed_tokens
            num_scheduled[req_id] = n
            budget -= n
            index += 1
            if request.spec_token_ids:
                drafts = (
                    n
                    + request.num_computed_tokens
                    - request.num_tokens
                    - request.num_output_placeholders
                )
                if drafts > 0:
                    spec[req_id] = min(len(request.spec_token_ids), drafts)
                request.spec_token_ids = []

        # Requests whose KV load holds blocks go first (vLLM keeps them in a separate
        # queue); otherwise a blocked head of the queue could starve them forever.
        self.waiting.sort(key=lambda r: r.request_id not in kv.req_blocks)
        index = 0
        while (
            not preempted
            and index < len(self.waiting)
            and budget > 0
            and len(self.running) < cfg.max_num_seqs
        ):
            request = self.waiting[index]
            if request.status == LOADING:
                if self.step_index < request.load_ready_step:
                    index += 1
                    continue
                kv.cache_blocks(request, request.num_computed_tokens)
                request.status = WAITING
            hit_blocks: list[Any] = []
            local = external = 0
            if request.num_computed_tokens == 0:
                max_hit = self.aux.max_cache_hit(request) if cfg.cap_hits else None
                hit_blocks, local = kv.get_computed_blocks(request, max_hit)
                if kv.offload is not None:
                    found = kv.external_hit(request, local)
                    external = found
                    if cfg.cap_hits:
                        external = self.aux.cap_external_hit(request, local, found)
                        if external < found:
                            self.stats.external_hits_capped += 1
                    if cfg.async_kv_load and external > 0:
                        # Reserve the rest of the request too: loads that each hold part
                        # of their blocks could otherwise wait on each other forever.
                        rest = request.num_tokens - local - external + k
                        if not kv.allocate_slots(
                            request,
                            0,
                            num_new_computed_tokens=local,
                            new_computed_blocks=hit_blocks,
                            num_external_computed_tokens=external,
                            num_lookahead_tokens=rest,
                            delay_cache_blocks=True,
                        ):
                            break
                        request.num_computed_tokens = local + external
                        self.aux.request_loading(request, request.num_computed_tokens)
                        request.status = LOADING
                        request.load_ready_step = self.step_index + 1
                        self.stats.async_loads += 1
                        self.stats.prefix_hit_tokens += local
                        self.stats.external_hit_tokens += external
                        index += 1
                        continue
            computed = request.num_computed_tokens + local + external
            n = request.num_tokens - computed
            if cfg.long_prefill_token_threshold:
                n = min(n, cfg.long_prefill_token_threshold)
            n = min(n, budget)
            if not kv.allocate_slots(
                request,
                n,
                num_new_computed_tokens=local,
                new_computed_blocks=hit_blocks,
                num_external_computed_tokens=external,
                num_lookahead_tokens=k,
            ):
                break
            del self.waiting[index]
            self.stats.prefix_hit_tokens += local
            for block in hit_blocks:
                # Hits on blocks whose rows are still being computed: in this very step,
                # or in a step whose output has not been processed yet.
                if block.cached_at == self.step_index:
                    self.stats.same_step_hit_blocks += 1
                elif block.cached_at > self._processed_step:
                    self.stats.in_flight_hit_blocks += 1
            self.stats.external_hit_tokens += external
            request.num_computed_tokens = computed
            request.status = RUNNING
            self.running.append(request)
            req_id = request.request_id
            computed_before[req_id] = computed
            num_scheduled[req_id] = n
            budget -= n
            self.gpu[req_id] = _GpuRequest(list(request.all_token_ids), computed)

        meta = self.aux.build_connector_meta(
            SimpleNamespace(num_scheduled_tokens=num_scheduled, scheduled_spec_decode_tokens=spec),
            self.requests,
        )
        self.terminal_pending = False
        finished = set(meta.finished_requests)
        self.stats.hash_only_updates += sum(
            1
            for req_id in meta.block_hashes
            if req_id not in num_scheduled and req_id not in finished
        )
        if self.record_metas:
            self.result.metas.append(meta)

        for req_id, n in num_scheduled.items():
            request = self.requests[req_id]
            request.num_computed_tokens += n
            request.num_in_flight_tokens += n
            prefill_chunk = request.num_computed_tokens < (
                request.num_tokens + request.num_output_placeholders
            )
            if self.is_async and not prefill_chunk:
                request.num_output_placeholders += 1 + spec.get(req_id, 0)
                request.spec_token_ids = self._propose_drafts()
        return _Scheduled(self.step_index, num_scheduled, spec, computed_before, meta)

    def _propose_drafts(self) -> list[int]:
        """Placeholder draft ids for a request's next step, or none (no proposer match)."""
        cfg = self.cfg
        # Draw only when drafts can be skipped, so traces without the knob keep their stream.
        if cfg.draft_prob < 1.0 and self.rng.random() >= cfg.draft_prob:
            return []
        return [-1] * cfg.num_spec_tokens

    # ------------------------------------------------------------------ model runner

    @staticmethod
    def _true_token(request: SimRequest, index: int) -> int:
        """The model's sample for output index ``index`` (same on every path)."""
        stream = request.spec.tokens
        if index < len(stream):
            return stream[index]
        return (index * 7919 + 13) % VOCAB

    def _execute(self, sched: _Scheduled) -> _InFlight | None:
        self.stats.steps += 1
        self._call("begin_step", self.worker.begin_step, sched.meta)
        if not sched.num_scheduled:
            self.stats.empty_steps += 1
            return None
        self.stats.forward_steps += 1
        req_ids = list(sched.num_scheduled)
        num_reqs = len(req_ids)
        qsl = np.zeros(num_reqs + 1, np.int32)
        positions: list[np.ndarray] = []
        step_rows: list[np.ndarray] = []
        num_sampled = np.zeros(num_reqs, np.int32)
        num_rejected = np.zeros(num_reqs, np.int32)
        sampled: dict[str, list[int]] = {}
        for i, req_id in enumerate(req_ids):
            request = self.requests[req_id]
            gpu = self.gpu[req_id]
            n = sched.num_scheduled[req_id]
            drafts = sched.spec.get(req_id, 0)
            start = gpu.computed
            known = len(gpu.tokens)
            if start + n <= known:
                if drafts:
                    raise RuntimeError(f"sim: drafts scheduled into a prefill of {req_id}")
                inputs = gpu.tokens[start : start + n]
                out_index = known - request.num_prompt_tokens
                new = [self._true_token(request, out_index)] if start + n == known else []
                rejected = 0
            else:
                if start != known - 1 or n != 1 + drafts:
                    raise RuntimeError(
                        f"sim: inconsistent decode of {req_id}: start={start}, "
                        f"known={known}, n={n}, drafts={drafts}"
                    )
                accepted = 0
                accept_prob = request.spec.accept_prob
                if accept_prob is None:
                    accept_prob = self.cfg.accept_prob
                while accepted < drafts and self.rng.random() < accept_prob:
                    accepted += 1
                out_index = known - request.num_prompt_tokens
                new = [self._true_token(request, out_index + j) for j in range(accepted + 1)]
                # The first rejected draft differs from the token the target model samples.
                wrong = [int((new[accepted] + 1 + self.rng.integers(VOCAB - 1)) % VOCAB)]
                wrong += [
                    int(t) for t in self.rng.integers(0, VOCAB, max(drafts - accepted - 1, 0))
                ]
                inputs = [gpu.tokens[start]] + new[:accepted] + wrong[: drafts - accepted]
                rejected = drafts - accepted
                self.stats.drafts += drafts
                self.stats.rejected_drafts += rejected
            hashes = prefix_hashes(np.asarray(inputs, np.int64), gpu.hash_before(start))
            pos = np.arange(start, start + n, dtype=np.int64)
            step_rows.append(self.oracle.rows_from_hashes(hashes, pos))
            positions.append(pos)
            if start != sched.computed_before[req_id]:
                self.stats.reattach_rows += n
            gpu.computed = start + n - rejected
            gpu.tokens.extend(new)
            sampled[req_id] = new
            num_sampled[i] = len(new)
            if not new:
                self.stats.partial_prefills += 1
            num_rejected[i] = rejected
            qsl[i + 1] = qsl[i] + n
        num_rows = int(qsl[-1])
        rows = np.concatenate(step_rows)
        pos_all = np.concatenate(positions)
        qsl_np = qsl
        pad = self.cfg.pad_tokens_to
        buffer = self.worker.capture_buffer
        if pad:
            padded = min(-(-num_rows // pad) * pad, buffer.shape[0])
            if padded > num_rows:
                junk = self.rng.integers(
                    0,
                    self.trace.model.num_experts,
                    (padded - num_rows, *rows.shape[1:]),
                    dtype=np.int32,
                )
                rows = np.concatenate([rows, junk])
                pos_all = np.concatenate([pos_all, np.zeros(padded - num_rows, np.int64)])
                qsl_np = np.append(qsl, np.int32(padded))
        buffer[: len(rows)] = torch.from_numpy(rows)
        self.stats.rows_scheduled += num_rows
        accepted_rows = num_rows - int(num_rejected.sum())
        self.stats.rows_accepted += accepted_rows
        row_nbytes = self.trace.model.row_nbytes
        self.stats.bytes_copied_vllm += num_rows * row_nbytes
        self.stats.bytes_accepted += accepted_rows * row_nbytes
        batch = SimpleNamespace(
            req_ids=req_ids,
            num_reqs=num_reqs,
            query_start_loc_np=qsl_np,
            num_computed_tokens_np=np.array([sched.computed_before[r] for r in req_ids], np.int32),
            query_start_loc=torch.from_numpy(qsl_np.copy()),
            positions=torch.from_numpy(pos_all),
        )
        pending = self._call("prepare_output", self.worker.prepare_output, batch, num_rejected)
        # vLLM hands over arrays its async D2H copies fill in later; fill them just before
        # process_output so a worker that reads them early sees garbage.
        late_sampled = np.full(num_reqs, -1, np.int32)
        late_rejected = np.full(num_reqs, -1, np.int32)
        if pending is not None:
            self._call(
                "enqueue_cpu_copy",
                pending.enqueue_cpu_copy,
                num_sampled=late_sampled,
                num_rejected=late_rejected,
            )
        step = _InFlight(
            sched.index,
            req_ids,
            sched.num_scheduled,
            sched.spec,
            sampled,
            late_sampled,
            late_rejected,
            num_sampled,
            num_rejected,
            pending,
        )
        if self._executor is not None and pending is not None:
            self._fill(step)
            step.future = self._executor.submit(pending.process_output)
        return step

    @staticmethod
    def _fill(step: _InFlight) -> None:
        step.num_sampled[:] = step.num_sampled_final
        step.num_rejected[:] = step.num_rejected_final

    # ------------------------------------------------------------------ outputs

    def _process(self, step: _InFlight) -> None:
        self._processed_step = step.index
        output = None
        if step.pending is not None:
            if step.future is not None:
                t0 = time.perf_counter()
                try:
                    output = step.future.result()
                except Exception as exc:
                    self.result.error = SimError(step.index, "process_output", exc)
                    raise
                finally:
                    self.stats.worker_seconds += time.perf_counter() - t0
            else:
                self._fill(step)
                output = self._call("process_output", step.pending.process_output)
            self.result.steps.append(
                StepRecord(
                    step.index,
                    tuple(step.req_ids),
                    {
                        req_id: (
                            int(item.token_start),
                            item.rows.dtype.str,
                            tuple(item.rows.shape),
                            item.rows.tobytes(),
                        )
                        for req_id, item in output.items()
                    },
                )
            )
        self._update_from_output(step, output)

    def _update_from_output(self, step: _InFlight, output: Any) -> None:
        cfg = self.cfg
        for req_id, n in step.num_scheduled.items():
            request = self.requests.get(req_id)
            stale = False
            if request is not None:
                request.num_in_flight_tokens -= n
                if request.num_stale_output_tokens > 0:
                    stale = True
                    request.num_stale_output_tokens -= n
            if request is None or request.is_finished():
                continue
            if stale:
                self.stats.stale_outputs += 1
                if request.drop_stale_output:
                    continue
            generated = list(step.sampled[req_id])
            drafts = step.spec.get(req_id, 0)
            if drafts and generated and not stale:
                rejected = drafts - (len(generated) - 1)
                if request.num_computed_tokens > 0:
                    request.num_computed_tokens -= rejected
                if request.num_output_placeholders > 0:
                    request.num_output_placeholders -= rejected
            status_before = request.status
            stopped = False
            if generated:
                had_placeholders = request.num_output_placeholders > 0
                generated, stopped = self._append(request, generated, stale)
                if (
                    not stale
                    and status_before == RUNNING
                    and (had_placeholders or cfg.num_spec_tokens > 0)
                ):
                    self.kv.cache_blocks(
                        request, request.num_computed_tokens - request.num_in_flight_tokens
                    )
            if generated or stopped:
                rows = self.aux.take_output(request, output)
                if rows is not None:
                    token_start = output[req_id].token_start
                    self.result.emit_start.setdefault(req_id, token_start)
                    self.result.emitted.setdefault(req_id, []).append((token_start, rows))
                    self.stats.emitted_rows += len(rows)
            if stopped:
                self._finish(request, FINISHED_STOPPED)
            elif generated and not self.is_async and cfg.num_spec_tokens:
                if request.status == RUNNING:
                    request.spec_token_ids = self._propose_drafts()

    def _append(
        self, request: SimRequest, tokens: list[int], stale: bool
    ) -> tuple[list[int], bool]:
        count = len(tokens)
        stopped = False
        for i, token in enumerate(tokens, 1):
            request.append_output_token(token)
            if request.num_output_tokens >= request.max_tokens:
                stopped = True
                if not stale:
                    request.num_computed_tokens -= count - i
                tokens = tokens[:i]
                break
        if not stale and request.num_output_placeholders > 0:
            request.num_output_placeholders -= count
        return tokens, stopped


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
    record_metas: bool = False,
    catch_errors: bool = False,
    check: bool = True,
) -> SimResult:
    """Run ``trace`` through a fresh worker from ``worker_factory``; with ``check`` (and no
    error) verify every request's rows against the oracle. ``catch_errors`` records the
    first error (step, phase, exception) in ``result.error`` instead of raising."""
    handle = worker_factory(worker_sizes(trace))
    try:
        engine = SimEngine(
            trace,
            handle,
            scheduler_factory=scheduler_factory,
            threaded=threaded,
            record_metas=record_metas,
        )
        result = engine.run(catch_errors=catch_errors)
    finally:
        handle.close()
    if check and result.error is None:
        result.check_ground_truth()
    return result


__all__ = [
    "SimEngine",
    "SimError",
    "SimRequest",
    "SimResult",
    "SimStats",
    "StepRecord",
    "default_max_bytes",
    "r3capture_scheduler",
    "run_trace",
    "vllm_scheduler",
    "worker_sizes",
]
