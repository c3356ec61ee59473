"""ftengine on the revisions of vLLM-Ascend's FT branches that differ: the three
``fault_barrier_wrapper`` revisions, the MegaMoE manager whose ``clean_buffers()`` clears the
mask, MC2's V3 dispatch path, and an MTP drafter with an EPLB state of its own."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

from ftengine.errors import PreconditionFailed
from ftengine.faults import HealthStatus
from ftengine.integrations.vllm_ascend.names import MC2_V3_ENV
from ftengine.placement.elastic import elastic_info_values
from tests.fakes.npu_state import DISPATCH, FakeDeviceError, FakeNpuState
from tests.fakes.vllm_ascend_rig import SchedulerOutput, start_worker
from tests.unit.npu_fixtures import TinyCheckpoints
from tests.unit.npu_fixtures import npu_state as npu_state
from tests.unit.npu_fixtures import tiny_checkpoints as tiny_checkpoints
from tests.unit.test_vllm_npu import (
    DP,
    EMPTY,
    checkpoint_for,
    command,
    health,
    survivors,
)
from tests.unit.test_vllm_npu import isolated as isolated

SENTINEL_MODULE = "vllm_ascend.worker.sentinel.npu_worker_sentinel"


@pytest.mark.parametrize("revision", ["swallow", "reraise", "module_global"])
def test_each_fault_barrier_revision_gives_one_report_one_reset_and_a_retry(
    npu_state: FakeNpuState,
    tiny_checkpoints: TinyCheckpoints,
    monkeypatch: pytest.MonkeyPatch,
    revision: str,
) -> None:
    barrier: Any = importlib.import_module(SENTINEL_MODULE)
    monkeypatch.setattr(barrier, "BARRIER_REVISION", revision)
    rig = start_worker(checkpoint_for(tiny_checkpoints, "none"), dp_rank=2, redundant=4)
    assert barrier._sentinel is None  # vLLM-Ascend's own sentinel was never built
    npu_state.clear_calls()
    npu_state.poison()
    npu_state.fail(DISPATCH, FakeDeviceError("EZ9999: device error, stream poisoned"))
    if revision == "swallow":  # vLLM-Ascend's barrier swallows the fault after the reset
        assert rig.worker.execute_model(SchedulerOutput(["r1"])) is EMPTY
    else:  # re-raised, or (module_global: ftengine in place) never caught by vLLM-Ascend's
        with pytest.raises(FakeDeviceError):
            rig.worker.execute_model(SchedulerOutput(["r1"]))
    assert npu_state.names().count("npu.stop_device") == 1  # one reset, inside the step
    assert rig.sentinel.worker_faulted
    assert health(rig) is HealthStatus.UNHEALTHY  # reported once, whoever caught it
    calls = len(npu_state.calls)
    assert rig.worker.execute_model(SchedulerOutput(["r2"])) is EMPTY  # fenced
    assert len(npu_state.calls) == calls
    result = command(rig, "retry", {}, "retry-1")
    assert result.success, result.reason
    assert health(rig) is HealthStatus.HEALTHY
    rig.worker.execute_model(SchedulerOutput(["r3"]))
    assert rig.worker.sample_tokens(None).get_output().req_ids == ["r3"]


def test_a_mask_cleared_by_megamoes_clean_buffers_is_applied_again(
    npu_state: FakeNpuState, tiny_checkpoints: TinyCheckpoints
) -> None:
    expected = elastic_info_values(DP, [1], 3)  # DP 4, 8 experts + 4 redundant: 3 slots
    for rig in survivors(checkpoint_for(tiny_checkpoints, "none"), tp=1, redundant=4, dead_dp=1):
        rig.manager.mega_moe_bound = True  # clean_buffers() now clears the mask
        npu_state.clear_calls()
        result = command(rig, "scale_down", {"removed_dp_ranks": [1]}, "sd")
        assert result.success, result.reason
        assert rig.manager.get_elastic_info().tolist() == expected
        assert rig.manager.query_active_mask().tolist() == [0, 1, 0, 0]
        rig.worker.execute_model(SchedulerOutput(["r1"]))  # MC2 with rank 1 masked
        info = npu_state.of(DISPATCH)[-1].kwargs["elastic_info"]
        assert isinstance(info, torch.Tensor) and info.tolist() == expected


def test_mc2_v3_dispatch_refuses_scale_down_naming_the_variable(
    npu_state: FakeNpuState, tiny_checkpoints: TinyCheckpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(MC2_V3_ENV, "1")
    with pytest.raises(PreconditionFailed, match=f"{MC2_V3_ENV}.*set_v3_elastic_info_from_ep"):
        start_worker(checkpoint_for(tiny_checkpoints, "none"), redundant=4)
    start_worker(  # retry only is fine
        checkpoint_for(tiny_checkpoints, "none"),
        redundant=4,
        additional={"ftengine": {"scale_down": False}},
    )


def test_an_mtp_drafter_refuses_scale_down_naming_why(
    npu_state: FakeNpuState, tiny_checkpoints: TinyCheckpoints
) -> None:
    with pytest.raises(PreconditionFailed, match="'mtp_drafter' would keep routing to dead"):
        start_worker(
            checkpoint_for(tiny_checkpoints, "none"), redundant=4, speculative_method="mtp"
        )
    rig = start_worker(checkpoint_for(tiny_checkpoints, "none"), redundant=4)
    assert rig.sentinel.npu is not None
    assert rig.sentinel.npu.deployment.unmanaged_eplb_models == ()
