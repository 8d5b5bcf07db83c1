"""bench.device_memory: r3capture's device buffers by accounting, against vLLM's snapshot."""

from __future__ import annotations

import json

import pytest

from bench import device_memory as dm
from bench.models import KIMI_K2, MIXTRAL_8X7B
from r3capture.aux_output.sizing import ring_widths


def test_device_bytes_are_the_ring_records_and_heads() -> None:
    seqs = 1024
    width, device_width = ring_widths(dm.MAX_NUM_BATCHED_TOKENS, dm.HASH_BLOCK, dm.DEPTH)
    assert device_width < width  # the device keeps one step's blocks, the host all unbound
    # Per request index (MRV2's, below max_num_seqs) an int64 ring and two int64 records;
    # heads: the queue's two heads, the last launch's serial, a count of finished programs.
    ring = seqs * device_width * 8
    records = seqs * 2 * 8
    heads = 4 * 8
    got, queue = dm.r3capture_bytes(KIMI_K2, seqs)
    # step_info and the free-slot queue are not among them: pinned host memory.
    assert got == dm.r3capture_device_bytes(KIMI_K2, seqs) == ring + records + heads
    blocks_per_step = dm.MAX_NUM_BATCHED_TOKENS // dm.HASH_BLOCK + seqs
    stock = dm.DEPTH * blocks_per_step
    assert queue == (stock + blocks_per_step) * 4  # int32 slot ids
    # Nothing r3capture keeps on the device depends on the model's rows.
    assert dm.r3capture_bytes(MIXTRAL_8X7B, seqs) == (got, queue)


def test_main_writes_a_row_per_model_and_size(tmp_path, capsys) -> None:
    assert dm.main(["--max-num-seqs", "4", "8", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "device_memory.json").read_text())
    assert (tmp_path / "device_memory.png").stat().st_size > 0
    rows = payload["memory"]
    assert [(r["max_num_seqs"], r["model"]) for r in rows] == [
        (n, m.name) for n in (4, 8) for m in dm.MODELS
    ]
    kimi = next(r for r in rows if r["model"] == "Kimi-K2" and r["max_num_seqs"] == 8)
    assert (kimi["r3capture_bytes"], kimi["r3capture_queue_host_bytes"]) == dm.r3capture_bytes(
        KIMI_K2, 8
    )
    assert kimi["vllm_snapshot_bytes"] == 8192 * 61 * 8 * 2
    assert kimi["vllm_in_flight_bytes"] == 2 * kimi["vllm_snapshot_bytes"]
    assert "Kimi-K2" in capsys.readouterr().out


def test_max_num_seqs_below_one_is_refused(tmp_path) -> None:
    with pytest.raises(SystemExit):
        dm.main(["--max-num-seqs", "0", "--out", str(tmp_path)])
