"""Selective in-place reload: reads only what it needs, writes in place, fails without writing."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ftengine.errors import PlacementError, WeightLoadError
from ftengine.weights import range_reader, reload, shard_reader
from ftengine.weights.checkpoint_gen import make_checkpoint
from ftengine.weights.index import CheckpointIndex, expert_tensor_name
from ftengine.weights.integrity import Manifest
from ftengine.weights.layout import to_w2, to_w13
from ftengine.weights.nz import from_fractal_nz
from ftengine.weights.range_reader import GAP_BYTES, coalesce
from ftengine.weights.reload import load_experts_into_slots
from ftengine.weights.slot_jobs import SlotJob, plan_slot_jobs
from ftengine.weights.slots import ExpertSlots

H, INTER = 64, 32
SIZES = {"layers": 2, "experts": 6, "hidden": H, "intermediate": INTER}


def _make(path: Path, **options: Any) -> Path:
    """A tiny checkpoint of the module's sizes (``options`` go to make_checkpoint)."""
    return make_checkpoint(path, **{**SIZES, **options})


PLAN = [(0, 0, 2), (1, 2, 5), (1, 0, 0)]


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return _make(tmp_path / "ck", shards=3, manifest=True)


def _filled(index: CheckpointIndex, *, nz: bool = False) -> ExpertSlots:
    """Slots with a non-zero initial content, so 'unchanged' is a real check."""
    slots = ExpertSlots.allocate(index, 2, 3, nz=nz, fused_scales=index.quant != "none")
    load_experts_into_slots(index, slots, [(0, s, s) for s in range(3)] + [(1, 1, 4)])
    return slots


def _snapshot(slots: ExpertSlots) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in slots.tensors().items()}


def _assert_unchanged(slots: ExpertSlots, before: dict[str, torch.Tensor]) -> None:
    for name, tensor in slots.tensors().items():
        assert torch.equal(tensor.view(torch.uint8), before[name].view(torch.uint8)), name


def _expert(index: CheckpointIndex, layer: int, expert: int) -> dict[str, torch.Tensor]:
    names = {p: expert_tensor_name(layer, expert, f"{p}_proj") for p in ("gate", "up", "down")}
    return {p: index.read(name) for p, name in names.items()}


def test_loads_exactly_the_assigned_experts(ckpt: Path) -> None:
    index = CheckpointIndex.open(ckpt)
    slots = _filled(index)
    untouched = slots.w13[0, 1].clone()
    stats = load_experts_into_slots(index, slots, PLAN)
    for layer, slot, expert in PLAN:
        parts = _expert(index, layer, expert)
        assert torch.equal(slots.w13[layer, slot], to_w13(parts["gate"], parts["up"]))
        assert torch.equal(slots.w2[layer, slot], to_w2(parts["down"]))
    assert torch.equal(slots.w13[0, 1], untouched)
    per_expert = 3 * H * INTER * 2
    assert stats.experts == 3
    assert stats.bytes_needed == 3 * per_expert
    touched = _files(PLAN, ckpt)
    headers = sum(h.header_bytes for h in index.files.values() if h.file.name in touched)
    # Each touched header once (the check), then the coalesced runs of tensor data.
    infos = [info for job in _jobs(index, slots) for info in job.parts.values()]
    runs = sum(run.nbytes for run in coalesce(infos))
    assert stats.bytes_read == runs + headers
    assert stats.bytes_needed <= runs <= stats.bytes_needed + GAP_BYTES * len(infos)
    assert stats.files == len(_files(PLAN, ckpt))
    assert stats.seconds > 0


def _files(plan: list[tuple[int, int, int]], ckpt: Path) -> set[str]:
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    return {
        weight_map[expert_tensor_name(layer, expert, f"{p}_proj")]
        for layer, _, expert in plan
        for p in ("gate", "up", "down")
    }


def test_reads_no_other_tensor(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    index = CheckpointIndex.open(ckpt)
    slots = _filled(index)
    runs: list[range_reader.Run] = []
    real = range_reader.RangeReader._read_run

    def recording(self: range_reader.RangeReader, run: range_reader.Run, into: Any) -> None:
        runs.append(run)
        real(self, run, into)

    monkeypatch.setattr(range_reader.RangeReader, "_read_run", recording)
    load_experts_into_slots(index, slots, PLAN)
    wanted = {
        expert_tensor_name(layer, expert, f"{p}_proj")
        for layer, _, expert in PLAN
        for p in ("gate", "up", "down")
    }
    # Every tensor whose bytes any read touched, whether needed or not.
    touched = {
        name
        for name, info in index.tensors.items()
        for run in runs
        if run.file == info.file and run.begin < info.end and info.begin < run.end
    }
    assert touched == wanted
    assert sum(run.nbytes for run in runs) == sum(index.info(n).nbytes for n in wanted)


def test_writes_in_place(ckpt: Path) -> None:
    index = CheckpointIndex.open(ckpt)
    slots = _filled(index)
    before = slots.data_ptrs()
    load_experts_into_slots(index, slots, PLAN)
    assert slots.data_ptrs() == before


def test_small_chunks_give_the_same_slots(ckpt: Path) -> None:
    index = CheckpointIndex.open(ckpt)
    whole, pieces = _filled(index), _filled(index)
    load_experts_into_slots(index, whole, PLAN)
    stats = load_experts_into_slots(index, pieces, PLAN, chunk_bytes=1)
    assert torch.equal(whole.w13, pieces.w13) and torch.equal(whole.w2, pieces.w2)
    headers = {h.file: h.header_bytes for h in index.files.values()}
    once = sum(headers[f] for f in {f for job in _jobs(index, whole) for f in _job_files(job)})
    # One chunk per slot: each slot's tensors are adjacent, so exactly the needed bytes.
    assert stats.bytes_read == stats.bytes_needed + once


def _jobs(index: CheckpointIndex, slots: ExpertSlots) -> list[SlotJob]:
    return plan_slot_jobs(index, slots, PLAN)


def _job_files(job: SlotJob) -> set[Path]:
    return {info.file for info in job.parts.values()}


def test_thread_pool_and_progress(ckpt: Path) -> None:
    index = CheckpointIndex.open(ckpt)
    serial, pooled = _filled(index), _filled(index)
    calls: list[tuple[int, int]] = []
    load_experts_into_slots(index, serial, PLAN)
    stats = load_experts_into_slots(
        index, pooled, PLAN, workers=3, progress=lambda d, t: calls.append((d, t))
    )
    assert torch.equal(serial.w13, pooled.w13) and torch.equal(serial.w2, pooled.w2)
    assert len(calls) == 3
    assert max(calls) == (stats.bytes_needed, stats.bytes_needed)


def test_w8a8_slot_layout(tmp_path: Path) -> None:
    index = CheckpointIndex.open(_make(tmp_path / "q", quant="w8a8_dynamic"))
    slots = _filled(index)
    load_experts_into_slots(index, slots, PLAN)
    layer, slot, expert = PLAN[1]
    parts = _expert(index, layer, expert)
    assert slots.w13.dtype == torch.int8
    assert torch.equal(slots.w13[layer, slot], to_w13(parts["gate"], parts["up"]))
    scale = {
        p: index.read(expert_tensor_name(layer, expert, f"{p}_proj", "weight_scale"))
        for p in ("gate", "up", "down")
    }
    assert slots.w13_scale is not None and slots.w2_scale is not None
    expected = torch.cat((scale["gate"], scale["up"])).flatten().float()
    assert torch.equal(slots.w13_scale[layer, slot], expected)
    assert torch.equal(slots.w2_scale[layer, slot], scale["down"].flatten().to(torch.bfloat16))
    assert slots.w13_scale_int64 is not None
    assert torch.equal(slots.w13_scale_int64[layer, slot], expected.view(torch.int32).long())
    assert slots.w2_offset is not None
    assert torch.count_nonzero(slots.w2_offset[layer, slot]) == 0


def test_fused_gate_up_checkpoint(tmp_path: Path) -> None:
    root = _make(tmp_path / "f", fused_gate_up=True, quant="w8a8_dynamic")
    index = CheckpointIndex.open(root)
    slots = _filled(index)
    load_experts_into_slots(index, slots, PLAN)
    gate_up = index.read(expert_tensor_name(1, 5, "gate_up_proj"))
    assert torch.equal(slots.w13[1, 2], gate_up.t())
    scale = index.read(expert_tensor_name(1, 5, "gate_up_proj", "weight_scale"))
    assert slots.w13_scale is not None
    assert torch.equal(slots.w13_scale[1, 2], scale.flatten())


def test_nz_slots(ckpt: Path) -> None:
    index = CheckpointIndex.open(ckpt)
    slots = _filled(index, nz=True)
    before = slots.data_ptrs()
    load_experts_into_slots(index, slots, PLAN)
    parts = _expert(index, 1, 0)
    assert torch.equal(
        from_fractal_nz(slots.w13[1, 0], H, 2 * INTER), to_w13(parts["gate"], parts["up"])
    )
    assert torch.equal(slots.w2_nd(1, 0), to_w2(parts["down"]))
    assert slots.data_ptrs() == before


# --- failures: the right error, and the storage byte-identical to before -----------------


def _shard_of(ckpt: Path, name: str) -> Path:
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    return ckpt / str(weight_map[name])


def _rewrite(shard: Path, change: dict[str, torch.Tensor | None]) -> None:
    with safe_open(str(shard), framework="pt") as handle:
        tensors = {k: handle.get_tensor(k).clone() for k in handle.offset_keys()}
    for name, value in change.items():
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    save_file(tensors, str(shard))


@pytest.fixture
def opened(ckpt: Path) -> Iterator[tuple[CheckpointIndex, ExpertSlots, dict[str, torch.Tensor]]]:
    index = CheckpointIndex.open(ckpt)
    slots = _filled(index)
    yield index, slots, _snapshot(slots)


LAST = expert_tensor_name(1, 0, "up_proj")  # a tensor of the plan's last assignment


def test_truncated_shard(ckpt: Path, opened: Any) -> None:
    index, slots, before = opened
    shard = _shard_of(ckpt, LAST)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightLoadError, match="truncated") as err:
        load_experts_into_slots(index, slots, PLAN)
    assert shard.name in str(err.value)
    _assert_unchanged(slots, before)


def test_shard_cut_short_during_the_reload(
    ckpt: Path, opened: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    index, slots, before = opened
    shard = _shard_of(ckpt, LAST)
    real = shard_reader.check_shard

    def check_then_truncate(file: Path, infos: Any) -> int:
        size = real(file, infos)
        if file == shard:  # the header passed; the data vanishes before it is read
            os.truncate(shard, index.info(LAST).begin + 1)
        return size

    monkeypatch.setattr(reload, "check_shard", check_then_truncate)
    with pytest.raises(WeightLoadError, match="end of file") as err:
        load_experts_into_slots(index, slots, PLAN)
    assert shard.name in str(err.value) and repr(LAST) in str(err.value)
    _assert_unchanged(slots, before)


def test_missing_tensor(ckpt: Path, opened: Any) -> None:
    index, slots, before = opened
    _rewrite(_shard_of(ckpt, LAST), {LAST: None})
    with pytest.raises(WeightLoadError, match="missing from the file") as err:
        load_experts_into_slots(index, slots, PLAN)
    assert LAST in str(err.value) and _shard_of(ckpt, LAST).name in str(err.value)
    _assert_unchanged(slots, before)


def test_corrupt_header(ckpt: Path, opened: Any) -> None:
    index, slots, before = opened
    shard = _shard_of(ckpt, LAST)
    data = bytearray(shard.read_bytes())
    data[8:20] = b"#" * 12
    shard.write_bytes(bytes(data))
    with pytest.raises(WeightLoadError) as err:
        load_experts_into_slots(index, slots, PLAN)
    assert shard.name in str(err.value)
    _assert_unchanged(slots, before)


def test_changed_dtype_or_shape_after_open(ckpt: Path, opened: Any) -> None:
    index, slots, before = opened
    _rewrite(_shard_of(ckpt, LAST), {LAST: torch.zeros(INTER, H, dtype=torch.float32)})
    with pytest.raises(WeightLoadError, match="shard changed") as err:
        load_experts_into_slots(index, slots, PLAN)
    assert LAST in str(err.value)
    _assert_unchanged(slots, before)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            torch.zeros(INTER, H, dtype=torch.float16),
            r"is F16 \[32, 64\], expected BF16 \[32, 64\]",
        ),
        (torch.zeros(INTER + 1, H, dtype=torch.bfloat16), r"is BF16 \[33, 64\], expected BF16"),
    ],
)
def test_wrong_dtype_or_shape_in_checkpoint(
    ckpt: Path, opened: Any, value: torch.Tensor, message: str
) -> None:
    _, slots, before = opened
    _rewrite(_shard_of(ckpt, LAST), {LAST: value})
    with pytest.raises(WeightLoadError, match=message):
        load_experts_into_slots(CheckpointIndex.open(ckpt), slots, PLAN)
    _assert_unchanged(slots, before)


def test_corrupt_tensor_data_caught_by_manifest(ckpt: Path, opened: Any) -> None:
    index, slots, before = opened
    info = index.info(LAST)
    with info.file.open("r+b") as fh:
        fh.seek(info.begin + 10)
        fh.write(b"\x7f\x7f\x7f\x7f")
    manifest = Manifest.load(ckpt)
    with pytest.raises(WeightLoadError, match="corrupt: sha256") as err:
        load_experts_into_slots(index, slots, PLAN, manifest=manifest)
    assert LAST in str(err.value) and info.file.name in str(err.value)
    _assert_unchanged(slots, before)
    load_experts_into_slots(index, slots, PLAN[:2], manifest=manifest)  # the intact ones load


def test_impossible_assignments(ckpt: Path, opened: Any) -> None:
    index, slots, before = opened
    with pytest.raises(PlacementError, match="outside the storage"):
        load_experts_into_slots(index, slots, [(0, 0, 1), (0, 3, 1)])
    with pytest.raises(PlacementError, match="assigned both expert"):
        load_experts_into_slots(index, slots, [(0, 0, 1), (0, 0, 2)])
    with pytest.raises(PlacementError, match="logical expert 6"):
        load_experts_into_slots(index, slots, [(0, 0, 6)])
    _assert_unchanged(slots, before)
