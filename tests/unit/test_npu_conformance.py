"""The NPU backend (on the recording fake torch_npu) passes the shared backend conformance suite."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ftengine.backends.base import Backend
from ftengine.weights.checkpoint_gen import make_checkpoint
from ftengine.weights.index import CheckpointIndex
from tests.conformance import BackendConformance
from tests.fakes.npu_host import make_npu_rig
from tests.fakes.npu_install import fake_torch_npu
from tests.fakes.npu_state import FakeNpuState


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("npu-conformance")
    return make_checkpoint(root / "ckpt", layers=2, experts=4, hidden=32, intermediate=16)


@pytest.fixture
def npu_state() -> Iterator[FakeNpuState]:
    with fake_torch_npu() as state:
        yield state


class TestNpuBackendConformance(BackendConformance):
    @pytest.fixture
    def backend(self, npu_state: FakeNpuState, checkpoint: Path) -> Iterator[Backend]:
        rig = make_npu_rig(CheckpointIndex.open(checkpoint), dp_rank=self.rank, dp_size=1)
        yield rig.backend
        assert not npu_state.poisoned
