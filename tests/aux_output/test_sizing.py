"""WorkerSizing's row dtype: vLLM's rule, at its boundary."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest

from r3capture.aux_output.sizing import WorkerSizing, row_dtype

# Expert counts around the uint8 limit, and those of the models the benches size for
# (Mixtral-8x7B, Qwen3-30B-A3B and gpt-oss-120b, DeepSeek-V3, Kimi-K2).
EXPERT_COUNTS = (1, 8, 128, 255, 256, 257, 384, 65536)


def _vllm_capturer_dtype(num_experts: int) -> str:
    """The row dtype vLLM 0.33.0's ``RoutedExpertsCapturer`` picks for ``num_experts``."""
    capturer = pytest.importorskip("vllm.model_executor.layers.fused_moe.routed_experts_capturer")
    config = SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(model_type="test")),
        parallel_config=SimpleNamespace(data_parallel_rank=0, tensor_parallel_size=1),
    )
    with (
        mock.patch.object(capturer, "_get_routed_experts_shape", lambda _: (2, num_experts, 2)),
        mock.patch.object(capturer.current_platform, "device_type", "cpu"),
    ):
        return capturer.RoutedExpertsCapturer(4, config).output_dtype_name


@pytest.mark.parametrize("num_experts", EXPERT_COUNTS)
def test_row_dtype_is_vllms(num_experts):
    assert row_dtype(num_experts) == np.dtype(_vllm_capturer_dtype(num_experts))


@pytest.mark.parametrize(("num_experts", "dtype"), [(256, np.uint8), (257, np.uint16)])
def test_for_model_takes_the_row_dtype_of_its_expert_count(num_experts, dtype):
    sizing = WorkerSizing.for_model(
        num_layers=3,
        top_k=8,
        num_experts=num_experts,
        hash_block_size=16,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_concurrent_batches=2,
        max_bytes=1 << 20,
    )
    assert sizing.dtype == np.dtype(dtype)
    assert sizing.block_nbytes == 16 * 3 * 8 * np.dtype(dtype).itemsize


@pytest.mark.parametrize("bad", [0, -1, True, 256.0])
def test_row_dtype_refuses_a_non_count(bad):
    with pytest.raises((TypeError, ValueError), match="num_experts"):
        row_dtype(bad)


def test_derived_sizes_live_here_and_the_worker_uses_them():
    """The queue and the store reserve are sized in ``sizing.py`` only, and the worker's
    store and device queue take exactly those sizes."""
    from r3capture.aux_output.sizing import queue_size, queue_stock, reserve_slots
    from r3capture.aux_output.worker import TritonAuxOutputWorker

    sizing = WorkerSizing(
        shape_per_token=(3, 2),
        dtype=np.uint8,
        hash_block_size=16,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_concurrent_batches=2,
        max_bytes=1 << 20,
    )
    # A step touches 512 blocks of tokens plus each request's partial first block.
    assert sizing.blocks_per_step == 768
    assert queue_stock(sizing) == 2 * 768
    assert queue_size(sizing) == 3 * 768
    # The queue's ring, three steps' blocks (two in flight, one being prepared) and an open
    # block per request.
    assert reserve_slots(sizing) == 3 * 768 + 3 * 768 + 256
    worker = TritonAuxOutputWorker(sizing, kernel_impl="reference")
    assert worker.store.reserve_slots == reserve_slots(sizing)
    assert len(worker.device_side.queue_np) == queue_size(sizing)
    worker.close()
