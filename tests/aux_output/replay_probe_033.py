"""Run by test_replay.py in a fresh interpreter: the replay switch on the installed vLLM
(0.33.x), through vLLM's own entry points only (plugins are loaded by vLLM); prints one JSON
line of observations."""

from __future__ import annotations

import json
import sys


def main(model_dir: str) -> None:
    seen: dict = {}
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    action = parser._option_string_actions.get("--aux-output-replay-default")
    seen["choices"] = None if action is None else list(action.choices)

    def engine_args(*argv):
        return AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", model_dir, *argv]))

    triton = ("--aux-output-backend", "triton", "--enable-return-routed-experts")
    config = engine_args(*triton, "--aux-output-replay-default", "off").create_engine_config()
    seen["off"] = config.additional_config
    seen["on_hash_equal"] = (
        engine_args(*triton, "--aux-output-replay-default", "on").create_engine_config()
        .compute_hash()
        == engine_args(*triton).create_engine_config().compute_hash()
    )  # fmt: skip
    try:
        engine_args("--aux-output-replay-default", "off").create_engine_config()
        seen["off_with_torch"] = None
    except ValueError as error:
        seen["off_with_torch"] = str(error)

    # vLLM's own admission check, as every entry point (LLM, the OpenAI server) runs it.
    from vllm.v1.engine.input_processor import InputProcessor

    processor = InputProcessor(config)
    answers = {}
    for name, value in (("false", False), ("zero", 0), ("string", "false"), ("two", 2)):
        try:
            params = SamplingParams(max_tokens=4, extra_args={"aux_output_replay": value})
            processor._validate_params(params, ("generate",))
            answers[name] = "accepted"
        except ValueError as error:
            from vllm.exceptions import VLLMClientError

            # What the OpenAI server answers with 400 (AsyncLLM passes it on).
            kind = "client error" if isinstance(error, VLLMClientError) else "ValueError"
            answers[name] = f"{kind}: {error}"
    seen["admission"] = answers
    print("PROBE " + json.dumps(seen), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
