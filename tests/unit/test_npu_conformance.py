"""The NPU backend (on the recording fake torch_npu) passes the shared backend conformance suite."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ftengine.backends.base import Backend
from ftengine.weights.index import CheckpointIndex
from tests.conformance import BackendConformance
from tests.fakes.npu_host import make_npu_rig
from tests.fakes.npu_state import FakeNpuState
from tests.unit.npu_fixtures import TinyCheckpoints
from tests.unit.npu_fixtures import npu_state as npu_state
from tests.unit.npu_fixtures import tiny_checkpoints as tiny_checkpoints


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints: TinyCheckpoints) -> Path:
    return tiny_checkpoints.path(layers=2, experts=4)


class TestNpuBackendConformance(BackendConformance):
    @pytest.fixture
    def backend(self, npu_state: FakeNpuState, checkpoint: Path) -> Iterator[Backend]:
        rig = make_npu_rig(CheckpointIndex.open(checkpoint), dp_rank=self.rank, dp_size=1)
        yield rig.backend
        assert not npu_state.poisoned
