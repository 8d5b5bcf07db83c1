"""Run by test_pd.py in a fresh interpreter: ``--aux-output-pd`` on the installed vLLM (0.33.x).

Builds engine configs with P/D KV connectors through vLLM's own parser and
``create_engine_config`` (plugins are loaded by vLLM, not by this script; no connector is
imported or started) and prints one JSON line: per case, the accepted ``additional_config``
or the error message.
"""

from __future__ import annotations

import json
import sys

_NIXL_CHILD = {"connectors": [{"kv_connector": "NixlConnector", "kv_role": "kv_both"}]}
CONNECTORS = {
    "NixlConnector": {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
    "MooncakeConnector": {"kv_connector": "MooncakeConnector", "kv_role": "kv_both"},
    "MultiConnector/NixlConnector": {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": _NIXL_CHILD,
    },
    "ExampleConnector": {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": "/nonexistent-r3capture-probe"},
    },
}
CASES = {
    "off": ["--aux-output-backend", "triton"],
    "splice": ["--aux-output-backend", "triton", "--aux-output-pd", "splice"],
    "splice torch": ["--aux-output-pd", "splice"],
}


def main(model_dir: str) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    seen: dict = {}
    for connector, kv_config in CONNECTORS.items():
        for case, flags in CASES.items():
            argv = [
                "--model", model_dir, "--enable-return-routed-experts",
                "--kv-transfer-config", json.dumps({**kv_config, "kv_buffer_device": "cpu"}),
                *flags,
            ]  # fmt: skip
            try:
                args = AsyncEngineArgs.from_cli_args(parser.parse_args(argv))
                seen[f"{connector} {case}"] = args.create_engine_config().additional_config
            except Exception as error:  # noqa: BLE001 - the message is the observation
                seen[f"{connector} {case}"] = f"{type(error).__name__}: {error}"
    print("PROBE " + json.dumps(seen), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
