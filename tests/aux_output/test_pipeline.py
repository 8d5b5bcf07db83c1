"""Pipeline parallelism: the relay of routed-expert rows between stages, its hook into the
model runner, and the lifted config check.

A pipeline is simulated with one capture buffer per stage holding only the columns of the
layers that stage runs (what vLLM's router hooks write); the last stage's buffer must end up
equal, byte for byte, to the buffer a single stage would have captured.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from r3capture.aux_output import pipeline, plugin
from r3capture.aux_output.pipeline import RELAY_KEY, PipelineRelay, relay_after_forward


class Tensors:
    """What vLLM's ``IntermediateTensors`` offers the relay: a ``tensors`` dict."""

    def __init__(self, tensors: dict) -> None:
        self.tensors = tensors


def stage_ranges(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """vLLM's even split (the last stage takes the remainder)."""
    per = num_layers // num_stages
    bounds = [i * per for i in range(num_stages)] + [num_layers]
    return list(zip(bounds[:-1], bounds[1:]))


def run_pipeline(truth: torch.Tensor, num_stages: int, num_tokens: int, dtype, dense=()):
    """Each stage captures its own MoE columns of ``truth``, then relays; returns the last
    stage's capture buffer and the bytes relayed per hop."""
    T, L, K = truth.shape
    ranges = stage_ranges(L, num_stages)
    received, sent_bytes = None, []
    for stage, (start, end) in enumerate(ranges):
        buffer = torch.zeros(T, L, K, dtype=torch.int32)
        moe = [layer for layer in range(start, end) if layer not in dense]
        buffer[:num_tokens, moe] = truth[:num_tokens, moe]  # the router hooks of this stage
        relay = PipelineRelay(
            buffer, (start, end), dtype, is_first=stage == 0, is_last=stage == num_stages - 1
        )
        output = None if relay.is_last else Tensors({"hidden_states": torch.zeros(num_tokens, 4)})
        relay_after_forward(relay, received, output, num_tokens)
        if output is not None:
            sent_bytes.append(
                output.tensors[RELAY_KEY].numel() * output.tensors[RELAY_KEY].itemsize
            )
        received = output
    return buffer, sent_bytes


@pytest.mark.parametrize("num_stages", [2, 3, 4])
@pytest.mark.parametrize("num_experts", [128, 384])
def test_last_stage_sees_every_stage_rows_as_one_stage_would(num_stages, num_experts):
    gen = torch.Generator().manual_seed(num_stages * 1000 + num_experts)
    T, L, K, n = 40, 7, 3, 29
    dtype = torch.uint8 if num_experts <= 256 else torch.uint16
    dense = (0,)  # a dense first layer (DeepSeek-style) stays 0, as with one stage
    truth = torch.randint(0, num_experts, (T, L, K), generator=gen, dtype=torch.int32)
    truth[:, list(dense)] = 0
    last, sent = run_pipeline(truth, num_stages, n, dtype, dense=dense)
    assert torch.equal(last[:n], truth[:n])
    # What vLLM snapshots and r3capture's kernel packs: the same bytes.
    assert last[:n].to(dtype).numpy().tobytes() == truth[:n].to(dtype).numpy().tobytes()
    assert sent == [n * L * K * dtype.itemsize] * (num_stages - 1)


def test_a_stage_without_moe_layers_relays_unchanged():
    truth = torch.randint(0, 100, (10, 6, 2), dtype=torch.int32)
    truth[:, :3] = 0  # stage 0 of 2 holds only dense layers
    last, _ = run_pipeline(truth, 2, 10, torch.uint8, dense=(0, 1, 2))
    assert torch.equal(last[:10], truth[:10])


def test_relayed_rows_do_not_alias_the_capture_buffer():
    """The next forward overwrites the capture buffer while the send may still be in flight."""
    buffer = torch.randint(0, 9, (8, 4, 2), dtype=torch.int32)
    relay = PipelineRelay(buffer, (0, 2), torch.uint8, is_first=True, is_last=False)
    rows = relay.snapshot(5)
    before = rows.clone()
    buffer.fill_(3)
    assert torch.equal(rows, before) and rows.shape == (5, 4, 2)


@pytest.mark.parametrize(
    "received, message",
    [
        ({}, "got nothing"),
        ({RELAY_KEY: torch.zeros(6, 4, 2, dtype=torch.int32)}, "torch.int32"),
        ({RELAY_KEY: torch.zeros(6, 4, 2, dtype=torch.uint16)}, "torch.uint16"),
        ({RELAY_KEY: torch.zeros(6, 3, 2, dtype=torch.uint8)}, r"\(6, 3, 2\)"),
        ({RELAY_KEY: torch.zeros(4, 4, 2, dtype=torch.uint8)}, r"\(4, 4, 2\)"),
        ({RELAY_KEY: torch.zeros(5, 4, 2, dtype=torch.uint8)}, r"\(5, 4, 2\)"),
        ({RELAY_KEY: np.zeros((6, 4, 2), np.uint8)}, "ndarray"),
    ],
    ids=[
        "missing",
        "int32",
        "wrong-dtype",
        "wrong-layers",
        "too-few-rows",
        "one-row-short",
        "numpy",
    ],  # fmt: skip
)
def test_a_malformed_relay_is_refused_before_any_row_is_merged(received, message):
    buffer = torch.full((8, 4, 2), 7, dtype=torch.int32)
    relay = PipelineRelay(buffer, (2, 4), torch.uint8, is_first=False, is_last=True)
    with pytest.raises(RuntimeError, match=f"{RELAY_KEY}.*{message}"):
        relay.merge(received, 6)
    assert bool((buffer == 7).all())


def test_stage_placement_errors_are_named():
    buffer = torch.zeros(4, 4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="own_layers must be"):
        PipelineRelay(buffer, (3, 9), torch.uint8, is_first=True, is_last=False)
    relay = PipelineRelay(buffer, (2, 4), torch.uint8, is_first=False, is_last=False)
    with pytest.raises(RuntimeError, match="without intermediate tensors"):
        relay_after_forward(relay, None, Tensors({}), 2)
    with pytest.raises(RuntimeError, match="not IntermediateTensors"):
        relay_after_forward(relay, Tensors({RELAY_KEY: buffer.to(torch.uint8)}), None, 2)


def test_a_stage_that_owns_no_layer_passes_the_rows_on():
    """A stage with an empty layer range (its router hooks write nothing) merges every
    earlier column and sends the rows on unchanged."""
    sent = torch.randint(0, 200, (6, 4, 2), dtype=torch.int32)
    buffer = torch.zeros(6, 4, 2, dtype=torch.int32)
    relay = PipelineRelay(buffer, (2, 2), torch.uint8, is_first=False, is_last=False)
    output = Tensors({})
    relay_after_forward(relay, Tensors({RELAY_KEY: sent.to(torch.uint8)}), output, 5)
    expected = sent[:5].clone()
    expected[:, 2:] = 0
    assert torch.equal(output.tensors[RELAY_KEY], expected.to(torch.uint8))


def test_pipeline_size_reads_one_for_a_config_without_pipeline_settings():
    assert pipeline.pipeline_size(types.SimpleNamespace()) == 1
    unset = types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(pipeline_parallel_size=None)
    )
    assert pipeline.pipeline_size(unset) == 1
    assert pipeline.pipeline_size(_config("triton", pp=1)) == 1


# ------------------------------------------------------------------ model runner hook


def _runner_module(connector, num_tokens=5, state=True):
    calls = []

    class GPUModelRunner:
        aux_output_connector = connector

        def __init__(self):
            self.execute_model_state = None

        def sample(self, *args):
            return None, None, None

        def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
            calls.append(dummy_run)
            if state:
                batch = types.SimpleNamespace(num_tokens=num_tokens)
                self.execute_model_state = types.SimpleNamespace(input_batch=batch)
            return Tensors({"hidden_states": torch.zeros(num_tokens, 2)})

    module = types.ModuleType("runner")
    module.GPUModelRunner = GPUModelRunner
    module.get_aux_output_connector = lambda *args: connector
    plugin._patch_model_runner(module)
    return module.GPUModelRunner(), calls


def test_execute_model_attaches_the_rows_of_a_first_stage():
    buffer = torch.randint(0, 50, (8, 4, 2), dtype=torch.int32)
    relay = PipelineRelay(buffer, (0, 2), torch.uint8, is_first=True, is_last=False)
    runner, calls = _runner_module(types.SimpleNamespace(pipeline_relay=relay), num_tokens=5)
    output = runner.execute_model("scheduler_output")
    assert torch.equal(output.tensors[RELAY_KEY], buffer[:5].to(torch.uint8))
    assert calls == [False]


def test_execute_model_merges_on_the_last_stage():
    buffer = torch.zeros(8, 4, 2, dtype=torch.int32)
    relay = PipelineRelay(buffer, (2, 4), torch.uint8, is_first=False, is_last=True)
    runner, _ = _runner_module(types.SimpleNamespace(pipeline_relay=relay), num_tokens=3)
    sent = torch.arange(24, dtype=torch.uint8).view(3, 4, 2)
    runner.execute_model("scheduler_output", Tensors({RELAY_KEY: sent}))
    assert torch.equal(buffer[:3, :2], sent[:, :2].int())
    assert bool((buffer[:, 2:] == 0).all()) and bool((buffer[3:] == 0).all())


@pytest.mark.parametrize(
    "case",
    ["vllm-connector", "dummy-run", "dummy-run-positional", "no-forward", "no-connector"],
)
def test_execute_model_passes_through_without_a_relayed_forward(case):
    buffer = torch.ones(8, 4, 2, dtype=torch.int32)
    relay = PipelineRelay(buffer, (0, 2), torch.uint8, is_first=True, is_last=False)
    connector = {
        "vllm-connector": object(),  # vLLM's own backend: no pipeline_relay
        "no-connector": None,
    }.get(case, types.SimpleNamespace(pipeline_relay=relay))
    runner, calls = _runner_module(connector, state=case != "no-forward")
    if case == "dummy-run":
        output = runner.execute_model("s", None, dummy_run=True)
    elif case == "dummy-run-positional":  # dummy_run is execute_model's third parameter
        output = runner.execute_model("s", None, True)
    else:
        output = runner.execute_model("s")
    assert RELAY_KEY not in output.tensors
    assert calls == [case.startswith("dummy-run")]


# ------------------------------------------------------------------ the config check

PP_MESSAGE = "incompatible with pipeline parallelism"


def _config(backend, pp=2, dcp=1):
    return types.SimpleNamespace(
        aux_output_config=types.SimpleNamespace(enabled=True),
        use_v2_model_runner=True,
        model_config=types.SimpleNamespace(runner_type="generate", is_moe=True),
        cache_config=types.SimpleNamespace(enable_prefix_caching=True),
        speculative_config=None,
        parallel_config=types.SimpleNamespace(
            pipeline_parallel_size=pp,
            decode_context_parallel_size=dcp,
            prefill_context_parallel_size=1,
        ),
        kv_transfer_config=None,
        additional_config={} if backend is None else {"aux_output_backend": backend},
    )


def test_vllm_still_refuses_pipeline_parallelism_itself(vllm_verify):
    """Drift guard: the refusal r3capture lifts is still vLLM's."""
    original, _ = vllm_verify
    with pytest.raises(ValueError, match=PP_MESSAGE):
        original(_config("triton"))


def test_triton_lifts_only_the_pipeline_refusal(vllm_verify):
    _, patched = vllm_verify
    patched(_config("triton", pp=2))
    patched(_config("triton", pp=4))
    for backend in (None, "torch"):
        with pytest.raises(ValueError, match=PP_MESSAGE):
            patched(_config(backend, pp=2))
    # Every other refusal still applies, with vLLM's message.
    with pytest.raises(ValueError, match="context parallelism"):
        patched(_config("triton", pp=2, dcp=2))
    config = _config("triton", pp=2)
    config.cache_config.enable_prefix_caching = False
    with pytest.raises(ValueError, match="requires prefix caching"):
        patched(config)
    assert config.parallel_config.pipeline_parallel_size == 2  # a view, never a mutation


def test_config_patch_is_applied_once(vllm_verify):
    _, patched = vllm_verify
    module = types.ModuleType("config")
    module.VllmConfig = type("VllmConfig", (), {"_verify_aux_output_compatibility": patched})
    plugin._patch_vllm_config(module)
    assert module.VllmConfig._verify_aux_output_compatibility is patched
    assert pipeline.pipeline_size(_config("triton", pp=3)) == 3
