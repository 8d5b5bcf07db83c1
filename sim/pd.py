"""P/D decoder traces: decode-leg requests whose prompt KV comes from a prefiller, run through
vLLM 0.33.0's scheduler-side aux connector wrapped by ``PDSchedulerConnector`` and r3capture's
worker under ``--aux-output-pd splice`` (``partial_first_ok``).

``pd_trace(seed)`` is a ``random_trace`` (shared prefixes, multi-turn chains, returning
prompts, aborts, KV pressure, drafts) on an engine with a P/D KV connector and no offload
tier (for half of the seeds with barely room for the longest request, so that requests
preempt each other), where about half of the requests are decode-leg ones: the prefiller
computed their prompt less NIXL's prefill backoff (0 to 5 trailing tokens, so hits end on
and off block boundaries; 0, NIXL's default, for 2 in 7), loaded synchronously or
over 1 to 4 steps, asked from row 0, from the prefiller's last row or from the trace's
prompt start; some are followed by their next turn as a plain request (prompt, output and
new tokens), which hits the blocks the decode-leg request loaded and the one it completed.
A whole prompt is loaded as vLLM 0.33.0 does it: asynchronously (NIXL) up to its last token,
which the scheduler rewinds and recomputes once the load lands; a synchronous connector
(MoRIIO's READ mode) reports the prompt less its last token (``sim.scheduling``).

``check_pd_case(seed)`` runs it and returns None or what failed first:

* the run raises nothing (no request reads rows its instance lacks: no
  ``BlockObjectStoreError``, no protocol error) and every finished request's rows are the
  routing oracle's from its emit start (``SimResult.check_ground_truth``);
* that emit start is the one asked (``min(prompt_start, prompt)``), raised for a decode-leg
  request to its first computed position (local hit plus loaded KV at its admission, less
  the last token a whole-prompt load leaves to compute);
* against the same trace under vLLM's own connector and worker (which caps every decode-leg
  hit, so it recomputes their prompts), where that run is clean: equal final tokens, a plain
  request's rows byte-identical, a decode-leg request's rows the tail of vLLM's.

``check_pd_case(seed, opt_out=share)`` also opts about ``share`` of the requests out of
routed experts (``Trace.with_opt_outs``; the connector then also wrapped as under
``triton``, ``replay.ReplaySchedulerConnector``, outermost): those get no rows, the others
are checked as above against vLLM's run with every request opted in.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from sim.compare import run_vllm_all_opted_in
from sim.engine import SimResult, replay_scheduler, run_trace, vllm_scheduler
from sim.records import FINISHED_STOPPED, SimStats
from sim.trace import Trace, random_trace
from sim.workers import r3capture_worker_factory


def pd_scheduler(kv: Any, kv_connector: Any) -> Any:
    """vLLM 0.33.0's scheduler-side aux connector, wrapped as under ``splice``."""
    from r3capture.aux_output.pd_scheduler import PDSchedulerConnector

    return PDSchedulerConnector(vllm_scheduler(kv, kv_connector))


def pd_trace(seed: int, **overrides: object) -> Trace:
    """``random_trace(seed)`` with a P/D KV connector and decode-leg requests (module
    docstring); depth 1 for even seeds, 2 for odd ones. ``overrides`` replace drawn
    EngineConfig fields."""
    r = random.Random(f"sim.pd/{seed}")
    shape = {
        "offload_blocks": 0,
        "remote_prefill": True,
        "async_kv_load": r.random() < 0.6,
        "max_concurrent_batches": 1 + seed % 2,
        "kv_delivery": r.random() < 0.3,
        **overrides,
    }
    trace = random_trace(seed, **shape)
    requests = []
    for spec in trace.requests:
        if r.random() < 0.5:
            backoff = min(r.choice([0, 0, 1, 1, 2, 3, 5]), len(spec.prompt) - 1)
            computed = len(spec.prompt) - backoff
            start = r.choice([0, 0, computed, spec.prompt_start])
            spec = dataclasses.replace(
                spec, remote_prefill=computed, load_steps=r.randint(1, 4), prompt_start=start
            )
            if r.random() < 0.4:
                # Its next turn, as a plain request: a local hit on the blocks it loaded and
                # on the one its output completed, whose first rows it never computed.
                output = spec.tokens[: spec.max_tokens]
                follow = dataclasses.replace(
                    spec,
                    req_id=f"{spec.req_id}-next",
                    prompt=spec.prompt + output + tuple(r.randrange(1000) for _ in range(3)),
                    tokens=spec.tokens[spec.max_tokens :] + output,
                    remote_prefill=None,
                    prompt_start=r.choice([0, len(spec.prompt)]),
                    arrival_step=r.randint(0, 3),
                    after=spec.req_id,
                    abort_step=None,
                )
                requests.append(spec)
                spec = follow
        requests.append(spec)
    trace = trace.replace(name=f"pd-{seed}", requests=tuple(requests))
    if "num_gpu_blocks" in overrides:
        return trace
    # Room for the longest request alone (a next turn may be longer than any the trace drew),
    # and for half of the seeds barely more: decode-leg requests get preempted too.
    cfg = trace.config
    longest = max(len(q.prompt) + q.max_tokens for q in requests)
    floor = -(-(longest + 2 * (cfg.num_spec_tokens + 1)) // cfg.block_size) + 1
    tight = r.random() < 0.5
    blocks = floor + r.randint(0, 3) if tight else max(cfg.num_gpu_blocks, floor)
    return trace.with_config(num_gpu_blocks=blocks)


def run_pd(trace: Trace) -> SimResult:
    """The trace through the P/D decoder: wrapped connector (as under ``triton`` too when
    some request opts out of rows), r3capture's worker under ``splice`` (reference kernel);
    errors caught, nothing checked."""
    factory = r3capture_worker_factory(kernel_impl="reference", partial_first_ok=True)
    scheduler = pd_scheduler
    if trace.opted_out():
        scheduler = replay_scheduler(trace.config.replay_default, pd_scheduler)
    return run_trace(trace, factory, scheduler_factory=scheduler, catch_errors=True, check=False)


def check_pd_case(
    seed: int, *, opt_out: float = 0.0, **overrides: object
) -> tuple[str | None, SimStats]:
    """Run ``pd_trace(seed, **overrides)``, with about ``opt_out`` of its requests opting
    out of routed experts; returns (None when every check passes (module docstring), else
    what failed first; the P/D run's counters)."""
    trace = pd_trace(seed, **overrides)
    if opt_out:
        trace = trace.with_opt_outs(opt_out)
    got = run_pd(trace)
    return _problem(trace, got), got.stats


def _problem(trace: Trace, got: SimResult) -> str | None:
    if got.error is not None:
        return f"the P/D decoder failed at step {got.error.step} ({got.error.phase}): " + (
            f"{got.error.kind}: {got.error.exc}"
        )
    try:
        got.check_ground_truth()
    except AssertionError as exc:
        return f"rows differ from the routing oracle: {exc}"
    problem = _emit_start_problem(trace, got)
    if problem is not None:
        return problem
    ref = run_vllm_all_opted_in(trace)
    return None if ref.error is not None else _against_vllm(trace, got, ref)


def _emit_start_problem(trace: Trace, got: SimResult) -> str | None:
    for spec in trace.requests:
        start = got.emit_start.get(spec.req_id)
        if start is None:
            continue
        asked = min(spec.prompt_start, len(spec.prompt))
        if spec.remote_prefill is not None:
            asked = max(asked, got.first_computed[spec.req_id])
        if start != asked:
            return f"{spec.req_id}: rows start at {start}, expected {asked}"
    return None


def _against_vllm(trace: Trace, got: SimResult, ref: SimResult) -> str | None:
    opted_out = trace.opted_out()
    for spec in trace.requests:
        req_id = spec.req_id
        stopped = (got.finish_status.get(req_id), ref.finish_status.get(req_id))
        if stopped != (FINISHED_STOPPED, FINISHED_STOPPED):
            continue  # aborts land at other points of a run scheduled otherwise
        if got.final_tokens[req_id] != ref.final_tokens[req_id]:
            return f"{req_id}: final tokens differ from vLLM's run"
        if req_id in opted_out:
            continue  # no rows (check_ground_truth)
        rows, want = got.rows(req_id), ref.rows(req_id)
        skip = got.emit_start[req_id] - ref.emit_start[req_id]
        if spec.remote_prefill is None and skip:
            return f"{req_id}: a plain request's rows start {skip} rows after vLLM's"
        if skip < 0 or rows.tobytes() != want[skip:].tobytes():
            return f"{req_id}: rows are not vLLM's (from row {got.emit_start[req_id]})"
    return None


__all__ = ["check_pd_case", "pd_scheduler", "pd_trace", "run_pd"]
