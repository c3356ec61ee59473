"""Page-cache eviction for cold-cache benchmarks: the helper, the per-run prep, the labels."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ftengine.cli import main
from ftengine.testbed.bench import reload_measure
from ftengine.testbed.bench.page_cache import cached_fraction, disk_read_bytes, evict
from ftengine.testbed.bench.reload import cache_label
from ftengine.testbed.bench.reload_measure import CachePrep


def _written(path: Path, mb: int) -> Path:
    block = os.urandom(2**20)
    with path.open("wb") as fh:
        for _ in range(mb):
            fh.write(block)
    path.read_bytes()  # into the page cache
    return path


def test_evict_drops_a_cached_file_from_the_page_cache(tmp_path: Path) -> None:
    files = [_written(tmp_path / "a.safetensors", 4), _written(tmp_path / "b.safetensors", 4)]
    before = cached_fraction(files)
    assert before is not None and before >= 0.9
    assert evict(files) is True
    after = cached_fraction(files)
    assert after is not None and after <= 0.1
    files[0].read_bytes()  # reading one of two equal files brings back about half
    again = cached_fraction(files)
    assert again is not None and 0.4 <= again <= 0.6


def test_disk_read_bytes_counts_a_cold_read_but_not_a_warm_one(tmp_path: Path) -> None:
    file = _written(tmp_path / "shard", 4)
    evict([file])
    start = disk_read_bytes()
    assert start is not None
    file.read_bytes()
    cold = disk_read_bytes()
    assert cold is not None and cold - start >= 4 * 2**20
    file.read_bytes()
    warm = disk_read_bytes()
    assert warm is not None and warm - cold < 2**20


def test_evict_and_cached_fraction_handle_edge_cases(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert evict([empty]) is True
    assert cached_fraction([empty]) == 0.0
    assert cached_fraction([]) == 0.0
    with pytest.raises(FileNotFoundError):
        evict([tmp_path / "missing"])


def test_cold_prep_evicts_every_shard_before_each_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = [_written(tmp_path / f"s{i}.safetensors", 1) for i in range(3)]
    calls: list[list[Path]] = []

    def record(paths: list[Path]) -> bool:
        calls.append(list(paths))
        return evict(paths)

    monkeypatch.setattr(reload_measure, "evict", record)
    prep = CachePrep(files, "cold")
    prep()
    prep()
    assert calls == [files, files]
    assert prep.report() == {"evicted": True, "cached_after_evict": 0.0}


def test_warm_prep_reads_the_shards_once_and_never_evicts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = [_written(tmp_path / "s.safetensors", 1)]
    evict(files)
    monkeypatch.setattr(reload_measure, "evict", lambda paths: pytest.fail("evicted"))
    warmed: list[list[Path]] = []
    monkeypatch.setattr(reload_measure, "warm_page_cache", lambda paths: warmed.append(paths))
    prep = CachePrep(files, "warm")
    prep()
    prep()
    assert warmed == [files]


def test_cache_label_is_cold_only_when_eviction_worked() -> None:
    assert cache_label("cold", {"evicted": True, "cached_after_evict": 0.01}) == ("cold", None)
    assert cache_label("cold", {"evicted": True, "cached_after_evict": None}) == ("cold", None)
    label, note = cache_label("cold", {"evicted": True, "cached_after_evict": 0.9})
    assert label == "warm" and note is not None and "90%" in note
    label, note = cache_label("cold", {"evicted": False, "cached_after_evict": None})
    assert label == "warm" and note is not None and "cannot evict" in note
    assert cache_label("warm", {}) == ("warm", None)


def test_cli_warm_flag_measures_the_warm_cache_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--size-mb", "2", "--layers", "1", "--repeat", "1", "--timeout", "120", "--remove"]
    code = main(["bench", "reload", "--json", "--warm", *args, "--checkpoint", str(tmp_path)])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["cache"] == "warm"
    assert "warm" not in result and "evicted" not in result
    assert set(result["compare"]["naive_over_reload_s"]) == {"warm"}
    assert result["matches_naive"] is True
