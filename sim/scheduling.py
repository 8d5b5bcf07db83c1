"""The simulator's scheduler: vLLM 0.33.0's scheduling decisions, in miniature.

Requests arrive (possibly after another finishes), wait, are admitted with their prefix-cache
and external (KV-connector) hits, run with chunked prefill and speculative drafts, are
preempted under KV pressure, abort, finish, and survive prefix-cache resets. Under async
scheduling (``max_concurrent_batches=2``) output and draft placeholders make the next
schedule optimistic, as in vLLM. The scheduler connector under test is consulted exactly
where vLLM's scheduler consults it (``max_cache_hit``, ``cap_external_hit``,
``request_loading``, ``request_finished``, ``build_connector_meta``, ``take_output``,
``reset``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from sim.admission import WaitingAdmission
from sim.kv import KVCacheDouble
from sim.records import FINISHED_STOPPED, RUNNING, InFlight, Scheduled, SimRequest, SimResult
from sim.request_queues import RequestQueues
from sim.trace import Trace


class SimScheduler:
    """The scheduling decisions of one run: which running requests advance, which waiting
    ones are admitted (with their prefix-cache and external hits), each step's connector
    metadata, and what each processed step does to its requests.

    Args:
        trace: the requests and the engine config.
        kv: the KV cache (block pool, prefix cache, optional offload).
        aux: the scheduler connector under test.
        rng: the run's random stream (draft proposals).
        result: where finished requests, emitted rows, metadata and counters go.
        record_metas: keep every step's connector metadata in ``result.metas``.
    """

    def __init__(
        self,
        trace: Trace,
        kv: KVCacheDouble,
        aux: Any,
        rng: np.random.Generator,
        result: SimResult,
        *,
        record_metas: bool,
    ) -> None:
        self.trace = trace
        self.cfg = trace.config
        self.kv = kv
        self.aux = aux
        self.rng = rng
        self.result = result
        self.stats = result.stats
        self.is_async = self.cfg.max_concurrent_batches > 1
        self.record_metas = record_metas
        self.queues = RequestQueues(trace, kv, aux, result)
        self.admission = WaitingAdmission(self.cfg, kv, aux, self.queues, self.stats)
        # The queues' own containers (mutated in place, never rebound).
        self.requests = self.queues.requests
        self.running = self.queues.running
        self.step_index = 0
        # The last step whose output was processed (in-flight prefix-hit statistics).
        self.processed_step = -1

    @property
    def done(self) -> bool:
        return self.queues.done

    @property
    def terminal_pending(self) -> bool:
        return self.queues.terminal_pending

    def arrive(self) -> None:
        self.queues.arrive(self.step_index)

    def abort(self) -> None:
        self.queues.abort(self.step_index)

    def reset_prefix_cache(self) -> None:
        self.queues.reset_prefix_cache()

    def schedule(self) -> Scheduled:
        cfg = self.cfg
        kv = self.kv
        kv.block_pool.now = self.step_index
        k = cfg.num_spec_tokens
        budget = cfg.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        spec: dict[str, int] = {}
        computed_before: dict[str, int] = {}
        preempted = False
        admitted: dict[str, tuple[list[int], int]] = {}

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
                self.queues.preempt(victim, drop_stale_output=cfg.kv_delivery)
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

        if not preempted:
            budget = self.admission.admit(
                self.step_index,
                self.processed_step,
                budget,
                num_scheduled,
                computed_before,
                admitted,
            )

        meta = self.aux.build_connector_meta(
            SimpleNamespace(num_scheduled_tokens=num_scheduled, scheduled_spec_decode_tokens=spec),
            self.requests,
        )
        self.queues.terminal_pending = False
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
        freed = self.queues.take_freed()
        return Scheduled(
            self.step_index, num_scheduled, spec, computed_before, meta, admitted, freed
        )

    def _propose_drafts(self) -> list[int]:
        """Placeholder draft ids for a request's next step, or none (no proposer match)."""
        cfg = self.cfg
        # Draw only when drafts can be skipped, so traces without the knob keep their stream.
        if cfg.draft_prob < 1.0 and self.rng.random() >= cfg.draft_prob:
            return []
        return [-1] * cfg.num_spec_tokens

    def update_from_output(self, step: InFlight, output: Any) -> None:
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
                    self.result.first_computed.setdefault(req_id, request.first_computed)
                    self.result.emitted.setdefault(req_id, []).append((token_start, rows))
                    self.stats.emitted_rows += len(rows)
            if stopped:
                self.queues.finish(request, FINISHED_STOPPED, self.step_index)
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
