"""Admitting waiting requests into a step, as vLLM 0.33.0's scheduler does after its running ones.

A waiting request is admitted with its prefix-cache hit and, when the KV cache offloads or
prompts were prefilled elsewhere, its external (KV-connector) hit, capped by the scheduler
connector where vLLM consults it (``max_cache_hit``, ``cap_external_hit``). An asynchronous
external load holds the request in ``LOADING`` until its load is ready
(``request_loading``); a preempted request waits for the output it still has in flight.
"""

from __future__ import annotations

from typing import Any

from sim.kv import KVCacheDouble
from sim.records import LOADING, RUNNING, WAITING, SimRequest, SimStats
from sim.request_queues import RequestQueues


class WaitingAdmission:
    """Moves waiting requests of ``queues`` into a step while its token budget and
    ``max_num_seqs`` allow; ``cfg`` is the trace's engine config, ``aux`` the scheduler
    connector under test, ``stats`` the run's counters."""

    def __init__(
        self, cfg: Any, kv: KVCacheDouble, aux: Any, queues: RequestQueues, stats: SimStats
    ) -> None:
        self.cfg = cfg
        self.kv = kv
        self.aux = aux
        self.queues = queues
        self.stats = stats

    def admit(
        self,
        step_index: int,
        processed_step: int,
        budget: int,
        num_scheduled: dict[str, int],
        computed_before: dict[str, int],
        admitted: dict[str, tuple[list[int], int]],
    ) -> int:
        """Admit what fits in ``budget`` tokens into step ``step_index`` (``processed_step``:
        the last step whose output was processed), recording each admitted request's tokens
        in ``num_scheduled``, its computed tokens in ``computed_before`` and its token ids
        with them in ``admitted``; returns the budget left."""
        cfg, kv = self.cfg, self.kv
        waiting, running = self.queues.waiting, self.queues.running
        k = cfg.num_spec_tokens
        # Requests whose KV load holds blocks go first (vLLM keeps them in a separate
        # queue); otherwise a blocked head of the queue could starve them forever.
        waiting.sort(key=lambda r: r.request_id not in kv.req_blocks)
        index = 0
        while index < len(waiting) and budget > 0 and len(running) < cfg.max_num_seqs:
            request = waiting[index]
            if not self._ready(request, step_index):
                index += 1
                continue
            hit_blocks: list[Any] = []
            local = external = 0
            if request.num_computed_tokens == 0:
                hit_blocks, local, external = self._hits(request)
                if cfg.async_kv_load and external > 0:
                    if not self._start_load(request, hit_blocks, local, external, step_index):
                        break
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
            del waiting[index]
            self._count_hits(hit_blocks, local, external, step_index, processed_step)
            request.num_computed_tokens = computed
            request.status = RUNNING
            running.append(request)
            req_id = request.request_id
            computed_before[req_id] = computed
            num_scheduled[req_id] = n
            budget -= n
            admitted[req_id] = (list(request.all_token_ids), computed)
            request.first_computed = computed
        return budget

    def _ready(self, request: SimRequest, step_index: int) -> bool:
        """Whether ``request`` may be admitted now; a load that is ready ends here."""
        if request.status == LOADING:
            if step_index < request.load_ready_step:
                return False
            self.kv.cache_blocks(request, request.num_computed_tokens)
            if request.num_computed_tokens == request.num_tokens:
                # As vLLM 0.33.0's _update_waiting_for_remote_kv: a load that covered
                # every token (cached above, last block included) leaves the last one
                # to compute, so the next token can be sampled.
                request.num_computed_tokens -= 1
                self.stats.whole_prompt_loads += 1
            request.status = WAITING
        # As vLLM 0.33.0: a preempted request resumes only once the output it still has in
        # flight is delivered, which could fill a position it would resample.
        return not (request.num_stale_output_tokens and not request.drop_stale_output)

    def _hits(self, request: SimRequest) -> tuple[list[Any], int, int]:
        """A request's prefix-cache hit blocks, their tokens and its external hit tokens."""
        cfg, kv, stats = self.cfg, self.kv, self.stats
        max_hit = self.aux.max_cache_hit(request) if cfg.cap_hits else None
        hit_blocks, local = kv.get_computed_blocks(request, max_hit)
        external = 0
        if kv.offload is not None or cfg.remote_prefill:
            remote = request.remote_prefill_hit(local, sync=not cfg.async_kv_load)
            found = max(kv.external_hit(request, local), remote)
            external = found
            if cfg.cap_hits:
                external = self.aux.cap_external_hit(request, local, found)
                if external < found:
                    stats.external_hits_capped += 1
            if remote and external:
                stats.remote_hits += 1
                stats.remote_hits_unaligned += bool(external % kv.block_size)
                stats.whole_prompt_hits_sync += (
                    not cfg.async_kv_load
                    and request.spec.remote_prefill == request.num_prompt_tokens
                )
        return hit_blocks, local, external

    def _start_load(
        self,
        request: SimRequest,
        hit_blocks: list[Any],
        local: int,
        external: int,
        step_index: int,
    ) -> bool:
        """Start ``request``'s asynchronous external load (it stays waiting, ``LOADING``);
        False when its blocks do not fit."""
        # Reserve the rest of the request too: loads that each hold part of their blocks
        # could otherwise wait on each other forever.
        rest = request.num_tokens - local - external + self.cfg.num_spec_tokens
        if not self.kv.allocate_slots(
            request,
            0,
            num_new_computed_tokens=local,
            new_computed_blocks=hit_blocks,
            num_external_computed_tokens=external,
            num_lookahead_tokens=rest,
            delay_cache_blocks=True,
        ):
            return False
        request.num_computed_tokens = local + external
        request.remote_prefill_scheduled()
        self.aux.request_loading(request, request.num_computed_tokens)
        request.status = LOADING
        request.load_ready_step = step_index + request.spec.load_steps
        self.stats.async_loads += 1
        self.stats.prefix_hit_tokens += local
        self.stats.external_hit_tokens += external
        return True

    def _count_hits(
        self,
        hit_blocks: list[Any],
        local: int,
        external: int,
        step_index: int,
        processed_step: int,
    ) -> None:
        stats = self.stats
        stats.prefix_hit_tokens += local
        for block in hit_blocks:
            # Hits on blocks whose rows are still being computed: in this very step, or in
            # a step whose output has not been processed yet.
            if block.cached_at == step_index:
                stats.same_step_hit_blocks += 1
            elif block.cached_at > processed_step:
                stats.in_flight_hit_blocks += 1
        stats.external_hit_tokens += external
