"""Set-up shared by the NPU tests: the recording fake ``torch_npu`` for one test, and tiny
bf16 checkpoints written once per session.

A test module takes the fixtures by importing them under their own names, e.g.
``from tests.unit.npu_fixtures import npu_state as npu_state`` (the ``as`` marks the
import as deliberate for the linters: pytest finds a fixture in the module's namespace).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ftengine.weights.checkpoint_gen import make_checkpoint
from ftengine.weights.index import CheckpointIndex, Quant
from tests.fakes.npu_install import fake_torch_npu
from tests.fakes.npu_state import COMBINE, DISPATCH, TORCH_NPU_VERSIONS, FakeNpuState

__all__ = ["COMBINE", "DISPATCH", "HIDDEN", "INTERMEDIATE", "MC2_HIDDEN", "TinyCheckpoints"]

HIDDEN, INTERMEDIATE = 32, 16
MC2_HIDDEN = 1024
"""The smallest hidden size MC2 takes on Atlas A3: checkpoints whose model step runs MC2."""


class TinyCheckpoints:
    """Tiny checkpoints (hidden 32 unless asked, intermediate 16) under ``root``, each
    written once per ``(layers, experts, hidden, quant)``. Tests only read them (copy one
    before breaking it)."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._paths: dict[tuple[int, int, int, Quant], Path] = {}

    def path(
        self, *, layers: int, experts: int, hidden: int = HIDDEN, quant: Quant = "none"
    ) -> Path:
        """The checkpoint directory with ``layers`` MoE layers of ``experts`` experts."""
        key = (layers, experts, hidden, quant)
        if key not in self._paths:
            self._paths[key] = make_checkpoint(
                self._root / f"layers{layers}-experts{experts}-hidden{hidden}-{quant}",
                layers=layers,
                experts=experts,
                hidden=hidden,
                intermediate=INTERMEDIATE,
                quant=quant,
            )
        return self._paths[key]

    def index(
        self, *, layers: int, experts: int, hidden: int = HIDDEN, quant: Quant = "none"
    ) -> CheckpointIndex:
        """A fresh index over ``path(...)`` with the same arguments."""
        return CheckpointIndex.open(
            self.path(layers=layers, experts=experts, hidden=hidden, quant=quant)
        )


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoints:
    """The session's tiny checkpoints."""
    return TinyCheckpoints(tmp_path_factory.mktemp("npu-checkpoints"))


@pytest.fixture
def npu_state() -> Iterator[FakeNpuState]:
    """The fake ``torch_npu`` importable for this test; its shared, freshly reset state."""
    with fake_torch_npu() as state:
        yield state


@pytest.fixture(params=TORCH_NPU_VERSIONS)
def versioned_npu_state(request: pytest.FixtureRequest) -> Iterator[FakeNpuState]:
    """The fake ``torch_npu`` of each targeted release in turn (its signatures differ)."""
    with fake_torch_npu(request.param) as state:
        yield state
