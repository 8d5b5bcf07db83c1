"""Prefill/decode disaggregation: ``--aux-output-pd``, the lifted P/D refusal, and ``splice``.

The config tests run vLLM 0.33.0's own compatibility check (patched onto a stand-in class, the
real ``VllmConfig`` is left alone) on stand-in configs that carry vLLM's real
``KVTransferConfig``, so ``has_connector`` (MultiConnector children included) is vLLM's.
"""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_pipeline import _config as pipeline_config

from r3capture.aux_output import compat, pd, plugin

PD_MESSAGE = "PD auxiliary output is not supported"


# ------------------------------------------------------------------ the config check


def _kv(connector: str | None, children: tuple[str, ...] = ()):
    from vllm.config.kv_transfer import KVTransferConfig

    if connector is None:
        return None
    extra = {"connectors": [{"kv_connector": c, "kv_role": "kv_both"} for c in children]}
    return KVTransferConfig(
        kv_connector=connector,
        kv_role="kv_both",
        kv_buffer_device="cpu",
        kv_connector_extra_config=extra if children else {},
    )


def _config(backend="triton", mode=None, connector=None, children=(), pp=1, **overrides):
    config = pipeline_config(backend, pp=pp)
    if mode is not None:
        config.additional_config[pd.PD_KEY] = mode
    config.kv_transfer_config = _kv(connector, children)
    for name, value in overrides.items():
        setattr(config, name, value)
    return config


@pytest.mark.parametrize("connector", pd.PD_CONNECTORS)
def test_vllm_still_refuses_each_pd_connector_itself(vllm_verify, connector):
    """Drift guard: the refusal r3capture lifts is still vLLM's, for each connector, direct or
    as a MultiConnector child."""
    original, _ = vllm_verify
    with pytest.raises(ValueError, match=f"{connector}; {PD_MESSAGE}"):
        original(_config(connector=connector))
    with pytest.raises(ValueError, match=f"{connector}; {PD_MESSAGE}"):
        original(_config(connector="MultiConnector", children=("OffloadingConnector", connector)))


@pytest.mark.parametrize("connector", pd.PD_CONNECTORS)
def test_splice_lifts_the_pd_refusal(vllm_verify, connector):
    _, patched = vllm_verify
    patched(_config(mode="splice", connector=connector))
    patched(_config(mode="splice", connector="MultiConnector", children=("LMCache", connector)))
    patched(_config(mode="splice", connector="MultiConnector", children=pd.PD_CONNECTORS))


@pytest.mark.parametrize("mode", [None, "off"])
@pytest.mark.parametrize("backend", [None, "torch", "triton"])
@pytest.mark.parametrize("connector", pd.PD_CONNECTORS)
def test_without_splice_vllms_refusal_stays(vllm_verify, connector, backend, mode):
    _, patched = vllm_verify
    with pytest.raises(ValueError, match=f"{connector}; {PD_MESSAGE}"):
        patched(_config(backend, mode, connector=connector))
    with pytest.raises(ValueError, match=f"{connector}; {PD_MESSAGE}"):
        patched(_config(backend, mode, connector="MultiConnector", children=(connector,)))


@pytest.mark.parametrize("backend", [None, "torch"])
def test_splice_without_triton_is_refused_clearly_before_vllms_check(vllm_verify, backend):
    _, patched = vllm_verify
    for connector in (None, "NixlConnector"):
        with pytest.raises(
            ValueError, match="--aux-output-pd splice needs --aux-output-backend triton"
        ):
            patched(_config(backend, "splice", connector=connector))


def test_splice_keeps_every_other_refusal(vllm_verify):
    _, patched = vllm_verify
    no_prefix = _config(mode="splice", connector="NixlConnector")
    no_prefix.cache_config.enable_prefix_caching = False
    with pytest.raises(ValueError, match="requires prefix caching"):
        patched(no_prefix)
    dense = _config(mode="splice", connector="NixlConnector")
    dense.model_config.is_moe = False
    with pytest.raises(ValueError, match="only supports MoE models"):
        patched(dense)
    with pytest.raises(ValueError, match="context parallelism"):
        config = _config(mode="splice", connector="MooncakeConnector")
        config.parallel_config.decode_context_parallel_size = 2
        patched(config)
    with pytest.raises(ValueError, match="Model Runner V2"):
        patched(_config(mode="splice", connector="NixlConnector", use_v2_model_runner=False))


def test_splice_and_pipeline_lifts_compose(vllm_verify):
    """triton lifts PP > 1, splice lifts the P/D connectors; together they lift both, and
    neither mutates the config."""
    _, patched = vllm_verify
    config = _config(mode="splice", connector="NixlConnector", pp=2)
    patched(config)
    assert config.parallel_config.pipeline_parallel_size == 2
    assert config.kv_transfer_config.has_connector("NixlConnector")
    with pytest.raises(ValueError, match=PD_MESSAGE):
        patched(_config(mode="off", connector="NixlConnector", pp=2))
    with pytest.raises(ValueError, match="pipeline parallelism"):
        patched(_config("torch", connector="NixlConnector", pp=2))


def test_other_connectors_are_unaffected(vllm_verify):
    _, patched = vllm_verify
    for mode in (None, "splice"):
        patched(_config(mode=mode, connector="ExampleConnector"))
        patched(_config(mode=mode, connector="OffloadingConnector"))
        patched(_config(mode=mode))


def test_the_view_answers_other_names_from_vllm():
    kv = _kv("MultiConnector", ("ExampleConnector", "NixlConnector"))
    view = pd._ConfigWithoutPD(types.SimpleNamespace(kv_transfer_config=kv, x=1))
    assert view.x == 1
    assert view.kv_transfer_config.has_connector("ExampleConnector")
    assert not view.kv_transfer_config.has_connector("NixlConnector")
    assert not view.kv_transfer_config.has_connector("OffloadingConnector")
    assert view.kv_transfer_config.kv_connector == "MultiConnector"
    assert (
        pd._ConfigWithoutPD(types.SimpleNamespace(kv_transfer_config=None)).kv_transfer_config
        is None
    )


# ------------------------------------------------------------------ mode and flag


def test_mode_defaults_to_off_and_is_validated():
    assert pd.check_pd(types.SimpleNamespace(), "torch") == "off"
    assert pd.check_pd(types.SimpleNamespace(additional_config=None), "torch") == "off"
    assert pd.check_pd(types.SimpleNamespace(additional_config={}), "triton") == "off"
    config = types.SimpleNamespace(additional_config={pd.PD_KEY: "splice"})
    assert pd.check_pd(config, "triton") == "splice"
    for bad in ("Splice", "on", "", 1, None):
        config = types.SimpleNamespace(additional_config={pd.PD_KEY: bad})
        with pytest.raises(ValueError, match=r"aux_output_pd=.* is not one of \('off', 'splice'\)"):
            pd.check_pd(config, "triton")


def test_flag_value_merges_into_additional_config():
    assert plugin._with_pd(None, "splice") == {pd.PD_KEY: "splice"}
    assert plugin._with_pd(None, "off") is None
    config = {"aux_output_backend": "triton"}
    assert plugin._with_pd(config, "off") is config
    merged = plugin._with_pd(config, "splice")
    assert merged == {"aux_output_backend": "triton", pd.PD_KEY: "splice"}
    assert config == {"aux_output_backend": "triton"}
    assert plugin._with_pd({pd.PD_KEY: "splice"}, "splice") == {pd.PD_KEY: "splice"}
    with pytest.raises(ValueError, match="conflicts"):
        plugin._with_pd({pd.PD_KEY: "off"}, "splice")
    with pytest.raises(ValueError, match="conflicts"):
        plugin._with_pd({pd.PD_KEY: "splice"}, "off")
    with pytest.raises(ValueError, match="needs additional_config to be a dict"):
        plugin._with_pd("x", "splice")


def test_flag_is_added_to_a_parser_and_folded_into_additional_config(monkeypatch):
    import argparse

    class EngineArgs:
        def __init__(self):
            self.additional_config = None

        @staticmethod
        def add_cli_args(parser):
            parser.add_argument("--enable-return-routed-experts", action="store_true")
            return parser

        @classmethod
        def from_cli_args(cls, args):
            return cls()

        def create_engine_config(self):
            return types.SimpleNamespace(
                additional_config=self.additional_config,
                aux_output_config=types.SimpleNamespace(enable_return_routed_experts=True),
            )

    monkeypatch.setattr(compat, "vllm_version", lambda: "0.33.0")
    module = types.ModuleType("arg_utils")
    module.EngineArgs = EngineArgs
    plugin._patch_engine_args(module)
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert parser._option_string_actions["--aux-output-pd"].choices == ("off", "splice")

    def engine_args(*argv):
        return EngineArgs.from_cli_args(parser.parse_args(list(argv)))

    assert engine_args().additional_config is None
    assert engine_args("--aux-output-pd", "off").additional_config is None
    args = engine_args("--aux-output-backend", "triton", "--aux-output-pd", "splice")
    assert args.additional_config == {"aux_output_backend": "triton", "aux_output_pd": "splice"}
    assert args.create_engine_config().additional_config == args.additional_config
    with pytest.raises(ValueError, match="splice needs --aux-output-backend triton"):
        engine_args("--aux-output-pd", "splice").create_engine_config()
    with pytest.raises(ValueError, match="splice needs --aux-output-backend triton"):
        engine_args(
            "--aux-output-backend", "torch", "--aux-output-pd", "splice"
        ).create_engine_config()
    with pytest.raises(SystemExit):
        parser.parse_args(["--aux-output-pd", "nixl"])


def _vllm_033_installed() -> bool:
    version = compat.vllm_version()
    return version is not None and version.startswith("0.33")


@pytest.mark.slow
@pytest.mark.skipif(not _vllm_033_installed(), reason="needs vLLM 0.33.x (the .venv environment)")
def test_on_vllm_033_the_nixl_config_through_vllms_engine_args(vllm_033_probe):
    """``vllm serve``'s parser and ``create_engine_config`` on vLLM 0.33.0, in a fresh
    interpreter (plugins loaded by vLLM): NIXL with routed experts is refused without the
    flag, built with ``--aux-output-pd splice``, and ``splice`` without ``triton`` is refused
    with r3capture's message."""
    seen = vllm_033_probe(Path(__file__).with_name("pd_probe_033.py"))
    for connector in ("NixlConnector", "MultiConnector/NixlConnector", "MooncakeConnector"):
        assert PD_MESSAGE in seen[f"{connector} off"], seen
        assert seen[f"{connector} splice"] == {
            "aux_output_backend": "triton",
            "aux_output_pd": "splice",
        }
    assert "splice needs --aux-output-backend triton" in seen["NixlConnector splice torch"]
    assert "splice needs --aux-output-backend triton" in seen["ExampleConnector splice torch"]
    assert seen["ExampleConnector off"] == {"aux_output_backend": "triton"}


# ------------------------------------------------------------------ splice

L, K = 3, 2


def _rows(n, dtype=np.uint8, seed=0, shape=(L, K)):
    return np.random.default_rng(seed).integers(0, 200, size=(n, *shape)).astype(dtype)


def test_splice_joins_by_length():
    truth = _rows(76)  # one instance's rows of a 77-token request
    prefill = truth[:70]  # the prefiller's prompt rows (max_tokens=1)
    decode = truth[70:]  # the decoder asked from routed_experts_prompt_start=70
    out = pd.splice(prefill, decode, 77)
    assert out.dtype == np.uint8 and out.shape == (76, L, K)
    assert out.tobytes() == truth.tobytes()
    assert not np.shares_memory(out, prefill) and not np.shares_memory(out, decode)


def test_splice_takes_the_decoders_rows_where_both_have_them():
    """The decoder recomputed the prompt's last block (an unaligned or trimmed load): its
    rows from token 64 on win; the prefiller's rows past the start are not used."""
    truth = _rows(76, np.uint16)
    prefill = truth[:70].copy()
    prefill[64:] = 999  # must not appear
    out = pd.splice(prefill, truth[64:], 77)
    assert out.tobytes() == truth.tobytes()


@pytest.mark.parametrize(
    ("prefill", "decode", "num_tokens", "message"),
    [
        (None, _rows(5), 10, "prefill_rows is missing"),
        (_rows(5), None, 10, "decode_rows is missing"),
        ([[[1, 2]]], _rows(5), 10, "prefill_rows must be a numpy array, got list"),
        (_rows(3), _rows(5), 10, "prefill_rows has 3 rows, short of the 4 rows"),
        (_rows(0), _rows(8), 10, "prefill_rows has 0 rows, short of the 1 rows"),
        (_rows(9), _rows(10), 10, "decode_rows has 10 rows, more than num_tokens - 1 = 9"),
        (_rows(9), _rows(5, shape=(L, K + 1)), 10, r"\(L, K\) mismatch"),
        (_rows(9, shape=(L + 1, K)), _rows(5), 10, r"\(L, K\) mismatch"),
        (_rows(9, np.uint16), _rows(5), 10, "dtype mismatch: prefill_rows uint16, decode_rows u"),
        (_rows(9).astype(np.float32), _rows(5).astype(np.float32), 10, "integer expert ids"),
        (_rows(9).astype(bool), _rows(5).astype(bool), 10, "integer expert ids"),
        (_rows(9)[:, 0], _rows(5), 10, r"prefill_rows must be \[n, L, K\] \(3 dims\)"),
        (_rows(9), _rows(5)[None], 10, r"decode_rows must be \[n, L, K\] \(3 dims\)"),
        (_rows(0), _rows(0), 0, "num_tokens must be >= 1, got 0"),
        (_rows(0), _rows(0), -3, "num_tokens must be >= 1, got -3"),
        (_rows(9), _rows(5), 10.0, "num_tokens must be an integer"),
        (_rows(9), _rows(5), True, "num_tokens must be an integer"),
    ],
    ids=[
        "no-prefill", "no-decode", "list", "shortfall", "empty-prefill", "decode-too-long",
        "K-mismatch", "L-mismatch", "dtype-mismatch", "float", "bool", "prefill-2d",
        "decode-4d", "zero-tokens", "negative-tokens", "float-tokens", "bool-tokens",
    ],
)  # fmt: skip
def test_splice_refuses_and_names_what_is_wrong(prefill, decode, num_tokens, message):
    with pytest.raises(ValueError, match=message):
        pd.splice(prefill, decode, num_tokens)


def test_splice_edge_lengths():
    one = pd.splice(_rows(0), _rows(0), 1)
    assert one.shape == (0, L, K) and one.dtype == np.uint8
    truth = _rows(9)
    assert pd.splice(truth, _rows(0), 10).tobytes() == truth.tobytes()  # decoder had none
    assert pd.splice(_rows(0), truth, 10).tobytes() == truth.tobytes()  # decoder had all
    assert pd.splice(truth, truth[4:], np.int64(10)).tobytes() == truth.tobytes()


_DTYPES = st.sampled_from([np.uint8, np.uint16, np.int32, np.int64])


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    num_tokens=st.integers(1, 60),
    shape=st.tuples(st.integers(1, 4), st.integers(1, 3)),
    dtype=_DTYPES,
)
def test_a_good_splice_equals_the_single_instance_rows(data, num_tokens, shape, dtype):
    """Whatever the prefiller returned up to (at least) the decoder's first row, and
    whatever suffix the decoder returned, the splice is the single instance's rows."""
    truth = _rows(num_tokens - 1, dtype, seed=num_tokens, shape=shape)
    num_decode = data.draw(st.integers(0, num_tokens - 1), label="decode rows")
    start = num_tokens - 1 - num_decode
    num_prefill = data.draw(st.integers(start, num_tokens - 1), label="prefill rows")
    out = pd.splice(truth[:num_prefill], truth[start:], num_tokens)
    assert out.dtype == truth.dtype and out.shape == truth.shape
    assert out.tobytes() == truth.tobytes()


@settings(max_examples=200, deadline=None)
@given(
    num_tokens=st.integers(-3, 40),
    num_prefill=st.integers(0, 45),
    num_decode=st.integers(0, 45),
    prefill_shape=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    decode_shape=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    prefill_dtype=_DTYPES,
    decode_dtype=_DTYPES,
)
def test_every_bad_combination_is_refused_and_every_good_one_accepted(
    num_tokens, num_prefill, num_decode, prefill_shape, decode_shape, prefill_dtype, decode_dtype
):
    prefill = np.zeros((num_prefill, *prefill_shape), prefill_dtype)
    decode = np.ones((num_decode, *decode_shape), decode_dtype)
    start = num_tokens - 1 - num_decode
    problems = []
    if num_tokens < 1:
        problems.append("num_tokens must be >= 1")
    elif prefill_shape != decode_shape:
        problems.append(r"\(L, K\) mismatch")
    elif prefill_dtype != decode_dtype:
        problems.append("dtype mismatch")
    elif num_decode > num_tokens - 1:
        problems.append("more than num_tokens - 1")
    elif num_prefill < start:
        problems.append("short of the")
    if problems:
        with pytest.raises(ValueError, match=problems[0]):
            pd.splice(prefill, decode, num_tokens)
        return
    out = pd.splice(prefill, decode, num_tokens)
    assert out.shape == (num_tokens - 1, *prefill_shape)
    assert (out[:start] == 0).all() and (out[start:] == 1).all()
