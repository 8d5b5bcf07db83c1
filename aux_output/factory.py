"""Build r3capture's worker connector inside vLLM's model runner.

Called by the plugin's ``get_aux_output_connector`` when ``--aux-output-backend triton`` is
selected. Sizing follows vLLM 0.33.0's ``AuxOutputWorkerConnector.__init__`` term by term,
so both backends hold the same capture buffer and the same store capacity:

* every TP rank builds vLLM's ``RoutedExpertsCapturer`` and binds it to the model's MoE
  routers (the capture may all-gather across TP, so every rank must take part);
* only the first TP rank owns the data plane (store, kernel launches, outputs);
* block sizes come from ``resolve_kv_cache_block_sizes``; one store object is one hash block
  of ``hash_block_size * L * K * itemsize`` bytes, and the default ``max_bytes`` is what the
  KV cache can hold: ``num_blocks * (scheduler_block // hash_block) * block_nbytes``.

The capturer's int32 device buffer ``[max_num_batched_tokens, L, K]`` becomes the worker's
``capture_buffer``: the router hooks write there and r3capture's kernel reads from there, so
no second buffer is allocated.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from r3capture.aux_output import compat, pd
from r3capture.aux_output.sizing import REATTACH_TOKENS, WorkerSizing, row_nbytes

logger = logging.getLogger("vllm.r3capture")

if TYPE_CHECKING:
    import torch

    from r3capture.aux_output.worker import TritonAuxOutputWorker


def worker_sizing(
    vllm_config: Any,
    *,
    num_kv_blocks: int,
    scheduler_block_size: int,
    hash_block_size: int,
    shape_per_token: tuple[int, int],
    dtype: np.dtype | str,
) -> WorkerSizing:
    """Sizing of the worker from the config and the resolved KV-cache block sizes."""
    num_drafts = getattr(vllm_config, "num_speculative_tokens", 0) or 0
    depth = vllm_config.max_concurrent_batches
    # A step's rows may start below the scheduler's start by the drafts rejected in the
    # steps still in flight; the device ring's window leaves room for REATTACH_TOKENS of
    # them, and more would make the kernel refuse a request mid-run.
    if max(depth - 1, 1) * num_drafts > REATTACH_TOKENS:
        raise ValueError(
            f"r3capture: --aux-output-backend triton supports up to {REATTACH_TOKENS} "
            "draft tokens in the steps in flight, got num_speculative_tokens="
            f"{num_drafts} with max_concurrent_batches={depth}; use vLLM's own backend"
        )
    dtype = np.dtype(dtype)
    block_nbytes = hash_block_size * row_nbytes(shape_per_token, dtype)
    max_bytes = vllm_config.aux_output_config.max_bytes
    if max_bytes is None:
        max_bytes = num_kv_blocks * (scheduler_block_size // hash_block_size) * block_nbytes
    scheduler_config = vllm_config.scheduler_config
    return WorkerSizing(
        shape_per_token=tuple(shape_per_token),
        dtype=dtype,
        hash_block_size=hash_block_size,
        max_bytes=max_bytes,
        max_num_seqs=scheduler_config.max_num_seqs,
        max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
        max_concurrent_batches=vllm_config.max_concurrent_batches,
    )


def build_worker(
    vllm_config: Any, kv_cache_config: Any, model: torch.nn.Module
) -> TritonAuxOutputWorker:
    """r3capture's worker for this rank, bound to ``model``'s routers (see module docstring)."""
    compat.require_supported_vllm("--aux-output-backend triton")
    compat.backfill_connector_metadata()
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
        RoutedExpertsCapturer,
        bind_routed_experts_capturer,
    )
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    from r3capture.aux_output.worker import TritonAuxOutputWorker

    capturer = RoutedExpertsCapturer(
        max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
        vllm_config=vllm_config,
    )
    pp = get_pp_group()
    if pp.world_size == 1 or _has_moe_layers(model):
        # A pipeline stage without MoE layers (e.g. DeepSeek's dense first layers alone)
        # captures nothing and only relays; vLLM's bind would refuse it.
        bind_routed_experts_capturer(model, capturer)
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(
        kv_cache_config, vllm_config
    )
    sizing = worker_sizing(
        vllm_config,
        num_kv_blocks=kv_cache_config.num_blocks,
        scheduler_block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        shape_per_token=capturer.shape_per_token,
        dtype=capturer.output_dtype_name,
    )
    # The model runner output (and every prepare_output) comes from the last pipeline stage.
    is_output_rank = get_tp_group().is_first_rank and pp.is_last_rank
    worker = TritonAuxOutputWorker(
        sizing,
        device=capturer.device_buffer.device,
        capture_buffer=capturer.device_buffer,
        is_output_rank=is_output_rank,
        partial_first_ok=pd.selected_pd(vllm_config) == "splice",
    )
    if pp.world_size > 1:
        worker.pipeline_relay = _pipeline_relay(vllm_config, capturer, pp)
    logger.info(
        "r3capture: triton aux-output backend: rows %s %s, hash block %d tokens, store %d bytes "
        "(%d blocks), %s",
        sizing.shape_per_token,
        sizing.dtype,
        sizing.hash_block_size,
        sizing.max_bytes,
        sizing.max_bytes // sizing.block_nbytes,
        "output rank" if is_output_rank else "capture only (not the output rank)",
    )
    return worker


def _has_moe_layers(model: torch.nn.Module) -> bool:
    """Whether ``model`` (this stage's part) has a layer vLLM's capturer binds to."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
        RoutedExpertsCaptureSource,
    )

    return any(
        isinstance(module, (MoERunner, RoutedExpertsCaptureSource)) for module in model.modules()
    )


def _pipeline_relay(vllm_config: Any, capturer: Any, pp: Any):
    """This stage's relay of routed-expert rows (``pipeline.py``)."""
    from vllm.distributed.utils import get_pp_indices

    from r3capture.aux_output.pipeline import PipelineRelay

    num_layers = capturer.device_buffer.shape[1]
    own_layers = get_pp_indices(num_layers, pp.rank_in_group, pp.world_size)
    logger.info(
        "r3capture: pipeline stage %d/%d runs layers [%d, %d) and relays routed experts",
        pp.rank_in_group,
        pp.world_size,
        *own_layers,
    )
    return PipelineRelay(
        capturer.device_buffer,
        own_layers,
        capturer.output_dtype,
        is_first=pp.is_first_rank,
        is_last=pp.is_last_rank,
    )
