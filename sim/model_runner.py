"""The simulator's model runner: what the GPU side of vLLM does with one schedule.

It keeps its own view of every running request (``_GpuRequest``: the tokens sampled so far
and the true number of computed tokens, corrected by every rejection), samples tokens and
draft acceptances, writes the routing oracle's rows into the worker's capture buffer and
drives the worker connector's per-step calls in vLLM 0.33.0's order (``begin_step``,
``prepare_output``, ``enqueue_cpu_copy``; ``process_output`` later, in step order).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from sim.copy_stream import OutputCopies
from sim.interleaving import DrawnInterleaving
from sim.oracle import SEED, RoutingOracle, prefix_hashes
from sim.records import InFlight, Scheduled, SimError, SimRequest, SimResult, StepRecord
from sim.request_indices import RequestIndices
from sim.trace import VOCAB, Trace
from sim.workers import WorkerHandle


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


class SimModelRunner:
    """Executes schedules against one worker connector.

    Args:
        trace: the trace (model shape, config).
        worker: the worker connector under test.
        rng: the run's random stream (shared with the scheduler: one draw order).
        result: where step outputs, errors and counters go.
        threaded: run ``process_output`` on a separate thread, as vLLM's output thread does.
        interleave_seed: run ``process_output`` on the step thread instead, at the call
            boundaries this seed draws (``sim.interleaving``); not with ``threaded``.
    """

    def __init__(
        self,
        trace: Trace,
        worker: WorkerHandle,
        rng: np.random.Generator,
        result: SimResult,
        *,
        threaded: bool,
        interleave_seed: int | None = None,
    ) -> None:
        self.trace = trace
        self.cfg = trace.config
        self.worker = worker
        self.rng = rng
        self.result = result
        self.stats = result.stats
        model = trace.model
        self.oracle = RoutingOracle(
            model.num_layers, model.top_k, model.num_experts, model.num_dense_layers
        )
        self.gpu: dict[str, _GpuRequest] = {}
        self.indices = RequestIndices(self.cfg.max_num_seqs)
        self._copies = OutputCopies(worker.capture_buffer.device)
        if threaded and interleave_seed is not None:
            raise ValueError("threaded and interleave_seed exclude each other")
        self._interleaving = (
            DrawnInterleaving(interleave_seed) if interleave_seed is not None else None
        )
        self._executor: concurrent.futures.Executor | DrawnInterleaving | None = (
            concurrent.futures.ThreadPoolExecutor(1, "sim-output")
            if threaded
            else self._interleaving
        )

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    def _call(
        self, step_index: int, phase: str, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        if self._interleaving is not None:
            self._interleaving.boundary()
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            self.result.error = SimError(step_index, phase, exc)
            raise
        finally:
            self.stats.worker_seconds += time.perf_counter() - t0

    @staticmethod
    def _true_token(request: SimRequest, index: int) -> int:
        """The model's sample for output index ``index`` (same on every path)."""
        stream = request.spec.tokens
        if index < len(stream):
            return stream[index]
        return (index * 7919 + 13) % VOCAB

    def execute(self, sched: Scheduled, requests: dict[str, SimRequest]) -> InFlight | None:
        """Run one schedule: ``begin_step``, then (with tokens) the forward's rows, the
        batch, ``prepare_output`` and ``enqueue_cpu_copy``. Returns the step in flight."""
        for req_id in sched.freed:
            self.gpu.pop(req_id, None)
        self.indices.free(sched.freed)  # MRV2 frees, then adds
        for req_id, (tokens, computed) in sched.admitted.items():
            self.gpu[req_id] = _GpuRequest(tokens, computed)
            self.indices.add(req_id)
        self.stats.steps += 1
        self._call(sched.index, "begin_step", self.worker.begin_step, sched.meta)
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
            request = requests[req_id]
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
        idx_mapping_np, idx_mapping = self.indices.mapping(req_ids)
        batch = SimpleNamespace(
            req_ids=req_ids,
            num_reqs=num_reqs,
            query_start_loc_np=qsl_np,
            num_computed_tokens_np=np.array([sched.computed_before[r] for r in req_ids], np.int32),
            query_start_loc=torch.from_numpy(qsl_np.copy()),
            positions=torch.from_numpy(pos_all),
            idx_mapping_np=idx_mapping_np,
            idx_mapping=idx_mapping,
            num_draft_tokens=sum(sched.spec.get(req_id, 0) for req_id in req_ids),
        )
        pending = self._call(
            sched.index, "prepare_output", self.worker.prepare_output, batch, num_rejected
        )
        # vLLM hands over arrays its async D2H copies fill in later; fill them just before
        # process_output so a worker that reads them early sees garbage.
        late_sampled = np.full(num_reqs, -1, np.int32)
        late_rejected = np.full(num_reqs, -1, np.int32)
        copy_event = None
        if pending is not None:
            copy_event = self._copies.enqueue(
                lambda: self._call(
                    sched.index,
                    "enqueue_cpu_copy",
                    pending.enqueue_cpu_copy,
                    num_sampled=late_sampled,
                    num_rejected=late_rejected,
                )
            )
        step = InFlight(
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
            None if pending is None else OutputCopies.after(copy_event, pending.process_output),
        )
        if self._executor is not None and pending is not None:
            self._fill(step)
            step.future = self._executor.submit(step.process_output)
        return step

    @staticmethod
    def _fill(step: InFlight) -> None:
        step.num_sampled[:] = step.num_sampled_final
        step.num_rejected[:] = step.num_rejected_final

    def process(self, step: InFlight, step_index: int) -> dict[str, Any] | None:
        """The step's ``process_output`` (None for a step without a pending output),
        recorded in ``result.steps``; ``step_index`` is the engine's current step."""
        output = None
        if step.pending is not None:
            if step.future is not None:
                t0 = time.perf_counter()
                try:
                    if self._interleaving is not None:
                        self._interleaving.run_through(step.future)
                    output = step.future.result()
                except Exception as exc:
                    self.result.error = SimError(step.index, "process_output", exc)
                    raise
                finally:
                    self.stats.worker_seconds += time.perf_counter() - t0
            else:
                self._fill(step)
                output = self._call(step_index, "process_output", step.process_output)
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
        return output
