"""The reload benchmark's pieces: the dead-rank plan, peak-RSS meter, checkpoint reuse, JSON."""

from __future__ import annotations

import json
import os
from collections import Counter
from multiprocessing.connection import Connection
from pathlib import Path

import attrs
import pytest
import torch

from ftengine.cli import main
from ftengine.errors import ConfigError, PlacementError, PreconditionFailed
from ftengine.testbed.bench import reload_measure
from ftengine.testbed.bench.peak_rss import PeakRss
from ftengine.testbed.bench.reload import BenchSetup, plan_worker_reload, prepare_checkpoint
from ftengine.testbed.bench.reload_measure import BenchError, ChildJob, run_child
from ftengine.weights.checkpoint_gen import remove_checkpoint
from ftengine.weights.index import CheckpointIndex, Quant

FIELDS = (
    "expert_bytes_total",
    "bytes_needed",
    "bytes_read",
    "peak_rss_delta_bytes",
    "naive_peak_rss_delta_bytes",
    "reload_s",
    "naive_reload_s",
    "raw_read_s",
    "in_place",
)


@pytest.mark.parametrize("dead", [1, 2])
def test_plan_rehosts_every_orphan_once_on_spare_slots(dead: int) -> None:
    base = BenchSetup(size_mb=1, dead_rank=dead, layers=2)
    slots, e = base.local_slots, base.experts
    row = list(range(e)) + [i % e for i in range(base.redundant)]
    survivors = [r for r in range(base.dp) if r != dead]
    moves: dict[tuple[int, int], int] = {}
    for rank in survivors:
        plan = plan_worker_reload(attrs.evolve(base, worker_rank=rank))
        assert plan.rank == rank
        assert plan.initial == tuple(
            (lay, s, row[rank * slots + s]) for lay in range(2) for s in range(slots)
        )
        for layer, slot, expert in plan.reload:
            assert 0 <= slot < slots
            moves[(layer, rank * slots + slot)] = expert
    for layer in range(2):
        live = {p: row[p] for p in range(len(row)) if p // slots != dead}
        orphans = set(range(e)) - set(live.values())
        assert orphans, "ranks 1 and 2 hold the only copy of some experts"
        mine = {p: x for (lay, p), x in moves.items() if lay == layer}
        assert Counter(mine.values()) == Counter(orphans)  # each orphan exactly once
        donors = Counter(live[p] for p in mine)
        replicas = Counter(live.values())
        assert all(replicas[x] > n for x, n in donors.items())  # donors keep a replica
        live.update(mine)
        assert set(live.values()) == set(range(e))


def test_default_worker_is_the_survivor_with_the_most_reloads() -> None:
    base = BenchSetup(size_mb=1, dead_rank=1)
    chosen = plan_worker_reload(base)
    assert chosen.rank != 1 and chosen.reload
    for rank in (0, 2, 3):
        other = plan_worker_reload(attrs.evolve(base, worker_rank=rank))
        assert len(other.reload) <= len(chosen.reload)
        if rank == chosen.rank:
            assert other == chosen


def test_plan_is_deterministic_and_refuses_a_dead_worker() -> None:
    setup = BenchSetup(size_mb=1)
    assert plan_worker_reload(setup) == plan_worker_reload(setup)
    # Rank 3 only holds redundant copies: losing it orphans nothing.
    assert plan_worker_reload(BenchSetup(size_mb=1, dead_rank=3)).reload == ()
    with pytest.raises(PlacementError, match="must survive"):
        plan_worker_reload(BenchSetup(size_mb=1, dead_rank=0, worker_rank=0))
    with pytest.raises(PreconditionFailed, match="insufficient redundancy"):
        plan_worker_reload(BenchSetup(size_mb=1, experts=64, redundant=0))


def test_peak_rss_sees_a_transient_allocation() -> None:
    size = 64 * 2**20
    with PeakRss() as meter:
        block = torch.ones(size, dtype=torch.uint8)  # touched pages
        del block
    assert meter.method in ("vmhwm", "sampled")
    assert meter.delta >= size * 0.9


def test_model_shape_tracks_the_requested_size() -> None:
    quants: tuple[Quant, ...] = ("none", "w8a8_dynamic")
    for quant in quants:
        setup = BenchSetup(size_mb=1024, quant=quant)
        shape = setup.model_shape()
        per_byte = 1 if quant == "w8a8_dynamic" else 2
        experts = shape.layers * shape.experts * 3 * shape.hidden * shape.intermediate * per_byte
        assert 0.85 < experts / 2**30 < 1.15
        assert shape.hidden % 64 == 0 and shape.intermediate * 2 == shape.hidden


def test_checkpoint_is_reused_only_when_identical(tmp_path: Path) -> None:
    setup = BenchSetup(size_mb=0.5, layers=1)
    _, reused = prepare_checkpoint(setup, tmp_path / "ck")
    assert not reused
    _, reused = prepare_checkpoint(setup, tmp_path / "ck")
    assert reused
    _, reused = prepare_checkpoint(BenchSetup(size_mb=0.5, layers=1, seed=1), tmp_path / "ck")
    assert not reused


def test_storage_reads_read_exactly_what_they_say(tmp_path: Path) -> None:
    path, _ = prepare_checkpoint(BenchSetup(size_mb=0.5, layers=1), tmp_path / "ck")
    index = CheckpointIndex.open(path)
    every = list(index.experts.values())
    wanted = every[: len(every) // 3]
    # Small chunks: the runs of one chunk never merge with the next chunk's.
    assert reload_measure.needed_read(index, wanted, chunk_bytes=1) == sum(
        index.info(name).nbytes for name in wanted
    )
    assert reload_measure.needed_read(index, every) == index.expert_bytes_total
    sizes = sum(file.stat().st_size for file in index.files)
    assert reload_measure.stream_read(index.files, chunk_bytes=4096) == sizes


def test_a_foreign_directory_is_never_overwritten_or_removed(tmp_path: Path) -> None:
    foreign = tmp_path / "model"
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    (foreign / "model.safetensors").write_bytes(b"precious")
    with pytest.raises(ConfigError, match="refusing to overwrite"):
        prepare_checkpoint(BenchSetup(size_mb=0.5, layers=1), foreign)
    with pytest.raises(ConfigError, match="refusing to delete"):
        remove_checkpoint(foreign)
    assert (foreign / "model.safetensors").read_bytes() == b"precious"


def test_cli_json_has_every_measured_and_target_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--size-mb", "2", "--layers", "1", "--repeat", "1", "--timeout", "120", "--remove"]
    code = main(["bench", "reload", "--json", *args, "--checkpoint", str(tmp_path / "ck")])
    assert code == 0
    assert not (tmp_path / "ck").exists()  # --remove deleted what the run built
    result = json.loads(capsys.readouterr().out)
    for field in FIELDS:
        assert field in result, field
    assert result["in_place"] is True
    assert result["matches_naive"] is True
    assert result["bytes_needed"] < result["expert_bytes_total"]
    assert result["bytes_read"] >= result["bytes_needed"]
    assert result["naive_peak_rss_delta_bytes"] > result["peak_rss_delta_bytes"]
    assert set(result["targets_met"]) == {"bytes_read", "peak_rss", "speedup", "reload_vs_raw_read"}
    assert result["storage_needed_read_s"] > 0 and result["storage_all_read_s"] > 0
    assert result["ratios"]["storage_all_over_needed_s"] == pytest.approx(
        result["storage_all_read_s"] / result["storage_needed_read_s"], rel=1e-3
    )
    # Cold by default: every shard left the page cache before each timed run.
    assert result["cache"] == "cold"
    assert result["evicted"] is True
    assert result["cached_after_evict"] is not None and result["cached_after_evict"] <= 0.05
    assert result["disk_read_bytes"] >= result["bytes_needed"]  # cold: all from the disk
    assert result["naive_disk_read_bytes"] >= result["expert_bytes_total"]
    assert result["warm"]["reload_s"] > 0 and result["warm"]["naive_reload_s"] > 0
    assert set(result["compare"]["naive_over_reload_s"]) == {"cold", "warm"}


def test_cli_refuses_a_dead_rank_that_orphans_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--size-mb", "1", "--layers", "1", "--dead-rank", "3"]
    code = main(["bench", "reload", *args, "--checkpoint", str(tmp_path / "ck")])
    assert code == 1
    assert "nothing to reload" in capsys.readouterr().err


def test_a_failing_child_keeps_its_traceback_as_the_cause(tmp_path: Path) -> None:
    job = ChildJob(
        mode="selective",
        path=str(tmp_path / "nowhere"),
        layers=1,
        local_slots=1,
        initial=(),
        reload=(),
        caches=("warm",),
        repeat=1,
    )
    with pytest.raises(BenchError, match="selective child failed: WeightLoadError") as err:
        run_child(job, timeout_s=120.0, progress=None)
    cause = str(err.value.__cause__)
    assert "Traceback" in cause and "index.py" in cause and "not a directory" in cause


def _die_before_reporting(job: ChildJob, conn: Connection) -> None:
    """A benchmark child killed before it says anything (as by the OOM killer)."""
    os._exit(3)


def test_a_child_that_dies_silently_is_a_bench_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reload_measure, "_child", _die_before_reporting)
    job = ChildJob(mode="naive", path=str(tmp_path), layers=1, local_slots=1, initial=(), reload=())
    with pytest.raises(BenchError, match="naive child exited with code 3 before reporting") as err:
        run_child(job, timeout_s=120.0, progress=None)
    assert isinstance(err.value.__cause__, EOFError)
