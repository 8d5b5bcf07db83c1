"""bench.common's machine description: the CPU's cache sizes come from Linux's sysfs."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import common

SYSFS_CACHE = Path("/sys/devices/system/cpu/cpu0/cache")


def _fake_cache(root: Path, entries: list[tuple[str, str]]) -> None:
    for i, (level, size) in enumerate(entries):
        index = root / f"index{i}"
        index.mkdir(parents=True)
        (index / "level").write_text(level + "\n")
        (index / "size").write_text(size + "\n")


def test_cpu_caches_reads_levels_two_and_three(tmp_path, monkeypatch):
    _fake_cache(tmp_path, [("1", "32K"), ("1", "64K"), ("2", "512K"), ("3", "8192K")])
    monkeypatch.setattr(common, "_CPU_CACHE_DIR", tmp_path)
    assert common._cpu_caches() == "L2 512K, L3 8192K"


def test_cpu_caches_says_when_unknown(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "_CPU_CACHE_DIR", tmp_path / "missing")
    assert common._cpu_caches() == "caches unknown"


@pytest.mark.skipif(not SYSFS_CACHE.is_dir(), reason="no CPU cache description in sysfs")
def test_machine_names_the_caches_on_a_cpu_host():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU host is named by its GPU")
    assert "L2 " in common.machine_info()["machine"]
