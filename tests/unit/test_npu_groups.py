"""The process groups the NPU backend owns: registration, staleness, rebuilds, real gloo."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ftengine.backends.npu_groups import OwnedGroups, TorchGroupFactory
from ftengine.errors import BackendError
from tests.fakes.npu_host import FakeGroup, RecordingGroupFactory


def test_groups_are_created_on_registration_and_rebuilt_in_order() -> None:
    factory = RecordingGroupFactory()
    groups = OwnedGroups(factory, [3, 1, 0, 2], cpu_timeout_s=12.0)
    sync = groups.register("dp_sync")
    side = groups.register("ep_side", backend="hccl")
    assert groups.names == ("dp_sync", "ep_side")
    assert factory.created == [
        FakeGroup(0, (0, 1, 2, 3), "gloo", 12.0),
        FakeGroup(1, (0, 1, 2, 3), "hccl", None),
    ]
    groups.rebuild([0, 2, 1], 5)
    assert factory.destroyed == [sync, side]
    assert factory.created[2:] == [
        FakeGroup(2, (0, 1, 2), "gloo", 12.0),
        FakeGroup(3, (0, 1, 2), "hccl", None),
    ]
    assert (groups.members, groups.epoch) == ((0, 1, 2), 5)
    assert groups.get("dp_sync") is factory.created[2]


def test_stale_groups_refuse_use_until_recreated() -> None:
    factory = RecordingGroupFactory()
    groups = OwnedGroups(factory, [0, 1])
    groups.register("dp_sync")
    groups.mark_stale()
    with pytest.raises(BackendError, match="stale after a device reset"):
        groups.get("dp_sync")
    groups.recreate()
    assert groups.get("dp_sync") is factory.created[-1]
    assert (groups.members, groups.epoch) == ((0, 1), 0)


def test_a_reset_recreates_gloo_groups_and_keeps_the_resumed_hccl_ones() -> None:
    factory = RecordingGroupFactory()
    groups = OwnedGroups(factory, [0, 1])
    sync = groups.register("dp_sync")
    side = groups.register("ep_side", backend="hccl")
    groups.mark_stale()
    groups.recreate()
    # reinit_process_group(None, rebuild_link=False) resumed the HCCL group in place.
    assert factory.destroyed == [sync]
    assert groups.get("ep_side") is side
    assert groups.get("dp_sync") is factory.created[-1]
    assert factory.created[-1] == FakeGroup(2, (0, 1), "gloo", None)


def test_names_are_unique_and_unknown_names_are_reported() -> None:
    groups = OwnedGroups(RecordingGroupFactory(), [0])
    groups.register("dp_sync")
    with pytest.raises(BackendError, match="already owned"):
        groups.register("dp_sync")
    with pytest.raises(BackendError, match="no owned process group 'other'"):
        groups.get("other")


@pytest.fixture
def gloo_world(tmp_path: Path) -> Iterator[None]:
    if dist.is_initialized():
        pytest.fail("a default process group is already initialised in this test process")
    store = tmp_path / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_torch_factory_makes_working_gloo_groups_and_rebuilds_them(gloo_world: None) -> None:
    groups = OwnedGroups(TorchGroupFactory(), [0], cpu_timeout_s=5.0)
    first = groups.register("dp_sync")
    value = torch.ones(3)
    dist.all_reduce(value, group=first)
    groups.rebuild([0], 1)
    second = groups.get("dp_sync")
    assert second is not first
    assert isinstance(second, dist.ProcessGroup)
    assert dist.get_world_size(second) == 1
    dist.all_reduce(value, group=second)
    assert value.tolist() == [1.0, 1.0, 1.0]
