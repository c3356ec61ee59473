"""The CPU backend passes the Backend conformance suite in a one-rank gloo world."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ftengine.backends.base import Backend
from tests.conformance import BackendConformance
from tests.gloo_support import one_rank_backend, one_rank_store, tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("cpu") / "ckpt")


class TestCpuBackend(BackendConformance):
    @pytest.fixture
    def backend(self, checkpoint: Path) -> Iterator[Backend]:
        store = one_rank_store()
        backend = one_rank_backend(checkpoint, store)
        yield backend
        backend.close()


def test_collectives_are_refused_while_quarantined(checkpoint: Path) -> None:
    from ftengine.errors import BackendError
    from ftengine.faults import Fault, FaultKind

    store = one_rank_store()
    backend = one_rank_backend(checkpoint, store)
    backend.quarantine(Fault(FaultKind.TRANSIENT, rank=0))
    with pytest.raises(BackendError, match="quarantined=True"):
        backend.run_dummy_batch()
    backend.rebuild_groups(frozenset({0}), 1)
    backend.run_dummy_batch()
    assert (backend.epoch, backend.quarantined) == (1, False)


def test_dp_sync_reports_token_counts_and_checks_lockstep(checkpoint: Path) -> None:
    store = one_rank_store()
    backend = one_rank_backend(checkpoint, store)
    assert backend.dp_sync(7, 3).tolist() == [7]


def test_op_timeout_zero_means_effectively_off(checkpoint: Path) -> None:
    store = one_rank_store()
    backend = one_rank_backend(checkpoint, store)
    backend.set_op_timeout(0)
    assert backend.op_timeout_s >= 3600
    backend.set_op_timeout(1.5)
    assert backend.op_timeout_s == 1.5
