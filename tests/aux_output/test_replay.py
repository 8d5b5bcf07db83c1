"""Per-request routed experts (``aux_output/replay.py``): the switch, its validation, the
server default, and the scheduler-side wrapper that makes an opted-out request cost the
worker no per-row work.

The wrapper is driven over vLLM 0.33.0's real ``AuxOutputSchedulerConnector`` (on the
simulator's KV-cache double) with stand-in requests, in the order vLLM's scheduler calls it.
Whole traces (opted-in rows byte-identical to vLLM's, opted-out requests emitting nothing)
are in ``test_differential.py``, ``test_random_traces.py`` and ``test_pd_traces.py``.
"""

from __future__ import annotations

import inspect
import types
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stand_in_requests import B, FakeRequest

from r3capture.aux_output import compat, plugin, replay
from r3capture.aux_output.pd_scheduler import PDSchedulerConnector
from r3capture.aux_output.replay import (
    NO_EMIT_START,
    REPLAY_KEY,
    ReplaySchedulerConnector,
    check_replay_default,
    check_request,
    replay_default,
    request_replay,
    wrap_for_replay,
)
from sim.kv import KVCacheDouble

connector_033 = pytest.importorskip("vllm.distributed.aux_output_connector.connector")


# ------------------------------------------------------------------ the switch
@pytest.mark.parametrize("default", [True, False])
@pytest.mark.parametrize("extra_args", [None, {}, {"other": "x"}])
def test_a_request_without_the_switch_gets_the_servers_default(extra_args, default):
    assert request_replay(extra_args, default) is default


@pytest.mark.parametrize(
    "value, expected",
    # The OpenAI server's vllm_xargs narrows JSON true/false to 1/0.
    [(True, True), (False, False), (1, True), (0, False)],
)
@pytest.mark.parametrize("default", [True, False])
def test_booleans_and_their_0_1_forms_decide(value, expected, default):
    assert request_replay({REPLAY_KEY: value}, default) is expected


@pytest.mark.parametrize(
    "value", ["false", "true", "0", "", 2, -1, 0.0, 1.0, None, [], [False], {"on": 1}]
)
def test_any_other_value_is_refused_by_name(value):
    with pytest.raises(ValueError, match=rf"{REPLAY_KEY} must be a boolean") as info:
        request_replay({REPLAY_KEY: value})
    assert f"got {value!r} of type {type(value).__name__}" in str(info.value)


@settings(max_examples=80, deadline=None)
@given(
    value=st.one_of(
        st.text(max_size=6),
        st.integers(),
        st.floats(allow_nan=False),
        st.lists(st.booleans(), max_size=2),
        st.none(),
    )
)
def test_only_booleans_and_0_1_are_accepted(value):
    accepted = value is True or value is False or (type(value) is int and value in (0, 1))
    if accepted:
        assert request_replay({REPLAY_KEY: value}, False) is bool(value)
    else:
        with pytest.raises(ValueError, match=REPLAY_KEY):
            request_replay({REPLAY_KEY: value}, True)


def test_check_request_reads_vllms_sampling_params():
    from vllm import PoolingParams, SamplingParams

    check_request(SamplingParams(extra_args={REPLAY_KEY: False}))
    check_request(SamplingParams())
    check_request(PoolingParams())
    with pytest.raises(ValueError, match="aux_output_replay must be a boolean.*'false'"):
        check_request(SamplingParams(extra_args={REPLAY_KEY: "false"}))


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_the_openai_servers_vllm_xargs_carry_the_switch_into_extra_args(kind):
    """Both request kinds hand ``vllm_xargs`` to ``SamplingParams.extra_args``, JSON
    booleans narrowed to 0/1 (which the switch accepts) and strings kept (which it refuses)."""
    if kind == "completion":
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest as Request

        body = {"model": "m", "prompt": [1, 2, 3]}
    else:
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionRequest as Request,
        )

        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for sent, expected in ((False, False), (True, True), ("false", None)):
        request = Request.model_validate({**body, "vllm_xargs": {REPLAY_KEY: sent}})
        params = request.to_sampling_params(8, {})
        if expected is None:
            with pytest.raises(ValueError, match=REPLAY_KEY):
                check_request(params)
        else:
            check_request(params)
            assert request_replay(params.extra_args) is expected


# ------------------------------------------------------------------ the server default
def _config(backend="triton", default=None):
    additional = {plugin.BACKEND_KEY: backend}
    if default is not None:
        additional[replay.DEFAULT_KEY] = default
    return types.SimpleNamespace(additional_config=additional)


def test_the_default_is_rows_for_every_request_and_off_makes_them_opt_in():
    assert replay_default(_config()) is True
    assert replay_default(types.SimpleNamespace(additional_config=None)) is True
    assert replay_default(_config(default=False)) is False
    assert check_replay_default(_config(default=False), "triton") is False
    assert check_replay_default(_config("torch"), "torch") is True


@pytest.mark.parametrize("value", ["off", 0, None, "false"])
def test_a_default_that_is_not_a_boolean_is_refused(value):
    config = types.SimpleNamespace(additional_config={replay.DEFAULT_KEY: value})
    with pytest.raises(ValueError, match="aux_output_replay_default'] must be true or false"):
        replay_default(config)


def test_opt_in_needs_the_triton_backend():
    with pytest.raises(ValueError, match="off needs --aux-output-backend triton"):
        check_replay_default(_config("torch", default=False), "torch")


def test_the_flag_folds_into_additional_config():
    assert plugin._with_replay_default(None, "off") == {replay.DEFAULT_KEY: False}
    # "on" is the default: vLLM's config stays as it is without the flag.
    assert plugin._with_replay_default(None, "on") is None
    config = {"x": 1}
    assert plugin._with_replay_default(config, "on") is config
    assert plugin._with_replay_default(config, "off") == {"x": 1, replay.DEFAULT_KEY: False}
    assert config == {"x": 1}
    with pytest.raises(ValueError, match="conflicts"):
        plugin._with_replay_default({replay.DEFAULT_KEY: False}, "on")


@pytest.mark.slow
def test_on_vllm_033_the_flag_and_the_admission_check_through_vllms_own_entry_points(
    vllm_033_probe,
):
    """``vllm serve``'s parser, ``create_engine_config`` and the ``InputProcessor`` every
    entry point admits requests with, on vLLM 0.33.0 in a fresh interpreter."""
    seen = vllm_033_probe(Path(__file__).with_name("replay_probe_033.py"))
    assert seen["choices"] == ["on", "off"]
    assert seen["off"] == {plugin.BACKEND_KEY: "triton", replay.DEFAULT_KEY: False}
    assert seen["on_hash_equal"] is True
    assert "off needs --aux-output-backend triton" in seen["off_with_torch"]
    admission = seen["admission"]
    assert admission["false"] == admission["zero"] == "accepted"
    for bad in ("string", "two"):
        assert admission[bad].startswith("client error: aux_output_replay must be a boolean")


# ------------------------------------------------------------------ the scheduler side
def _vllms(kv, kv_connector=None):
    return connector_033.AuxOutputSchedulerConnector(kv, kv_connector)


def _kv():
    return KVCacheDouble(num_blocks=64, block_size=B, hash_block_size=B)


def _schedule(connector, *scheduled):
    """One step of ``scheduled`` (request, tokens): the metadata, then each request advanced
    like vLLM's ``_update_after_schedule``."""
    output = types.SimpleNamespace(num_scheduled_tokens={r.request_id: n for r, n in scheduled})
    metadata = connector.build_connector_meta(output, {r.request_id: r for r, _ in scheduled})
    for request, n in scheduled:
        request.num_computed_tokens += n
    return metadata


def _requests(*extra_args):
    return [
        FakeRequest(f"r{i}", range(100 * i, 100 * i + 40), extra_args=e)
        for i, e in enumerate(extra_args)
    ]


def test_an_opted_out_request_gets_an_emit_start_the_worker_never_reaches():
    kv = _kv()
    plain, wrapped = _vllms(kv), ReplaySchedulerConnector(_vllms(kv))
    answers = []
    for connector in (plain, wrapped):
        out, default, explicit = _requests({REPLAY_KEY: False}, None, {REPLAY_KEY: 1})
        first = _schedule(connector, (out, 40), (default, 40), (explicit, 40))
        for request in (out, default, explicit):
            request.append(7)
        second = _schedule(connector, (out, 1), (default, 1), (explicit, 1))
        answers.append((first, second))
    for vllm_meta, meta in zip(*answers):
        assert meta.requests == {**vllm_meta.requests, "r0": NO_EMIT_START}
        # Everything else the worker gets is vLLM's: hashes, finishes, pins.
        assert meta.block_hashes == vllm_meta.block_hashes
        assert meta.finished_requests == vllm_meta.finished_requests
    assert [meta.requests["r1"] for meta in answers[1]] == [0, 40]


def test_take_output_answers_none_for_an_opted_out_request_without_asking_the_worker():
    wrapped = ReplaySchedulerConnector(_vllms(_kv()))
    out, kept = _requests({REPLAY_KEY: 0}, {REPLAY_KEY: True})
    _schedule(wrapped, (out, 40), (kept, 40))
    out.append(1)
    kept.append(1)
    rows = np.arange(40 * 2, dtype=np.uint8).reshape(40, 1, 2)
    output = {"r1": connector_033.AuxRequestOutput(0, rows)}  # nothing for r0
    assert wrapped.take_output(out, output) is None
    assert wrapped.take_output(out, None) is None
    assert wrapped.take_output(kept, output).tobytes() == rows.tobytes()
    # vLLM's own connector asserts on a request the worker returned nothing for.
    with pytest.raises(AssertionError, match="missing r0"):
        wrapped._inner.take_output(out, output)


def test_the_choice_outlives_a_preemption_and_is_forgotten_when_the_request_finishes():
    wrapped = ReplaySchedulerConnector(_vllms(_kv()))
    (out,) = _requests({REPLAY_KEY: False})
    _schedule(wrapped, (out, 16))
    wrapped.request_finished(out)  # preempted: vLLM calls this too
    out.num_computed_tokens = 0
    out.sampling_params.extra_args = None  # read once: what counts is the first schedule
    assert _schedule(wrapped, (out, 40)).requests == {"r0": NO_EMIT_START}
    out.finished = True
    wrapped.request_finished(out)
    assert wrapped._replays == {} and wrapped._opted_out == set()


def _finish(connector, request):
    request.finished = True
    connector.request_finished(request)


def test_the_counts_say_what_was_returned_and_what_was_withheld(monkeypatch, caplog):
    monkeypatch.setenv("R3CAPTURE_REPLAY_LOG_INTERVAL_S", "0")
    wrapped = ReplaySchedulerConnector(_vllms(_kv()))
    out, kept, late = _requests({REPLAY_KEY: False}, None, {REPLAY_KEY: False})
    out.sampling_params.routed_experts_prompt_start = 30  # withheld: from token 30 on
    never_scheduled = FakeRequest("aborted", range(8))
    _schedule(wrapped, (out, 40), (kept, 40), (late, 16))
    wrapped.request_finished(late)  # preempted: not finished, nothing counted
    for request in (out, kept):
        request.append(1, 2)
    rows = np.zeros((41, 1, 2), dtype=np.uint8)
    output = {"r1": connector_033.AuxRequestOutput(0, rows)}
    assert wrapped.take_output(out, output) is None
    assert len(wrapped.take_output(kept, output)) == 41
    with caplog.at_level("INFO", logger="vllm.r3capture"):
        _finish(wrapped, out)
        _finish(wrapped, kept)
        _finish(wrapped, never_scheduled)
    assert wrapped.counts == replay.ReplayCounts(
        requests_with_rows=1, rows_returned=41, requests_without_rows=1, rows_withheld=41 - 30
    )
    assert caplog.messages[-1] == "r3capture " + wrapped.counts.line()
    assert "41 rows returned to 1 requests; 11 rows withheld from 1 requests" in caplog.text
    assert len(caplog.messages) == 2  # one line a finished request; the aborted one adds none


def test_the_counts_are_logged_at_most_once_an_interval(monkeypatch, caplog):
    monkeypatch.setenv("R3CAPTURE_REPLAY_LOG_INTERVAL_S", "3600")
    wrapped = ReplaySchedulerConnector(_vllms(_kv()))
    requests = _requests(None, {REPLAY_KEY: False}, None)
    _schedule(wrapped, *[(r, 40) for r in requests])
    with caplog.at_level("INFO", logger="vllm.r3capture"):
        for request in requests:
            _finish(wrapped, request)
    assert len(caplog.messages) == 1
    assert wrapped.counts.requests_with_rows == 2 and wrapped.counts.rows_withheld == 39


def test_under_an_opt_in_default_only_requests_that_ask_get_rows():
    wrapped = ReplaySchedulerConnector(_vllms(_kv()), default=False)
    silent, asked, refused = _requests(None, {REPLAY_KEY: True}, {REPLAY_KEY: False})
    meta = _schedule(wrapped, (silent, 40), (asked, 40), (refused, 40))
    assert meta.requests == {"r0": NO_EMIT_START, "r1": 0, "r2": NO_EMIT_START}


def test_a_malformed_switch_that_bypassed_admission_gets_rows_not_a_stopped_engine():
    wrapped = ReplaySchedulerConnector(_vllms(_kv()), default=False)
    (odd,) = _requests({REPLAY_KEY: "no"})
    assert _schedule(wrapped, (odd, 40)).requests == {"r0": 0}


def test_other_calls_reach_vllms_connector():
    kv = _kv()
    wrapped = ReplaySchedulerConnector(_vllms(kv, object()))
    (request,) = _requests({REPLAY_KEY: False})
    assert wrapped.max_cache_hit(request) == 0
    wrapped.request_loading(request, 32)
    assert len(wrapped._inner._loading["r0"]) == 2
    wrapped.reset()
    assert wrapped._inner._generation == 1


def test_under_splice_an_opted_out_decode_leg_request_gets_no_rows_either():
    """Outermost around the P/D wrapper (which must see vLLM's own connector, whose
    internals it replaces): a decode-leg request's emit start is raised to its first
    computed row, unless it opted out."""
    kv = _kv()
    connector = ReplaySchedulerConnector(PDSchedulerConnector(_vllms(kv, object())))
    decode = {"do_remote_prefill": False}
    out = FakeRequest("out", range(40), decode, extra_args={REPLAY_KEY: False})
    kept = FakeRequest("kept", range(200, 240), decode)
    out.num_computed_tokens = kept.num_computed_tokens = 32  # loaded from a prefiller
    meta = _schedule(connector, (out, 8), (kept, 8))
    assert meta.requests == {"out": NO_EMIT_START, "kept": 32}


# ------------------------------------------------------------------ installation
def _scheduler_module():
    module = types.ModuleType("scheduler")
    kv = _kv()

    class Scheduler:
        def __init__(self, vllm_config):
            self.aux_output_connector = _vllms(kv, object())

    module.Scheduler = Scheduler
    return module


@pytest.mark.parametrize("pd_mode", [None, "off", "splice"])
def test_under_triton_every_scheduler_gets_the_wrapper_outermost(pd_mode):
    module = _scheduler_module()
    plugin._patch_scheduler(module)
    config = _config(default=False)
    if pd_mode is not None:
        config.additional_config["aux_output_pd"] = pd_mode
    connector = module.Scheduler(config).aux_output_connector
    assert type(connector) is ReplaySchedulerConnector and connector._default is False
    vllms = connector_033.AuxOutputSchedulerConnector
    assert type(connector._inner) is (PDSchedulerConnector if pd_mode == "splice" else vllms)
    scheduler = module.Scheduler(_config())
    wrap_for_replay(scheduler, True)  # once
    assert type(scheduler.aux_output_connector._inner) is connector_033.AuxOutputSchedulerConnector


def test_vllms_own_backend_keeps_vllms_scheduler():
    module = _scheduler_module()
    plugin._patch_scheduler(module)
    for config in (_config("torch"), types.SimpleNamespace(additional_config=None)):
        scheduler = module.Scheduler(config)
        assert type(scheduler.aux_output_connector) is connector_033.AuxOutputSchedulerConnector


def _input_processor_module():
    module = types.ModuleType("input_processor")

    class InputProcessor:
        def __init__(self, vllm_config):
            self.vllm_config = vllm_config

        def _validate_params(self, params, supported_tasks):
            if getattr(params, "bad", False):
                raise ValueError("vLLM's own check")
            return "watermarking"

    module.InputProcessor = InputProcessor
    return module


def test_under_triton_the_input_processor_refuses_a_malformed_switch():
    module = _input_processor_module()
    plugin._patch_input_processor(module)
    validate = module.InputProcessor._validate_params
    plugin._patch_input_processor(module)
    assert module.InputProcessor._validate_params is validate  # idempotent
    bad = types.SimpleNamespace(extra_args={REPLAY_KEY: "false"})
    good = types.SimpleNamespace(extra_args={REPLAY_KEY: 0})
    triton = module.InputProcessor(_config())
    assert triton._validate_params(good, ("generate",)) == "watermarking"
    with pytest.raises(ValueError, match="aux_output_replay must be a boolean") as refused:
        triton._validate_params(bad, ("generate",))
    # Also vLLM's validation error: the OpenAI server answers it with 400 naming the key
    # (AsyncLLM turns a bare ValueError from admission into a 500).
    from vllm.exceptions import VLLMClientError, VLLMValidationError

    assert isinstance(refused.value, VLLMValidationError)
    assert isinstance(refused.value, VLLMClientError)
    assert (refused.value.parameter, refused.value.value) == (REPLAY_KEY, "false")
    with pytest.raises(ValueError, match="vLLM's own check"):
        triton._validate_params(types.SimpleNamespace(bad=True), ())
    # vLLM's own backend: vLLM's check only (it ignores the key and returns every row).
    torch_backend = module.InputProcessor(_config("torch"))
    assert torch_backend._validate_params(bad, ("generate",)) == "watermarking"
    with pytest.raises(compat.UnsupportedVLLMError, match="has no InputProcessor"):
        plugin._patch_input_processor(types.ModuleType("input_processor"))


def test_vllms_input_processor_validates_every_request_where_the_hook_is():
    """Drift guard: vLLM 0.33.0's ``process_inputs`` (every entry point's admission of a
    request) calls the method the hook wraps, with the request's params first."""
    from vllm.v1.engine import input_processor

    assert input_processor.__name__ == compat.INPUT_PROCESSOR_MODULE
    cls = getattr(input_processor, compat.INPUT_PROCESSOR_CLASS)
    source = inspect.getsource(cls.process_inputs)
    assert f"self.{compat.VALIDATE_PARAMS_METHOD}(params, supported_tasks)" in source


def test_register_hooks_vllms_input_processor_when_it_is_imported(after_register):
    after_register(
        compat.INPUT_PROCESSOR_MODULE,
        "from vllm.v1.engine.input_processor import InputProcessor\n"
        "assert getattr(InputProcessor._validate_params, plugin._WRAPPED, False)\n",
    )
