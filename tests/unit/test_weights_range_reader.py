"""Range reader: coalescing of byte ranges, zero-copy views, short reads named clearly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ftengine.errors import WeightLoadError
from ftengine.weights.range_reader import RangeReader, coalesce
from ftengine.weights.safetensors_header import TensorInfo, read_header


def _info(name: str, begin: int, end: int, file: str = "a") -> TensorInfo:
    return TensorInfo(name, Path(file), "U8", (end - begin,), begin, end)


def test_coalesce_merges_adjacent_and_near_ranges_per_file() -> None:
    infos = [
        _info("c", 200, 300),
        _info("a", 0, 100),
        _info("b", 100, 150),  # adjacent to a
        _info("b", 100, 150),  # the same tensor twice is read once
        _info("d", 5000, 5100),  # 4700 bytes after c: beyond the gap
        _info("e", 0, 10, file="b"),  # another file never merges
    ]
    runs = coalesce(infos, gap=49)
    assert [(r.file.name, r.begin, r.end) for r in runs] == [
        ("a", 0, 150),
        ("a", 200, 300),
        ("a", 5000, 5100),
        ("b", 0, 10),
    ]
    assert [i.name for i in runs[0].tensors] == ["a", "b"]
    merged = coalesce(infos, gap=50)
    assert [(r.begin, r.end) for r in merged][:2] == [(0, 300), (5000, 5100)]
    assert [i.name for i in merged[0].tensors] == ["a", "b", "c"]


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    path = tmp_path / "s.safetensors"
    save_file(
        {
            "w1": torch.arange(600, dtype=torch.bfloat16).reshape(20, 30),
            "w2": torch.arange(77, dtype=torch.int8),
            "w3": torch.randn(33, 5),
        },
        str(path),
    )
    return path


def test_reads_exact_tensors_as_views_of_one_buffer(shard: Path) -> None:
    header = read_header(shard)
    infos = list(header.tensors.values())
    with RangeReader(depth=2) as reader:
        chunks = list(reader.chunks([infos[:1], infos[1:]]))
        # Chunks live in different staging buffers, so both are still intact here.
        for chunk, wanted in zip(chunks, [infos[:1], infos[1:]], strict=True):
            for info in wanted:
                got = chunk[(shard, info.name)]
                assert (got.dtype, tuple(got.shape)) == (info.torch_dtype, info.shape)
        assert reader.bytes_read == sum(run.nbytes for run in coalesce(infos[:1])) + sum(
            run.nbytes for run in coalesce(infos[1:])
        )
    with safe_open(str(shard), framework="pt") as handle:
        for chunk, wanted in zip(chunks, [infos[:1], infos[1:]], strict=True):
            for info in wanted:
                assert torch.equal(chunk[(shard, info.name)], handle.get_tensor(info.name))


def test_a_truncated_shard_raises_naming_file_and_tensor(shard: Path) -> None:
    infos = sorted(read_header(shard).tensors.values(), key=lambda i: i.begin)
    last = infos[-1]
    os.truncate(shard, last.begin + 3)  # after the header check, as if rewritten meanwhile
    with RangeReader() as reader, pytest.raises(WeightLoadError) as caught:
        list(reader.chunks([infos]))
    message = str(caught.value)
    assert str(shard) in message and repr(last.name) in message and "end of file" in message


def test_a_missing_shard_raises_naming_it(tmp_path: Path) -> None:
    gone = tmp_path / "gone.safetensors"
    with RangeReader() as reader, pytest.raises(WeightLoadError, match=r"gone\.safetensors"):
        reader.read([_info("x", 0, 8, file=str(gone))])
