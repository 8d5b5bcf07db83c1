"""What the simulator's scheduler and model runner share: request state, step records,
counters and the result of a run."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from sim.kv import block_hashes_for
from sim.oracle import RoutingOracle
from sim.trace import RequestSpec, Trace

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
        extra_args = None if spec.replay is None else {"aux_output_replay": spec.replay}
        self.sampling_params = SimpleNamespace(
            routed_experts_prompt_start=spec.prompt_start, extra_args=extra_args
        )
        # Decode-leg requests carry what a router sends; the KV connector clears the flag.
        self.kv_transfer_params = (
            None if spec.remote_prefill is None else {"do_remote_prefill": True}
        )
        self.first_computed = 0  # num_computed_tokens at its latest admission
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

    def remote_prefill_hit(self, num_local: int, *, sync: bool) -> int:
        """Tokens a P/D KV connector loads after a local hit of ``num_local``: the rest of
        what the prefiller computed, until the connector has scheduled the transfer (a
        resumed request loads nothing). Asynchronous (NIXL's ``get_num_new_matched_tokens``):
        up to the whole prompt. Synchronous (MoRIIO's READ mode): never the prompt's last
        token, which the decoder recomputes."""
        params = self.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0
        end = self.spec.remote_prefill
        if sync:
            end = min(end, self.num_prompt_tokens - 1)
        return max(end - num_local, 0)

    def remote_prefill_scheduled(self) -> None:
        """NIXL's ``update_state_after_alloc``: the transfer is scheduled (or not needed)."""
        if self.kv_transfer_params:
            self.kv_transfer_params["do_remote_prefill"] = False

    def append_output_token(self, token: int) -> None:
        self.all_token_ids.append(token)
        if len(self.all_token_ids) % self.hash_block_size == 0:
            self.block_hashes.extend(
                block_hashes_for(self.all_token_ids, self.hash_block_size, self.block_hashes)
            )


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
    remote_hits: int = 0
    remote_hits_unaligned: int = 0
    # Decode-leg hits on a prompt the prefiller computed whole: loaded asynchronously up to
    # the last token (then recomputed), or reported one token short by a synchronous one.
    whole_prompt_loads: int = 0
    whole_prompt_hits_sync: int = 0
    decode_leg_preemptions: int = 0
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
    ``emit_start``: first token_start per request; ``first_computed``: per request, its
    computed tokens at the admission whose run first emitted; ``final_tokens`` / ``finish_status``:
    per finished or aborted request; ``error``: the first error (``catch_errors=True``).
    """

    trace: Trace
    worker_name: str
    steps: list[StepRecord] = field(default_factory=list)
    metas: list[Any] = field(default_factory=list)
    emitted: dict[str, list[tuple[int, np.ndarray]]] = field(default_factory=dict)
    emit_start: dict[str, int] = field(default_factory=dict)
    first_computed: dict[str, int] = field(default_factory=dict)
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
        that finished normally covers ``[emit_start, num_tokens - 1)`` exactly; a request
        that wants no rows (``Trace.opted_out``) returned none."""
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
        opted_out = self.trace.opted_out()
        for req_id, tokens in self.final_tokens.items():
            chunks = self.emitted.get(req_id, [])
            if req_id in opted_out:
                if chunks:
                    raise AssertionError(f"{req_id} opted out of rows, but got {len(chunks)}")
                continue
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
class Scheduled:
    """One schedule: what the scheduler decided and what the model runner must learn."""

    index: int
    num_scheduled: dict[str, int]
    spec: dict[str, int]
    computed_before: dict[str, int]
    meta: Any
    # For the model runner: requests it starts tracking (token ids so far, computed
    # tokens) and ids it stops tracking (finished or preempted since the last schedule).
    admitted: dict[str, tuple[list[int], int]] = field(default_factory=dict)
    freed: list[str] = field(default_factory=list)


@dataclass
class InFlight:
    """One executed step whose outputs are not processed yet."""

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
    # pending.process_output, after the wait for the step's copy event on a GPU.
    process_output: Callable[[], Any] | None = None
    future: concurrent.futures.Future | None = None
