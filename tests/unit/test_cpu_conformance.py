"""The CPU backend passes the Backend conformance suite in a one-rank gloo world."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from torch._C._distributed_c10d import TCPStore

from ftengine.backends.base import Backend
from ftengine.backends.cpu import CpuBackend
from ftengine.backends.cpu_experts import CpuExperts
from ftengine.weights.checkpoint_gen import make_checkpoint
from ftengine.weights.index import CheckpointIndex
from tests.conformance import BackendConformance


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(
        tmp_path_factory.mktemp("cpu") / "ckpt",
        layers=2,
        experts=4,
        hidden=16,
        intermediate=8,
        vocab=32,
        heads=2,
        kv_heads=1,
    )


def one_rank_backend(checkpoint: Path, store: TCPStore) -> CpuBackend:
    index = CheckpointIndex.open(checkpoint)
    experts = CpuExperts.load(index, rank=0, world=1, num_redundant=4)
    backend = CpuBackend(
        rank=0,
        world_size=1,
        store=store,
        experts=experts,
        op_timeout_s=5.0,
        rendezvous_timeout_s=5.0,
    )
    backend.rebuild_groups(frozenset({0}), 0)
    return backend


class TestCpuBackend(BackendConformance):
    @pytest.fixture
    def backend(self, tiny_checkpoint: Path) -> Iterator[Backend]:
        store = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
        backend = one_rank_backend(tiny_checkpoint, store)
        yield backend
        backend.close()


def test_collectives_are_refused_while_quarantined(tiny_checkpoint: Path) -> None:
    from ftengine.errors import BackendError
    from ftengine.faults import Fault, FaultKind

    store = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    backend = one_rank_backend(tiny_checkpoint, store)
    backend.quarantine(Fault(FaultKind.TRANSIENT, rank=0))
    with pytest.raises(BackendError, match="quarantined=True"):
        backend.run_dummy_batch()
    backend.rebuild_groups(frozenset({0}), 1)
    backend.run_dummy_batch()
    assert (backend.epoch, backend.quarantined) == (1, False)


def test_dp_sync_reports_token_counts_and_checks_lockstep(tiny_checkpoint: Path) -> None:
    store = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    backend = one_rank_backend(tiny_checkpoint, store)
    assert backend.dp_sync(7, 3).tolist() == [7]


def test_op_timeout_zero_means_effectively_off(tiny_checkpoint: Path) -> None:
    store = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    backend = one_rank_backend(tiny_checkpoint, store)
    backend.set_op_timeout(0)
    assert backend.op_timeout_s >= 3600
    backend.set_op_timeout(1.5)
    assert backend.op_timeout_s == 1.5
