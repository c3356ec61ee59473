"""Expert load tables: zipf generator, normalisation, files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ftengine.errors import ConfigError, PlacementError
from ftengine.placement.loads import load_from_file, normalize_load, zipf_load


def test_zipf_counts_top_k_distinct_picks_per_token() -> None:
    load = zipf_load(3, 16, exponent=1.0, seed=5, top_k=4, tokens=200)
    assert load.shape == (3, 16)
    assert load.sum(dim=1).tolist() == [800.0] * 3
    assert float(load.max()) <= 200.0  # no expert is picked twice by one token
    assert torch.equal(load, zipf_load(3, 16, exponent=1.0, seed=5, top_k=4, tokens=200))
    assert not torch.equal(load[0], load[1])  # each layer has its own popular experts


def test_zipf_skews_the_load() -> None:
    load = zipf_load(1, 64, exponent=1.0, seed=0, top_k=1, tokens=4000)
    hottest = float(load.max())
    assert hottest > 5 * float(load.median())


def test_zipf_refuses_impossible_top_k() -> None:
    with pytest.raises(PlacementError, match="top_k"):
        zipf_load(1, 4, top_k=5)


def test_normalize_broadcasts_one_row_and_copies() -> None:
    row = torch.tensor([1.0, 2.0, 3.0])
    table = normalize_load(row, 2, 3)
    assert table.tolist() == [[1.0, 2.0, 3.0]] * 2
    table[0, 0] = 9.0
    assert row[0] == 1.0
    assert normalize_load(None, 1, 2).tolist() == [[1.0, 1.0]]
    with pytest.raises(PlacementError, match="finite"):
        normalize_load(torch.tensor([1.0, float("nan")]), 1, 2)


@pytest.mark.parametrize("suffix", [".json", ".npy", ".pt"])
def test_load_files(tmp_path: Path, suffix: str) -> None:
    table = [[1.0, 2.0], [3.0, 4.0]]
    path = tmp_path / f"load{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(table))
    elif suffix == ".npy":
        np.save(path, np.array(table))
    else:
        torch.save(torch.tensor(table), path)
    assert load_from_file(path, 2, 2).tolist() == table


def test_bad_load_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown load file type"):
        load_from_file(tmp_path / "load.csv", 1, 2)
    broken = tmp_path / "load.json"
    broken.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read") as caught:
        load_from_file(broken, 1, 2)
    assert caught.value.__cause__ is not None
    wrong = tmp_path / "shape.json"
    wrong.write_text("[[1, 2, 3]]")
    with pytest.raises(PlacementError, match="expected expert load"):
        load_from_file(wrong, 1, 2)


def test_bad_values_are_located_in_the_error() -> None:
    negative = torch.ones(2, 3)
    negative[1, 2] = -0.5
    with pytest.raises(PlacementError, match=r"layer 1, expert 2 is -0\.5"):
        normalize_load(negative, 2, 3)
    infinite = torch.ones(3)
    infinite[1] = float("inf")
    with pytest.raises(PlacementError, match=r"layer 0, expert 1 is inf"):
        normalize_load(infinite, 2, 3)


def test_a_corrupt_torch_file_is_a_config_error(tmp_path: Path) -> None:
    garbage = tmp_path / "load.pt"
    garbage.write_bytes(b"\x80\x02 not a torch file")
    with pytest.raises(ConfigError, match="cannot read an expert load table") as caught:
        load_from_file(garbage, 1, 2)
    assert caught.value.__cause__ is not None
