"""vLLM plugin: ``--aux-output-backend {torch,triton}`` for routed-experts (R3) capture.

``register()`` is r3capture's ``vllm.general_plugins`` entry point. vLLM calls it in every
process it starts (API server, engine core, each worker), possibly several times, so it is
idempotent and cheap: it imports nothing from vLLM. Each hook is applied to its vLLM module
right after vLLM imports that module (at once if it already has), so the API server never
imports the model runner because of r3capture.

What it installs:

* **The flag** (API process). ``EngineArgs.add_cli_args`` gains ``--aux-output-backend``
  and ``EngineArgs.from_cli_args`` folds its value into ``additional_config`` under
  ``"aux_output_backend"`` (``AuxOutputConfig`` forbids extra keys, and ``additional_config``
  travels with ``VllmConfig`` to every worker). In vLLM 0.32.x and 0.33.x,
  ``AsyncEngineArgs.add_cli_args`` loads the general plugins *before* it adds the engine
  arguments, and every parser built after that sees the flag: ``vllm serve``, the OpenAI
  api_server module, ``run-batch``, the gRPC server, and, because the ``vllm`` CLI builds the
  ``serve`` parser before the others, every ``vllm`` subcommand (``vllm bench latency``,
  ``vllm preload``, ...). A script that builds its parser with ``EngineArgs.add_cli_args``
  before any plugin has loaded does not get the flag; there, and from Python, use
  ``--additional-config '{"aux_output_backend": "triton"}'`` /
  ``LLM(..., additional_config={"aux_output_backend": "triton"})``.
* **The check** (wherever a ``VllmConfig`` is built from engine arguments):
  ``EngineArgs.create_engine_config`` refuses an unknown backend, ``triton`` on a vLLM
  outside the supported range, and ``triton`` without ``--enable-return-routed-experts``.
  The last one is an error, not a warning: the flag only selects how routed experts are
  captured, so asking for a capture backend with capture off is a misconfiguration that a
  trainer would otherwise only notice as missing ``routed_experts``.
* **The backend** (workers; only on a supported vLLM, all three hooks or none). When vLLM
  imports its Model Runner V2 module, the module-level ``get_aux_output_connector`` is
  wrapped to build r3capture's worker (``factory.build_worker``) when ``triton`` is selected
  and vLLM's own otherwise; ``GPUModelRunner.sample`` is wrapped to hand the step's
  device ``num_rejected`` to a worker that accepts it (``set_step_num_rejected``), so that
  the kernel skips rejected speculative rows on the device; and
  ``GPUModelRunner.execute_model`` is wrapped to relay routed-expert rows between pipeline
  stages after each forward (``pipeline.py``; only r3capture's worker under PP > 1 has a
  relay).
* **Pipeline parallelism** (every process, supported vLLM): ``VllmConfig``'s routed-experts
  compatibility check runs with PP hidden when ``triton`` is selected, so vLLM's refusal of
  PP > 1 is lifted for ``triton`` only and all its other refusals stay.
* **Per-request routed experts** (``replay.py``; ``triton`` only): each engine
  ``Scheduler``'s aux-output connector is wrapped so that a request whose
  ``SamplingParams.extra_args["aux_output_replay"]`` is false gets no rows and costs the
  worker no per-row work for them; ``--aux-output-replay-default {on,off}`` (folded into
  ``additional_config["aux_output_replay_default"]``, ``off`` as ``False``; ``on``, the
  default, adds nothing) sets what a request without the key gets; and
  ``InputProcessor._validate_params`` refuses a request whose value is not a boolean, where
  vLLM validates every request's sampling parameters (the OpenAI server answers 400).
* **Prefill/decode disaggregation** (``--aux-output-pd {off,splice}``, folded into
  ``additional_config["aux_output_pd"]`` like the backend; ``pd.py``): ``splice`` needs
  ``triton`` and runs the same check with the P/D KV connectors hidden, so vLLM's refusal of
  those connectors is lifted and all its other refusals stay; ``off`` (the default) adds
  nothing. Under ``splice`` each engine ``Scheduler`` also gets its scheduler-side
  aux-output connector wrapped (``pd_scheduler.py``; on 0.32.x also its prefix-hit lookups,
  ``pd_scheduler_032.py``), so that a decode-leg request (KV from a prefiller) returns only
  the rows it computed and no other request takes blocks whose rows were never computed.

With ``torch`` (the default) vLLM runs exactly its own code: no ``additional_config`` key is
added and the wrappers call straight through. On a vLLM outside the supported range only the
flag and the check are installed, so selecting ``triton`` fails with the supported range.
"""

from __future__ import annotations

import functools
import importlib.abc
import logging
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from r3capture.aux_output import compat, pd, pipeline, replay

# A child of vLLM's logger: the plugin runs only inside vLLM, whose handlers and
# VLLM_LOGGING_LEVEL then apply to its messages too.
logger = logging.getLogger("vllm.r3capture")

BACKEND_KEY = "aux_output_backend"
BACKENDS = ("torch", "triton")
DEFAULT_BACKEND = "torch"
_FLAG = "--aux-output-backend"
# Marks a wrapper as ours, so a second register() (or a second plugin loader) never wraps twice.
_WRAPPED = "__r3capture_wrapped__"

_registered = False


def register() -> None:
    """Install the flag, the config check and (on a supported vLLM) the worker backend."""
    global _registered
    if _registered:
        return
    _registered = True
    _run_after_import(compat.ENGINE_ARGS_MODULE, _patch_engine_args)
    version = compat.vllm_version()
    if version is None or not compat.is_supported_vllm_version(version):
        # Selecting triton is refused by the config check; the torch backend is untouched.
        logger.warning(
            "r3capture: vLLM %s is outside the supported range %s; only "
            "--aux-output-backend torch (vLLM's own backend) is available",
            version,
            ",".join(compat.SUPPORTED_VLLM),
        )
        return
    _run_after_import(compat.CONFIG_MODULE, _patch_vllm_config)
    _run_after_import(compat.MODEL_RUNNER_MODULE, _patch_model_runner)
    _run_after_import(compat.SCHEDULER_MODULE, _patch_scheduler)
    _run_after_import(compat.INPUT_PROCESSOR_MODULE, _patch_input_processor)


# ---------------------------------------------------------------- backend selection
def selected_backend(vllm_config: Any) -> str:
    """The aux-output backend a ``VllmConfig`` selects (``"torch"`` when none is set)."""
    additional = getattr(vllm_config, "additional_config", None)
    if not isinstance(additional, dict):
        return DEFAULT_BACKEND
    return additional.get(BACKEND_KEY, DEFAULT_BACKEND)


def check_backend(vllm_config: Any) -> str:
    """Validate the backend selection of a ``VllmConfig``; return the backend.

    Raises ``ValueError`` for an unknown backend or ``triton`` with routed-experts capture
    off, and ``compat.UnsupportedVLLMError`` for ``triton`` on an unsupported vLLM.
    """
    backend = selected_backend(vllm_config)
    if backend not in BACKENDS:
        raise ValueError(
            f"{BACKEND_KEY}={backend!r} is not one of {BACKENDS} "
            f"(set by {_FLAG} or additional_config[{BACKEND_KEY!r}])"
        )
    if backend == DEFAULT_BACKEND:
        return backend
    compat.require_supported_vllm(f"{_FLAG} {backend}")
    aux_config = getattr(vllm_config, "aux_output_config", None)
    if not getattr(aux_config, "enable_return_routed_experts", False):
        raise ValueError(
            f"{_FLAG} {backend} selects how routed experts are captured, but routed-experts "
            "capture is off: add --enable-return-routed-experts (Python: "
            "enable_return_routed_experts=True), or drop the backend selection"
        )
    return backend


def _with_backend(additional_config: Any, backend: str) -> Any:
    """``additional_config`` with ``backend`` selected (``_with_setting``)."""
    return _with_setting(additional_config, _FLAG, BACKEND_KEY, backend, DEFAULT_BACKEND)


def _with_replay_default(additional_config: Any, choice: str) -> Any:
    """``additional_config`` with the replay default ``choice`` (``on``/``off``) selected,
    as a bool (``_with_setting``)."""
    value = replay.DEFAULT_CHOICES[choice]
    return _with_setting(additional_config, replay.DEFAULT_FLAG, replay.DEFAULT_KEY, value, True)


def _with_pd(additional_config: Any, mode: str) -> Any:
    """``additional_config`` with the P/D ``mode`` selected (``_with_setting``)."""
    return _with_setting(additional_config, pd.PD_FLAG, pd.PD_KEY, mode, pd.DEFAULT_PD)


def _with_setting(additional_config: Any, flag: str, key: str, value: Any, default: Any) -> Any:
    """``additional_config`` with ``flag``'s ``value`` under ``key``, as a new dict (the
    caller's is never edited). The ``default`` adds nothing, so a flag left at its default
    leaves vLLM's config (and its compile-cache hash) exactly as it is without the plugin.
    Raises ``ValueError`` when ``additional_config`` is not a dict or already holds another
    value under ``key``."""
    if additional_config is not None and not isinstance(additional_config, dict):
        raise ValueError(
            f"{flag} needs additional_config to be a dict, got {type(additional_config).__name__}"
        )
    previous = (additional_config or {}).get(key, value)
    if previous != value:
        raise ValueError(f"{flag} {value} conflicts with additional_config[{key!r}]={previous!r}")
    if value == default:
        return additional_config
    return {**(additional_config or {}), key: value}


# ---------------------------------------------------------------- engine arguments
def _patch_engine_args(module: ModuleType) -> None:
    EngineArgs = module.EngineArgs
    add_cli_args = EngineArgs.__dict__.get("add_cli_args")
    from_cli_args = EngineArgs.__dict__.get("from_cli_args")
    create_engine_config = EngineArgs.__dict__.get("create_engine_config")
    if not (
        isinstance(add_cli_args, staticmethod)
        and isinstance(from_cli_args, classmethod)
        and callable(create_engine_config)
    ):
        logger.warning(
            "r3capture: this vLLM's EngineArgs has an unexpected shape; %s is not installed",
            _FLAG,
        )
        return
    if getattr(create_engine_config, _WRAPPED, False):
        return
    original_add = add_cli_args.__func__
    original_from = from_cli_args.__func__

    def add_cli_args_with_backend(parser, *args, **kwargs):
        parser = original_add(parser, *args, **kwargs)
        _add_backend_flag(parser)
        _add_pd_flag(parser)
        _add_replay_default_flag(parser)
        return parser

    def from_cli_args_with_backend(cls, args, *rest, **kwargs):
        engine_args = original_from(cls, args, *rest, **kwargs)
        backend = getattr(args, BACKEND_KEY, None)
        if backend is not None:
            engine_args.additional_config = _with_backend(engine_args.additional_config, backend)
        mode = getattr(args, pd.PD_KEY, None)
        if mode is not None:
            engine_args.additional_config = _with_pd(engine_args.additional_config, mode)
        choice = getattr(args, replay.DEFAULT_KEY, None)
        if choice is not None:
            engine_args.additional_config = _with_replay_default(
                engine_args.additional_config, choice
            )
        return engine_args

    def create_engine_config_checked(self, *args, **kwargs):
        vllm_config = create_engine_config(self, *args, **kwargs)
        backend = check_backend(vllm_config)
        pd.check_pd(vllm_config, backend)
        replay.check_replay_default(vllm_config, backend)
        return vllm_config

    _mark_wrapper(add_cli_args_with_backend, original_add)
    _mark_wrapper(from_cli_args_with_backend, original_from)
    _mark_wrapper(create_engine_config_checked, create_engine_config)
    EngineArgs.add_cli_args = staticmethod(add_cli_args_with_backend)
    EngineArgs.from_cli_args = classmethod(from_cli_args_with_backend)
    EngineArgs.create_engine_config = create_engine_config_checked


def _add_backend_flag(parser) -> None:
    # In --help, listed in the group of --enable-return-routed-experts (ModelConfig).
    _add_flag(
        parser,
        _FLAG,
        beside="--enable-return-routed-experts",
        choices=BACKENDS,
        help=(
            "Routed-experts (R3) capture backend, from the r3capture plugin. 'torch' (default): "
            "vLLM's own; 'triton': r3capture's Triton data path (accepted rows only cross to "
            "the host, block-aligned store). Needs --enable-return-routed-experts. Same as "
            f'--additional-config \'{{"{BACKEND_KEY}": "triton"}}\'.'
        ),
    )


def _add_pd_flag(parser) -> None:
    _add_flag(
        parser,
        pd.PD_FLAG,
        beside=_FLAG,
        choices=pd.PD_MODES,
        help=(
            "Routed experts under prefill/decode disaggregation, from the r3capture plugin. "
            "'off' (default): vLLM refuses routed experts with P/D KV connectors (NIXL, "
            "Mooncake, MoRIIO). 'splice': that refusal is lifted; each instance returns the "
            "rows it computed and the router joins them (r3capture.aux_output.pd.splice). "
            f"Needs {_FLAG} triton. Same as "
            f'--additional-config \'{{"{pd.PD_KEY}": "splice"}}\'.'
        ),
    )


def _add_replay_default_flag(parser) -> None:
    _add_flag(
        parser,
        replay.DEFAULT_FLAG,
        beside=_FLAG,
        choices=tuple(replay.DEFAULT_CHOICES),
        help=(
            "Which requests get routed experts, from the r3capture plugin. 'on' (default): "
            f"every request, unless it sets {replay.REPLAY_KEY}=false in "
            "SamplingParams.extra_args (vllm_xargs over HTTP); 'off': only requests that set "
            f"{replay.REPLAY_KEY}=true. A request without rows costs the host no per-row "
            f"work. Needs {_FLAG} triton. Same as "
            f"--additional-config '{{\"{replay.DEFAULT_KEY}\": false}}'."
        ),
    )


def _add_flag(parser, flag: str, *, beside: str, choices: tuple, help: str) -> None:
    """Add ``flag`` (``choices``, no default) to ``parser`` unless it has it, in the
    argument group of ``beside`` (the parser's own when it has no such flag)."""
    if flag in parser._option_string_actions:
        return
    anchor = parser._option_string_actions.get(beside)
    group = next((g for g in parser._action_groups if anchor in g._group_actions), parser)
    group.add_argument(flag, choices=choices, default=None, help=help)


# ------------------------------------------------- pipeline parallelism, P/D connectors
def _patch_vllm_config(module: ModuleType) -> None:
    """vLLM refuses routed experts with PP > 1 and with P/D KV connectors. With ``triton``
    its check runs with PP hidden (``pipeline.py`` carries the rows between stages); with
    ``--aux-output-pd splice`` (which needs ``triton``) it runs with the P/D connectors
    hidden (``pd.py``; the router splices the rows). Every other refusal stays."""
    original = _method_to_wrap(module, compat.CONFIG_CLASS, compat.VERIFY_AUX_OUTPUT_METHOD)
    if original is None:
        return

    def verify(self):
        backend = selected_backend(self)
        check = original
        if pd.check_pd(self, backend) == "splice":
            check = functools.partial(pd.verify_without_pd_refusal, original)
        if pipeline.pipeline_size(self) > 1 and backend == "triton":
            return pipeline.verify_without_pipeline(check, self)
        return check(self)

    _mark_wrapper(verify, original)
    setattr(getattr(module, compat.CONFIG_CLASS), compat.VERIFY_AUX_OUTPUT_METHOD, verify)


def _mark_wrapper(wrapper: Callable, original: Callable) -> None:
    wrapper.__wrapped__ = original
    wrapper.__doc__ = original.__doc__
    setattr(wrapper, _WRAPPED, True)


def _method_to_wrap(module: ModuleType, class_name: str, method: str) -> Callable | None:
    """``module.class_name.method``, or None when r3capture has wrapped it already. Raises
    ``compat.UnsupportedVLLMError`` naming it when the module lacks it."""
    cls = getattr(module, class_name, None)
    original = None if cls is None else getattr(cls, method, None)
    if original is None:
        raise compat.UnsupportedVLLMError(
            f"r3capture: {module.__name__} has no {class_name}.{method}; this vLLM build "
            f"({compat.vllm_version()}) is not one r3capture supports"
        )
    return None if getattr(original, _WRAPPED, False) else original


# ------------------------------------------------------- the scheduler side: P/D, replay
def _patch_scheduler(module: ModuleType) -> None:
    """Under ``triton`` each ``Scheduler`` gets its aux-output connector wrapped: under
    ``--aux-output-pd splice`` first by ``pd_scheduler.py`` (on 0.32.x its KV cache manager's
    and KV connector's hit lookups too), so a decode-leg request returns only the rows it
    computed; then by ``replay.ReplaySchedulerConnector``, so an opted-out request returns
    none. With ``torch`` vLLM's scheduler stays as it is."""
    original = _method_to_wrap(module, compat.SCHEDULER_CLASS, compat.SCHEDULER_INIT_METHOD)
    if original is None:
        return

    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        backend = selected_backend(vllm_config)
        mode = pd.check_pd(vllm_config, backend)
        if backend != "triton":
            return
        if mode == "splice":
            from r3capture.aux_output.pd_scheduler import wrap_scheduler_connector

            wrap_scheduler_connector(self)
        replay.wrap_for_replay(self, replay.replay_default(vllm_config))

    _mark_wrapper(__init__, original)
    setattr(getattr(module, compat.SCHEDULER_CLASS), compat.SCHEDULER_INIT_METHOD, __init__)


# ---------------------------------------------------------------- request validation
def _patch_input_processor(module: ModuleType) -> None:
    """Under ``triton``, ``InputProcessor._validate_params`` (vLLM's check of every request's
    sampling parameters, in the process that takes the request) also refuses a malformed
    ``aux_output_replay`` (``replay.check_request``), with a ``ValueError`` that is also
    vLLM's validation error (``compat.request_error``), which the OpenAI server answers with
    400 (a bare ``ValueError`` would be a 500 there). With ``torch`` it is vLLM's check
    alone."""
    original = _method_to_wrap(module, compat.INPUT_PROCESSOR_CLASS, compat.VALIDATE_PARAMS_METHOD)
    if original is None:
        return

    def _validate_params(self, params, *args, **kwargs):
        result = original(self, params, *args, **kwargs)
        if selected_backend(getattr(self, "vllm_config", None)) == "triton":
            try:
                replay.check_request(params)
            except ValueError as error:
                value = params.extra_args[replay.REPLAY_KEY]
                raise compat.request_error(
                    str(error), parameter=replay.REPLAY_KEY, value=value
                ) from None
        return result

    _mark_wrapper(_validate_params, original)
    setattr(
        getattr(module, compat.INPUT_PROCESSOR_CLASS),
        compat.VALIDATE_PARAMS_METHOD,
        _validate_params,
    )


# ---------------------------------------------------------------- model runner hooks
def _patch_model_runner(module: ModuleType) -> None:
    runner_cls = getattr(module, compat.MODEL_RUNNER_CLASS, None)
    original_factory = getattr(module, compat.CONNECTOR_FACTORY_NAME, None)
    original_sample = getattr(runner_cls, compat.SAMPLE_METHOD, None)
    original_execute = getattr(runner_cls, compat.EXECUTE_MODEL_METHOD, None)
    if original_factory is None or original_sample is None or original_execute is None:
        # A vLLM that reports a supported version has all three; refuse rather than run
        # --aux-output-backend triton silently on vLLM's backend.
        raise compat.UnsupportedVLLMError(
            f"r3capture: {module.__name__} has no {compat.CONNECTOR_FACTORY_NAME}, "
            f"{compat.MODEL_RUNNER_CLASS}.{compat.SAMPLE_METHOD} or "
            f"{compat.MODEL_RUNNER_CLASS}.{compat.EXECUTE_MODEL_METHOD}; this vLLM build "
            f"({compat.vllm_version()}) is not one r3capture supports"
        )
    if getattr(original_factory, _WRAPPED, False):
        return

    def get_aux_output_connector(model, vllm_config, kv_cache_config):
        if check_backend(vllm_config) == "triton":
            from r3capture.aux_output.factory import build_worker

            return build_worker(vllm_config, kv_cache_config, model)
        return original_factory(model, vllm_config, kv_cache_config)

    def sample(self, *args, **kwargs):
        result = original_sample(self, *args, **kwargs)
        # The device counts exist only here, before sample_tokens calls prepare_output;
        # vLLM's own connector has no such method and is left alone.
        hand_over = getattr(self.aux_output_connector, "set_step_num_rejected", None)
        if hand_over is not None:
            hand_over(result[compat.SAMPLE_NUM_REJECTED_INDEX])
        return result

    def execute_model(self, scheduler_output, intermediate_tensors=None, *args, **kwargs):
        output = original_execute(self, scheduler_output, intermediate_tensors, *args, **kwargs)
        # Only r3capture's worker under PP > 1 has a relay; 0-token steps and dummy runs
        # leave no step state and move no tensors between stages.
        relay = getattr(getattr(self, "aux_output_connector", None), "pipeline_relay", None)
        state = getattr(self, "execute_model_state", None)
        if relay is not None and state is not None and not _is_dummy_run(args, kwargs):
            pipeline.relay_after_forward(
                relay, intermediate_tensors, output, state.input_batch.num_tokens
            )
        return output

    _mark_wrapper(get_aux_output_connector, original_factory)
    _mark_wrapper(sample, original_sample)
    _mark_wrapper(execute_model, original_execute)
    setattr(module, compat.CONNECTOR_FACTORY_NAME, get_aux_output_connector)
    setattr(runner_cls, compat.SAMPLE_METHOD, sample)
    setattr(runner_cls, compat.EXECUTE_MODEL_METHOD, execute_model)


def _is_dummy_run(args: tuple, kwargs: dict) -> bool:
    # execute_model(scheduler_output, intermediate_tensors=None, dummy_run=False, ...)
    return bool(kwargs.get("dummy_run", args[0] if args else False))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback(module)`` right after ``name`` is executed, then removes itself."""

    def __init__(self, name: str, callback: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.callback = callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        exec_module = spec.loader.exec_module

        def exec_then_patch(module: ModuleType) -> None:
            exec_module(module)
            self.remove()
            self.callback(module)

        # Each module spec has its own loader instance, so this touches only this import.
        spec.loader.exec_module = exec_then_patch
        return spec

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def _run_after_import(name: str, callback: Callable[[ModuleType], None]) -> None:
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    # Importing the module here instead would pull the model runner (torch, Triton, the
    # runner) into the API server and the engine arguments into every worker.
    if not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, callback))
