"""The vLLM CPU backend passes the Backend conformance suite, times out every vLLM group it
is given, and refuses scale-down (vLLM has no spare expert slots on CPU)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest

from ftengine.backends.base import Backend
from ftengine.errors import BackendError, PreconditionFailed
from ftengine.faults import Fault, FaultKind
from ftengine.integrations.vllm.worker.cpu_backend import OFF_S, VllmCpuBackend
from tests.conformance import BackendConformance


class Group:
    """A torch process group as far as timeouts go."""

    def __init__(self) -> None:
        self.timeouts: list[timedelta] = []

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeouts.append(timeout)


class TestVllmCpuBackend(BackendConformance):
    @pytest.fixture
    def backend(self) -> Iterator[Backend]:
        groups = [Group(), Group()]
        yield VllmCpuBackend(lambda: groups, rank=self.rank)


def test_every_group_gets_the_op_timeout_and_zero_means_off() -> None:
    groups = [Group(), Group(), object()]  # a group without set_timeout is left alone
    backend = VllmCpuBackend(lambda: groups, rank=0)
    backend.set_op_timeout(5.0)
    backend.set_op_timeout(0)
    for group in groups[:2]:
        assert isinstance(group, Group)
        assert group.timeouts == [timedelta(seconds=5.0), timedelta(seconds=OFF_S)]


def test_quarantined_refuses_batches_until_rebuilt() -> None:
    dummies: list[int] = []
    backend = VllmCpuBackend(list, rank=1, dummy=lambda: dummies.append(1))
    backend.quarantine(Fault(FaultKind.TRANSIENT, rank=1))
    with pytest.raises(BackendError, match="rank 1 is quarantined"):
        backend.run_dummy_batch()
    backend.rebuild_groups(frozenset({0, 1}), 1)
    backend.run_dummy_batch()
    assert (dummies, backend.epoch, backend.alive) == ([1], 1, frozenset({0, 1}))


def test_scale_down_is_refused_saying_why() -> None:
    backend = VllmCpuBackend(list, rank=0)
    with pytest.raises(PreconditionFailed, match=r"scale-down of ranks \[3\] .*--enable-eplb"):
        backend.mask_ranks(frozenset({3}))
    with pytest.raises(PreconditionFailed):
        backend.repair_experts(frozenset({3}))


def test_quarantine_closes_the_groups_peers_wait_on_and_only_quarantine_does() -> None:
    closes: list[str] = []
    backend = VllmCpuBackend(list, rank=1, close=lambda: closes.append("closed"))
    backend.set_op_timeout(5.0)
    backend.rebuild_groups(frozenset({0, 1}), 1)
    backend.run_dummy_batch()
    assert closes == []
    backend.quarantine(Fault(FaultKind.TRANSIENT, rank=1))
    assert closes == ["closed"] and backend.quarantined
