"""`vllm serve --enable-return-routed-experts --aux-output-backend triton`, real server and
client, against stock vLLM's backend and HF transformers' router (tiny Qwen3-MoE, float32)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from demo import checks
from demo.scenario import host_rows
from demo.tiny_model import TINY_CONFIG

pytestmark = pytest.mark.e2e

SHAPE = (TINY_CONFIG["num_hidden_layers"], TINY_CONFIG["num_experts_per_tok"])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_completions_return_routed_experts(request, backend):
    run = request.getfixturevalue(f"{backend}_run")
    assert run.results, "no requests answered"
    assert checks.check_shapes(run, SHAPE, np.uint8) == []


def test_triton_rows_byte_identical_to_vllm_backend(torch_run, triton_run):
    assert checks.check_same_as(triton_run, torch_run) == []


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rows_equal_hf_router_top_k(request, hf_router, backend):
    assert checks.check_router(request.getfixturevalue(f"{backend}_run"), hf_router) == []


def test_prefix_cache_hit_returns_full_rows(triton_run, hf_router):
    assert checks.check_prefix_hit(triton_run) == []
    turn2 = triton_run.results["turn2"]
    # Turn 1 left KV for 74 tokens: two whole 32-token blocks are reused.
    assert turn2.cached_tokens == 64
    expected = hf_router.topk(turn2.sequence)[: turn2.cached_tokens]
    np.testing.assert_array_equal(turn2.rows[: turn2.cached_tokens], expected)


def test_routed_experts_prompt_start_is_honoured(triton_run, hf_router):
    r = triton_run.results["prompt_start"]
    assert r.prompt_start == 50 and r.cached_tokens
    assert len(r.rows) == len(r.sequence) - 1 - 50
    np.testing.assert_array_equal(r.rows, hf_router.topk(r.sequence)[50:-1])


def test_speculative_decoding_returns_only_accepted_rows(triton_run):
    assert checks.check_speculative(triton_run) == []


def test_server_counters_agree_with_returned_rows(torch_run, triton_run):
    # The report's host-row accounting rests on these counters; both servers ran one schedule.
    assert checks.check_row_accounting(triton_run) == []
    assert checks.check_row_accounting(torch_run) == []
    assert host_rows(torch_run.metrics) == host_rows(triton_run.metrics)


def test_pipeline_parallel_rows_equal_one_stage_and_hf(triton_pp2_run, triton_run, hf_router):
    """PP = 2: layer 0 runs on stage 0, layer 1 on stage 1; stage 0's rows ride to stage 1
    with the hidden states (aux_output/pipeline.py). Every request, including the prefix-cache
    hit and routed_experts_prompt_start, returns the rows a one-stage server returns."""
    assert checks.check_shapes(triton_pp2_run, SHAPE, np.uint8) == []
    assert checks.check_same_as(triton_pp2_run, triton_run) == []
    assert checks.check_router(triton_pp2_run, hf_router) == []
    assert triton_pp2_run.results["turn2"].cached_tokens == 64
    # Stage 0's layer is really relayed: it varies across tokens (zeros would not).
    layer0 = np.concatenate([r.rows[:, 0] for r in triton_pp2_run.results.values()])
    assert len(np.unique(layer0)) > 2


def test_only_the_last_pipeline_stage_owns_the_data_plane(triton_pp2_run, log_dir):
    """Under PP the model output, and so every prepare_output, comes from the last stage:
    only its worker keeps a store and device buffers; the first stage captures and relays."""
    log = (log_dir / "triton-pp2.log").read_text(errors="replace")
    roles = re.findall(r"r3capture: triton aux-output backend: .*, (output rank|capture only)", log)
    assert sorted(roles) == ["capture only", "output rank"], roles


@pytest.mark.parametrize("name", ["torch", "triton", "triton-pp2"])
def test_a_stopped_server_leaves_no_shared_memory_to_the_resource_tracker(
    request, log_dir, assert_stopped_in_order, name
):
    """``VLLMServer.stop()`` shuts vLLM down in order (SIGTERM to the API server, a shutdown
    timeout): Python's resource tracker finds nothing to clean up (``assert_stopped_in_order``
    has the one exception vLLM imposes). With vLLM's default timeout (0: the engine core is
    killed at once) or SIGTERM to the whole group, it warned of 2-3 "leaked shared_memory
    objects" (vLLM's own message queues, also with the torch backend) and semaphores."""
    request.getfixturevalue(name.replace("-", "_") + "_run")  # started, served and stopped
    assert_stopped_in_order((log_dir / f"{name}.log").read_text(errors="replace"))
