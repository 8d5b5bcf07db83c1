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

from sim.kv import KVCacheDouble
from sim.records import (
    FINISHED_STOPPED,
    LOADING,
    RUNNING,
    WAITING,
    InFlight,
    Scheduled,
    SimRequest,
    SimResult,
)
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
        # The queues' own containers (mutated in place, never rebound).
        self.requests = self.queues.requests
        self.running = self.queues.running
        self.waiting = self.queues.waiting
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
                if request.num_computed_tokens == request.num_tokens:
                    # As vLLM 0.33.0's _update_waiting_for_remote_kv: a load that covered
                    # every token (cached above, last block included) leaves the last one
                    # to compute, so the next token can be sampled.
                    request.num_computed_tokens -= 1
                    self.stats.whole_prompt_loads += 1
                request.status = WAITING
            if request.num_stale_output_tokens and not request.drop_stale_output:
                # As vLLM 0.33.0: a preempted request resumes only once the output it still
                # has in flight is delivered, which could fill a position it would resample.
                index += 1
                continue
            hit_blocks: list[Any] = []
            local = external = 0
            if request.num_computed_tokens == 0:
                max_hit = self.aux.max_cache_hit(request) if cfg.cap_hits else None
                hit_blocks, local = kv.get_computed_blocks(request, max_hit)
                if kv.offload is not None or cfg.remote_prefill:
                    remote = request.remote_prefill_hit(local, sync=not cfg.async_kv_load)
                    found = max(kv.external_hit(request, local), remote)
                    external = found
                    if cfg.cap_hits:
                        external = self.aux.cap_external_hit(request, local, found)
                        if external < found:
                            self.stats.external_hits_capped += 1
                    if remote and external:
                        self.stats.remote_hits += 1
                        self.stats.remote_hits_unaligned += bool(external % kv.block_size)
                        self.stats.whole_prompt_hits_sync += (
                            not cfg.async_kv_load
                            and request.spec.remote_prefill == request.num_prompt_tokens
                        )
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
                        request.remote_prefill_scheduled()
                        self.aux.request_loading(request, request.num_computed_tokens)
                        request.status = LOADING
                        request.load_ready_step = self.step_index + request.spec.load_steps
                        self.stats.async_loads += 1
                        self.stats.prefix_hit_tokens += local
                        self.stats.external_hit_tokens += external
                        index += 1
                        continue
            computed = request.num_computed_tokens + local + external
            n = request.num_tokens - computed
            # vLLM 0.33.0's schedule() asserts this too: a synchronous hit must leave a token.
            assert n > 0, f"{request.request_id}: a synchronous hit covers every token"
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
            request.remote_prefill_scheduled()
            del self.waiting[index]
            self.stats.prefix_hit_tokens += local
            for block in hit_blocks:
                # Hits on blocks whose rows are still being computed: in this very step,
                # or in a step whose output has not been processed yet.
                if block.cached_at == self.step_index:
                    self.stats.same_step_hit_blocks += 1
                elif block.cached_at > self.processed_step:
                    self.stats.in_flight_hit_blocks += 1
            self.stats.external_hit_tokens += external
            request.num_computed_tokens = computed
            request.status = RUNNING
            self.running.append(request)
            req_id = request.request_id
            computed_before[req_id] = computed
            num_scheduled[req_id] = n
            budget -= n
            admitted[req_id] = (list(request.all_token_ids), computed)
            request.first_computed = computed

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
