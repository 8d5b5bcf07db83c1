"""The worker on a CUDA device: the Triton kernel writing pinned host memory directly, and
through device staging, must give the bytes the CPU reference path gives and the oracle's
rows. Needs only torch, triton and a GPU (no vLLM), so it runs in bench/gpu_check.sh."""

from __future__ import annotations

import pytest

from sim import make_trace, run_trace
from sim.workers import make_r3capture_worker

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("ring", ["default", "narrowest"])
@pytest.mark.parametrize("destination", ["direct", "staging"])
@pytest.mark.parametrize("scenario", ["async_spec", "multi_turn", "chunked_prefill", "eviction"])
def test_cuda_worker_matches_the_cpu_reference(scenario, destination, ring, monkeypatch):
    from r3capture.aux_output import sizing
    from r3capture.kernels import can_write_host_directly

    if destination == "direct" and not can_write_host_directly("cuda"):
        pytest.skip("this GPU cannot write pinned host memory directly")
    if ring == "narrowest":
        # Room for these traces' few drafts only: the device ring is as narrow as its bound
        # allows, and long requests wrap it.
        monkeypatch.setattr(sizing, "REATTACH_TOKENS", 3)
    trace = make_trace(scenario, seed=1)
    cpu = run_trace(trace, lambda sizes: make_r3capture_worker(sizes, kernel_impl="reference"))

    def on_cuda(sizes):
        return make_r3capture_worker(
            sizes, kernel_impl="triton", device="cuda", destination=destination
        )

    gpu = run_trace(trace, on_cuda)  # also checks every request against the routing oracle
    assert [s.outputs for s in gpu.steps] == [s.outputs for s in cpu.steps]


@pytest.mark.parametrize("destination", ["direct", "staging"])
@pytest.mark.parametrize("scenario", ["async_spec", "chunked_prefill", "multi_turn"])
def test_main_thread_calls_never_wait_for_the_gpu(scenario, destination):
    # begin_step, prepare_output and enqueue_cpu_copy run on the thread that launches the
    # next forward: any operation in them that synchronizes with the device stalls the
    # engine. CUDA's sync debug mode turns each such operation into an error.
    import torch

    from r3capture.kernels import can_write_host_directly

    if destination == "direct" and not can_write_host_directly("cuda"):
        pytest.skip("this GPU cannot write pinned host memory directly")
    calls = []

    def strict(fn, name):
        def call(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                calls.append(name)

        return call

    def factory(sizes):
        handle = make_r3capture_worker(
            sizes, kernel_impl="triton", device="cuda", destination=destination
        )
        worker = handle.worker
        prepare = worker.prepare_output

        def prepare_output(batch, **kwargs):
            pending = strict(prepare, "prepare_output")(batch, **kwargs)
            if pending is not None:
                pending.enqueue_cpu_copy = strict(pending.enqueue_cpu_copy, "enqueue_cpu_copy")
            return pending

        worker.begin_step = strict(worker.begin_step, "begin_step")
        worker.prepare_output = prepare_output
        return handle

    run_trace(make_trace(scenario, seed=1), factory)  # rows checked against the oracle too
    assert {"begin_step", "prepare_output", "enqueue_cpu_copy"} <= set(calls)
