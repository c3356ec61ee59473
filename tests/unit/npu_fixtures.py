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
from ftengine.weights.index import CheckpointIndex
from tests.fakes.npu_install import fake_torch_npu
from tests.fakes.npu_state import FakeNpuState

DISPATCH, COMBINE = "npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2"
"""The MC2 ops as the fake torch_npu records them."""

HIDDEN, INTERMEDIATE = 32, 16


class TinyCheckpoints:
    """Tiny bf16 checkpoints (hidden 32, intermediate 16) under ``root``, each written once
    per ``(layers, experts)``. Tests only read them (copy one before breaking it)."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._paths: dict[tuple[int, int], Path] = {}

    def path(self, *, layers: int, experts: int) -> Path:
        """The checkpoint directory with ``layers`` MoE layers of ``experts`` experts."""
        key = (layers, experts)
        if key not in self._paths:
            self._paths[key] = make_checkpoint(
                self._root / f"layers{layers}-experts{experts}",
                layers=layers,
                experts=experts,
                hidden=HIDDEN,
                intermediate=INTERMEDIATE,
            )
        return self._paths[key]

    def index(self, *, layers: int, experts: int) -> CheckpointIndex:
        """A fresh index over ``path(layers=..., experts=...)``."""
        return CheckpointIndex.open(self.path(layers=layers, experts=experts))


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoints:
    """The session's tiny checkpoints."""
    return TinyCheckpoints(tmp_path_factory.mktemp("npu-checkpoints"))


@pytest.fixture
def npu_state() -> Iterator[FakeNpuState]:
    """The fake ``torch_npu`` importable for this test; its shared, freshly reset state."""
    with fake_torch_npu() as state:
        yield state
