"""The plugin's flag on a real `vllm serve`: refusals are clear and happen before start-up."""

from __future__ import annotations

import pytest

from demo.serve import ServerError, VLLMServer

pytestmark = pytest.mark.e2e


def test_triton_without_routed_experts_refuses_to_start(tiny_model, server_env, log_dir):
    args = ["--aux-output-backend", "triton", "--dtype", "float32", "--enforce-eager",
            "--skip-tokenizer-init", "--max-model-len", "512", "--block-size", "32"]  # fmt: skip
    server = VLLMServer(tiny_model, args, env=server_env, log_path=log_dir / "refused.log")
    with pytest.raises(ServerError) as error:
        with server:
            pass
    message = str(error.value)
    assert "--aux-output-backend triton" in message
    assert "add --enable-return-routed-experts" in message
    assert not server.alive()
