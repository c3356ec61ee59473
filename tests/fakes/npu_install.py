"""Put the fake torch_npu on ``sys.path`` for one test and take it away again afterwards."""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.fakes.npu_state import STATE, FakeNpuState

FAKES_DIR = Path(__file__).resolve().parent


def _torch_npu_modules() -> dict[str, object]:
    return {
        name: module
        for name, module in sys.modules.items()
        if name == "torch_npu" or name.startswith("torch_npu.")
    }


@contextlib.contextmanager
def fake_torch_npu() -> Iterator[FakeNpuState]:
    """Make ``import torch_npu`` load the fake; yields the fresh shared ``STATE``.

    Restores ``sys.path`` and ``sys.modules`` on exit, so no later test sees the fake.
    """
    saved = _torch_npu_modules()
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, str(FAKES_DIR))
    STATE.reset()
    try:
        module = importlib.import_module("torch_npu")
        origin = Path(str(module.__file__)).resolve()
        if FAKES_DIR not in origin.parents:
            raise RuntimeError(f"expected the fake torch_npu under {FAKES_DIR}, got {origin}")
        yield STATE
    finally:
        sys.path.remove(str(FAKES_DIR))
        for name in _torch_npu_modules():
            del sys.modules[name]
        sys.modules.update(saved)  # type: ignore[arg-type]
        STATE.reset()
