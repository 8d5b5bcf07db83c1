"""Trace-driven capture simulator (tests and benchmarks only; the library never imports it).

* ``trace``: deterministic scenario generator (``make_trace``, ``random_trace``).
* ``oracle``: routing oracle (rows depend only on the token prefix, position and layer).
* ``kv``: KV-cache-manager double the scheduler connectors read.
* ``engine``: the mini engine (``run_trace``) driving a scheduler connector and one worker
  connector in vLLM 0.33.0's call order, with ground-truth checks.
* ``workers``: vLLM 0.33.0's and r3capture's worker connectors built without a model.
* ``pd``: P/D decoder traces (decode-leg requests loading a prefiller's KV) through the
  ``splice`` scheduler wrapper and worker, checked against the oracle and vLLM's own run.
* ``interleaving``: a repeatable, seed-drawn order of ``process_output`` against the step
  thread's calls (``run_trace(..., interleave_seed=N)``), where threads give one order a run.
"""

from sim.engine import (
    SimEngine,
    SimError,
    SimResult,
    SimStats,
    StepRecord,
    r3capture_scheduler,
    replay_scheduler,
    run_trace,
    vllm_scheduler,
    worker_sizes,
)
from sim.oracle import RoutingOracle
from sim.trace import (
    SCENARIOS,
    EngineConfig,
    ModelSpec,
    RequestSpec,
    Trace,
    make_trace,
    random_trace,
)
from sim.workers import (
    WorkerHandle,
    WorkerSizing,
    make_r3capture_worker,
    make_vllm_worker,
    r3capture_worker_factory,
)

__all__ = [
    "SCENARIOS",
    "EngineConfig",
    "ModelSpec",
    "RequestSpec",
    "RoutingOracle",
    "SimEngine",
    "SimError",
    "SimResult",
    "SimStats",
    "StepRecord",
    "Trace",
    "WorkerHandle",
    "WorkerSizing",
    "make_r3capture_worker",
    "make_trace",
    "make_vllm_worker",
    "r3capture_scheduler",
    "r3capture_worker_factory",
    "random_trace",
    "replay_scheduler",
    "run_trace",
    "vllm_scheduler",
    "worker_sizes",
]
