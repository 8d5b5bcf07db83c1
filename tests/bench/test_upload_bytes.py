"""bench.upload_bytes: the bytes r3capture's slot-ring uploads copy, against the whole buffer."""

from __future__ import annotations

import json

from bench import upload_bytes as ub
from r3capture.aux_output import device_side


def test_main_counts_every_upload_and_copies_less_than_the_whole_buffer(tmp_path) -> None:
    upload = device_side.device_upload
    assert (
        ub.main(["--families", "decode-8", "--max-num-seqs", "0", "1024", "--out", str(tmp_path)])
        == 0
    )
    assert device_side.device_upload is upload  # the counting wrapper is gone
    payload = json.loads((tmp_path / "upload_bytes.json").read_text())
    assert (tmp_path / "upload_bytes.png").stat().st_size > 0
    rows = payload["uploads"]
    assert [(r["family"], r["max_num_seqs"]) for r in rows] == [
        ("decode-8", "family's own"),
        ("decode-8", 1024),
    ]
    for row in rows:
        assert row["uploads"] > 0
        assert row["whole_buffer_bytes"] == row["uploads"] * row["buffer_bytes"]
        assert 0 < row["copied_bytes"] < row["whole_buffer_bytes"]
    # vLLM's serving size: 1,024 table rows and 8,192 / 16 + 1,024 x 19 ring entries, each
    # an int64 index and an int32 value.
    assert rows[1]["buffer_bytes"] == 4 * (1024 + 3 * (8192 // 16 + 1024 * (1 + 2 + 16)))
