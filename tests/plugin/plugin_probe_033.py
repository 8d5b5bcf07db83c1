"""Run by test_plugin.py in a fresh interpreter: the plugin on the installed vLLM (0.33.x).

Goes through vLLM's own entry points only (plugins are loaded by vLLM, not by this script)
and prints one JSON line of observations.
"""

from __future__ import annotations

import json
import sys


def main(model_dir: str) -> None:
    seen: dict = {}
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # `vllm serve` builds its parser this way; it loads the general plugins first.
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    action = parser._option_string_actions.get("--aux-output-backend")
    seen["choices"] = None if action is None else list(action.choices)
    seen["runner_imported_early"] = "vllm.v1.worker.gpu.model_runner" in sys.modules

    def engine_args(*argv):
        return AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", model_dir, *argv]))

    seen["default_additional_config"] = engine_args().additional_config
    seen["torch_additional_config"] = engine_args("--aux-output-backend", "torch").additional_config
    # The default backend must not change vLLM's config, compile-cache hash included.
    seen["torch_hash_equal"] = (
        engine_args("--aux-output-backend", "torch").create_engine_config().compute_hash()
        == engine_args().create_engine_config().compute_hash()
    )
    seen["triton_additional_config"] = engine_args(
        "--aux-output-backend", "triton"
    ).additional_config
    try:
        engine_args(
            "--aux-output-backend", "triton",
            "--additional-config", '{"aux_output_backend": "torch"}',
        )  # fmt: skip
        seen["conflict"] = None
    except ValueError as error:
        seen["conflict"] = str(error)
    try:
        engine_args("--aux-output-backend", "triton").create_engine_config()
        seen["without_capture"] = None
    except ValueError as error:
        seen["without_capture"] = str(error)
    config = engine_args(
        "--aux-output-backend", "triton", "--enable-return-routed-experts"
    ).create_engine_config()
    seen["accepted"] = config.additional_config

    import vllm.v1.worker.gpu.model_runner as runner

    seen["factory_wrapped"] = getattr(
        runner.get_aux_output_connector, "__r3capture_wrapped__", False
    )
    seen["sample_wrapped"] = getattr(runner.GPUModelRunner.sample, "__r3capture_wrapped__", False)
    print("PROBE " + json.dumps(seen), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
