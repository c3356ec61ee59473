"""Put the fake torch_npu (and the vLLM-Ascend stand-in) on ``sys.path`` for one test and take
them away again afterwards."""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.fakes.npu_state import STATE, TORCH_NPU_VERSIONS, FakeNpuState

FAKES_DIR = Path(__file__).resolve().parent


FAKE_PACKAGES = ("torch_npu", "vllm_ascend")
"""Top-level packages under ``tests/fakes`` that tests import by their real names."""


def _fake_modules() -> dict[str, object]:
    return {
        name: module for name, module in sys.modules.items() if name.split(".")[0] in FAKE_PACKAGES
    }


@contextlib.contextmanager
def fake_torch_npu(version: str = TORCH_NPU_VERSIONS[0]) -> Iterator[FakeNpuState]:
    """Make ``import torch_npu`` load the fake of torch_npu ``version`` (and ``import
    vllm_ascend`` the stand-in); yields the fresh shared ``STATE``.

    Restores ``sys.path`` and ``sys.modules`` on exit, so no later test sees the fake.
    """
    saved = _fake_modules()
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, str(FAKES_DIR))
    STATE.reset(version)
    try:
        module = importlib.import_module("torch_npu")
        origin = Path(str(module.__file__)).resolve()
        if FAKES_DIR not in origin.parents:
            raise RuntimeError(f"expected the fake torch_npu under {FAKES_DIR}, got {origin}")
        yield STATE
    finally:
        sys.path.remove(str(FAKES_DIR))
        for name in _fake_modules():
            del sys.modules[name]
        sys.modules.update(saved)  # type: ignore[arg-type]
        STATE.reset()
