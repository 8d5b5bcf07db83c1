"""Routing shapes of the models the benchmarks use (``shared/notes/peers.md`` §7-8).

L counts every hidden layer (dense ones stay 0), as vLLM's capturer does; the id dtype is
uint8 up to 256 routed experts and uint16 above.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    top_k: int
    num_experts: int

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8 if self.num_experts <= 256 else torch.uint16

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(np.uint8 if self.num_experts <= 256 else np.uint16)

    @property
    def row_elems(self) -> int:
        return self.num_layers * self.top_k


QWEN3_30B_A3B = ModelShape("Qwen3-30B-A3B", 48, 8, 128)
DEEPSEEK_V3 = ModelShape("DeepSeek-V3", 61, 8, 256)
KIMI_K2 = ModelShape("Kimi-K2", 61, 8, 384)
GPT_OSS_120B = ModelShape("gpt-oss-120b", 36, 4, 128)
MIXTRAL_8X7B = ModelShape("Mixtral-8x7B", 32, 2, 8)

MODELS = (QWEN3_30B_A3B, DEEPSEEK_V3, KIMI_K2, GPT_OSS_120B, MIXTRAL_8X7B)
