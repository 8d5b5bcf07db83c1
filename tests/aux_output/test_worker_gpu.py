"""The worker on a CUDA device: the Triton kernel writing pinned host memory directly, and
through device staging, must give the bytes the CPU reference path gives and the oracle's
rows. Needs only torch, triton and a GPU (no vLLM), so it runs in bench/gpu_check.sh."""

from __future__ import annotations

import pytest

from sim import make_trace, run_trace
from sim.workers import make_r3capture_worker

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("destination", ["direct", "staging"])
@pytest.mark.parametrize("scenario", ["async_spec", "multi_turn", "chunked_prefill", "eviction"])
def test_cuda_worker_matches_the_cpu_reference(scenario, destination):
    from r3capture.kernels import can_write_host_directly

    if destination == "direct" and not can_write_host_directly("cuda"):
        pytest.skip("this GPU cannot write pinned host memory directly")
    trace = make_trace(scenario, seed=1)
    cpu = run_trace(trace, lambda sizes: make_r3capture_worker(sizes, kernel_impl="reference"))

    def on_cuda(sizes):
        return make_r3capture_worker(
            sizes, kernel_impl="triton", device="cuda", destination=destination
        )

    gpu = run_trace(trace, on_cuda)  # also checks every request against the routing oracle
    assert [s.outputs for s in gpu.steps] == [s.outputs for s in cpu.steps]
