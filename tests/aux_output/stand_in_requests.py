"""A stand-in for vLLM's ``Request``: the parts the scheduler-side aux-output connector and
r3capture's wrappers of it read (shared by the scheduler-side tests)."""

from __future__ import annotations

import types

from sim.kv import block_hashes_for

B = 16  # KV block size and hash block size of the stand-in requests' hashes


class FakeRequest:
    """A request of ``tokens`` (its prompt), with ``kv_transfer_params`` (copied),
    ``routed_experts_prompt_start`` and ``extra_args`` as vLLM's ``SamplingParams`` carry them;
    ``append`` adds output tokens and the hashes of the blocks they complete."""

    def __init__(
        self, request_id, tokens, kv_transfer_params=None, prompt_start=0, extra_args=None
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(tokens)
        self.output_token_ids: list[int] = []
        self.kv_transfer_params = None if kv_transfer_params is None else dict(kv_transfer_params)
        self.sampling_params = types.SimpleNamespace(
            routed_experts_prompt_start=prompt_start, extra_args=extra_args
        )
        self.num_computed_tokens = 0
        self.finished = False
        self.block_hashes = block_hashes_for(self.prompt_token_ids, B)

    @property
    def num_prompt_tokens(self):
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self):
        return len(self.output_token_ids)

    @property
    def num_tokens(self):
        return self.num_prompt_tokens + self.num_output_tokens

    def is_finished(self):
        return self.finished

    def append(self, *token_ids):
        self.output_token_ids.extend(token_ids)
        tokens = self.prompt_token_ids + self.output_token_ids
        self.block_hashes = self.block_hashes + block_hashes_for(tokens, B, self.block_hashes)
