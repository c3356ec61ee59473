"""A vLLM carrying PR #46370's engine-core seams (its own ``EngineCoreSentinel.scale_down``,
``_reinit_groups`` instead of ``_reinit_dp_group``) cannot take ftengine's engine-core
patches: an Ascend worker then refuses to start, before the NPU is touched, instead of
running ftengine's sentinel without its engine-core half."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ftengine.integrations.vllm.patches.engine_core import CORE_SENTINEL_MODULE, ENGINE_CORE_PATCHES
from ftengine.integrations.vllm.patches.mechanism import VllmSeamMoved
from ftengine.integrations.vllm_ascend.engine_core import (
    carries_upstream_scale_down,
    engine_core_problems,
)
from ftengine.integrations.vllm_ascend.plugin import unregister
from tests.fakes.npu_state import FakeNpuState
from tests.fakes.vllm_ascend_rig import start_worker
from tests.unit.npu_fixtures import MC2_HIDDEN, TinyCheckpoints
from tests.unit.npu_fixtures import npu_state as npu_state
from tests.unit.npu_fixtures import tiny_checkpoints as tiny_checkpoints

core_sentinel = pytest.importorskip(CORE_SENTINEL_MODULE)


def with_46370_seams(base: type) -> type:
    """vLLM's engine-core sentinel as PR #46370 changes it (the seams ftengine checks)."""

    def scale_down(self: Any, ft_request: Any) -> Any:
        raise AssertionError("vLLM's own scale_down must not be reached in this test")

    def _reinit_groups(self: Any, removed_dp_ranks: Any) -> dict[str, Any]:
        raise AssertionError("vLLM's own _reinit_groups must not be reached in this test")

    return type(
        "EngineCoreSentinel",
        (base,),
        {
            "scale_down": scale_down,
            "_reinit_groups": _reinit_groups,
            "_reinit_dp_group": None,  # replaced by _reinit_groups
        },
    )


@pytest.fixture
def vllm_46370(monkeypatch: pytest.MonkeyPatch) -> Iterator[type]:
    monkeypatch.delenv("TASK_QUEUE_ENABLE", raising=False)
    stand_in = with_46370_seams(core_sentinel.EngineCoreSentinel)
    monkeypatch.setattr(core_sentinel, "EngineCoreSentinel", stand_in)
    yield stand_in
    unregister()


def test_the_installed_vllm_fits_and_is_not_46370() -> None:
    assert engine_core_problems() == ()
    assert not carries_upstream_scale_down()


def test_46370s_seams_are_found_as_problems(vllm_46370: type) -> None:
    problems = engine_core_problems()
    assert carries_upstream_scale_down()
    assert any("_reinit_dp_group" in problem for problem in problems)
    assert any("scale_down" in problem and "its own" in problem for problem in problems)
    with pytest.raises(VllmSeamMoved):  # what vLLM's plugin loader would only have logged
        for patch in ENGINE_CORE_PATCHES:
            patch.target()


def test_an_ascend_worker_on_a_vllm_with_46370_refuses_to_start(
    npu_state: FakeNpuState, tiny_checkpoints: TinyCheckpoints, vllm_46370: type
) -> None:
    path: Path = tiny_checkpoints.path(layers=1, experts=8, hidden=MC2_HIDDEN)
    with pytest.raises(VllmSeamMoved) as caught:
        start_worker(path, dp_rank=1, redundant=4)
    message = str(caught.value)
    assert "vLLM PR #46370" in message and "query_mask" in message
    assert "docs/ascend.md" in message and "VLLM_PLUGINS" in message
    assert "npu.set_device" not in npu_state.names()  # stopped before the NPU is touched
    assert "TASK_QUEUE_ENABLE" not in os.environ
