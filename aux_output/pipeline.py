"""Routed experts under pipeline parallelism (``--pipeline-parallel-size N > 1``).

With PP every stage builds vLLM's capture buffer ``int32 [max_num_batched_tokens, L, K]``
for all ``L`` layers, but its router hooks write only the columns of the layers it owns;
the last stage, which launches the capture kernel, would return zeros (a valid expert id)
for every earlier stage's layers. vLLM 0.33.0 therefore refuses routed experts with PP.

r3capture carries the rows with the hidden states: after its forward, a non-last stage adds
one tensor to the ``IntermediateTensors`` it sends on (``RELAY_KEY``: its rows
``[num_tokens, L, K]`` in the output dtype, uint8/uint16, with every earlier stage's
columns merged in), and a non-first stage copies the columns of the earlier stages' layers
from the received tensor into its own capture buffer. Both happen on the stage's stream
right after its forward, so the last stage's kernel reads complete rows; the tensor never
becomes a model input (the runner copies only its own keys), so CUDA graphs and
torch.compile are untouched. Bytes per token added to the PP send: ``L * K * itemsize``
(Qwen3-30B-A3B 384 B beside 8,192 B of hidden states and residual; Kimi-K2 976 B beside
28,672 B).

The cast to uint8/uint16 before the send is the cast both backends end with, so relayed
rows are byte-identical to rows captured on one stage.
"""

from __future__ import annotations

from typing import Any

import torch

RELAY_KEY = "r3capture_routed_experts"


class PipelineRelay:
    """One stage's side of the relay.

    Args:
        capture_buffer: the stage's ``int32 [T, L, K]`` capture buffer.
        own_layers: ``(start, end)``: the global layer indices this stage runs.
        dtype: the output dtype (``torch.uint8`` or ``torch.uint16``).
        is_first, is_last: the stage's place in the pipeline.
    """

    def __init__(
        self,
        capture_buffer: torch.Tensor,
        own_layers: tuple[int, int],
        dtype: torch.dtype,
        *,
        is_first: bool,
        is_last: bool,
    ) -> None:
        start, end = own_layers
        num_layers = capture_buffer.shape[1]
        if not 0 <= start <= end <= num_layers:
            raise ValueError(
                f"own_layers must be (start, end) within the {num_layers} captured layers, "
                f"got {own_layers}"
            )
        self.capture_buffer = capture_buffer
        self.own_layers = (start, end)
        self.dtype = dtype
        self.is_first = is_first
        self.is_last = is_last

    def merge(self, received: dict[str, torch.Tensor], num_tokens: int) -> None:
        """Copy the earlier stages' columns of the first ``num_tokens`` rows from the tensors
        received from the previous stage into this stage's capture buffer."""
        rows = received.get(RELAY_KEY)
        L, K = self.capture_buffer.shape[1:]
        if (
            not isinstance(rows, torch.Tensor)
            or rows.dtype != self.dtype
            or rows.dim() != 3
            or tuple(rows.shape[1:]) != (L, K)
            or rows.shape[0] < num_tokens
        ):
            got = "nothing" if rows is None else f"{type(rows).__name__}"
            if isinstance(rows, torch.Tensor):
                got += f" {rows.dtype} {tuple(rows.shape)}"
            raise RuntimeError(
                f"r3capture: the previous pipeline stage must send {RELAY_KEY!r} as "
                f"{self.dtype} [>= {num_tokens}, {L}, {K}] with its hidden states, got {got}; "
                "is every stage running --aux-output-backend triton?"
            )
        start = self.own_layers[0]
        if start:
            self.capture_buffer[:num_tokens, :start].copy_(rows[:num_tokens, :start])

    def snapshot(self, num_tokens: int) -> torch.Tensor:
        """This stage's complete rows so far, ``[num_tokens, L, K]`` in the output dtype (a
        new tensor: the capture buffer is overwritten by the next forward)."""
        return self.capture_buffer[:num_tokens].to(self.dtype)


def relay_after_forward(relay: PipelineRelay, received: Any, output: Any, num_tokens: int) -> None:
    """What a stage does after its forward: merge what the previous stage sent
    (``received``: its ``IntermediateTensors``, None on the first stage), then attach the
    rows to what this stage sends (``output``: ``IntermediateTensors`` on a non-last stage)."""
    if not relay.is_first:
        if received is None:
            raise RuntimeError(
                "r3capture: a non-first pipeline stage ran a forward without intermediate "
                "tensors from the previous stage"
            )
        relay.merge(received.tensors, num_tokens)
    if not relay.is_last:
        tensors = getattr(output, "tensors", None)
        if not isinstance(tensors, dict):
            raise RuntimeError(
                "r3capture: a non-last pipeline stage's forward returned "
                f"{type(output).__name__}, not IntermediateTensors to send on"
            )
        tensors[RELAY_KEY] = relay.snapshot(num_tokens)


class _WithoutPipeline:
    """A read-only view of a ``ParallelConfig`` that reports ``pipeline_parallel_size`` 1."""

    def __init__(self, parallel_config: Any) -> None:
        self._parallel_config = parallel_config

    def __getattr__(self, name: str) -> Any:
        if name == "pipeline_parallel_size":
            return 1
        return getattr(self._parallel_config, name)


class _ConfigWithoutPipeline:
    """A read-only view of a ``VllmConfig`` whose parallel config hides PP, so vLLM's other
    routed-experts checks still run on it unchanged."""

    def __init__(self, vllm_config: Any) -> None:
        self._vllm_config = vllm_config

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._vllm_config, name)
        if name == "parallel_config":
            return _WithoutPipeline(value)
        return value


def pipeline_size(vllm_config: Any) -> int:
    parallel = getattr(vllm_config, "parallel_config", None)
    return int(getattr(parallel, "pipeline_parallel_size", 1) or 1)


def verify_without_pipeline(original_verify: Any, vllm_config: Any) -> None:
    """Run vLLM's routed-experts compatibility check with PP hidden (every other refusal
    still applies)."""
    original_verify(_ConfigWithoutPipeline(vllm_config))
