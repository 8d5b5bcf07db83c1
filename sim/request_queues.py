"""The simulator's request queues: arrival, waiting and running, finish, preemption, reset.

Each transition tells the scheduler connector what vLLM's scheduler tells it
(``request_finished`` on finish and preemption, ``reset`` after a prefix-cache reset) and
frees the request's KV blocks; the ids the model runner must forget are collected for the
next schedule.
"""

from __future__ import annotations

from typing import Any

from sim.kv import KVCacheDouble
from sim.records import FINISHED_ABORTED, PREEMPTED, SimRequest, SimResult
from sim.trace import Trace


class RequestQueues:
    """Every live request, the waiting and running queues, and their transitions.

    Args:
        trace: the requests (with their arrival rules) and the engine config.
        kv: the KV cache whose blocks a finished or preempted request frees.
        aux: the scheduler connector under test.
        result: where finished requests and counters go.
    """

    def __init__(self, trace: Trace, kv: KVCacheDouble, aux: Any, result: SimResult) -> None:
        self.cfg = trace.config
        self.kv = kv
        self.aux = aux
        self.result = result
        self.stats = result.stats
        self.requests: dict[str, SimRequest] = {}
        self.running: list[SimRequest] = []
        self.waiting: list[SimRequest] = []
        # A finish or preemption not yet reported in a schedule's metadata.
        self.terminal_pending = False
        self._unarrived = {spec.req_id: spec for spec in trace.requests}
        self._finished_at: dict[str, int] = {}
        self._freed: list[str] = []

    @property
    def done(self) -> bool:
        """Nothing left to arrive, run or report."""
        return not self._unarrived and not self.requests and not self.terminal_pending

    def take_freed(self) -> list[str]:
        """Ids finished or preempted since the last call (the model runner forgets them)."""
        freed, self._freed = self._freed, []
        return freed

    def arrive(self, step_index: int) -> None:
        for req_id, spec in list(self._unarrived.items()):
            if spec.after is None:
                due = spec.arrival_step
            elif spec.after in self._finished_at:
                due = self._finished_at[spec.after] + 1 + spec.arrival_step
            else:
                continue
            if due <= step_index:
                del self._unarrived[req_id]
                request = SimRequest(spec, self.cfg.hash_block_size)
                self.requests[req_id] = request
                self.waiting.append(request)

    def abort(self, step_index: int) -> None:
        for request in list(self.requests.values()):
            abort = request.spec.abort_step
            if abort is not None and abort <= step_index:
                self.stats.aborts += 1
                self.finish(request, FINISHED_ABORTED, step_index)

    def finish(self, request: SimRequest, status: str, step_index: int) -> None:
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
        self._freed.append(request.request_id)
        self.result.final_tokens[request.request_id] = list(request.all_token_ids)
        self.result.finish_status[request.request_id] = status
        self._finished_at[request.request_id] = step_index

    def preempt(self, request: SimRequest, drop_stale_output: bool = False) -> None:
        self.stats.preemptions += 1
        self.stats.decode_leg_preemptions += request.kv_transfer_params is not None
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
        self._freed.append(request.request_id)
        self.waiting.insert(0, request)

    def reset_prefix_cache(self) -> None:
        """vLLM's reset_prefix_cache(reset_running_requests=True) with nothing in flight."""
        while self.running:
            self.preempt(self.running.pop(), drop_stale_output=True)
        if not self.kv.reset_prefix_cache():
            raise RuntimeError("KV prefix-cache reset refused: blocks still in use")
        self.aux.reset()
        self.stats.resets += 1

    # ------------------------------------------------------------------ scheduling
