"""NPU scale-down preconditions: every failure listed at once, at start-up."""

from __future__ import annotations

import pytest

from ftengine.backends.npu_config import NpuFtConfig
from ftengine.backends.npu_preconditions import NpuDeployment, check_scale_down
from ftengine.errors import PreconditionFailed
from ftengine.weights.index import CheckpointIndex
from tests.fakes.npu_host import make_npu_rig
from tests.fakes.npu_state import FakeNpuState
from tests.unit.npu_fixtures import TinyCheckpoints
from tests.unit.npu_fixtures import npu_state as npu_state
from tests.unit.npu_fixtures import tiny_checkpoints as tiny_checkpoints

EVERYTHING_WRONG = NpuDeployment(
    model_runner="v1",
    eplb_enabled=False,
    num_redundant_experts=0,
    fused_mc2=True,
    hierarchical_comm=True,
    tp_size=2,
    has_dispatch_v2=False,
    device_type="A2",
)
REASON_KEYS = (
    "v2 model runner",
    "EPLB",
    "num_redundant_experts > 0",
    "fused MC2",
    "hierarchical",
    "tp_world_size == 1",
    "npu_moe_distribute_dispatch_v2",
    "Atlas A3",
)


@pytest.fixture(scope="module")
def index(tiny_checkpoints: TinyCheckpoints) -> CheckpointIndex:
    return tiny_checkpoints.index(layers=1, experts=4)


def test_a_good_deployment_passes() -> None:
    check_scale_down(NpuDeployment())


def test_every_failure_is_listed_at_once() -> None:
    with pytest.raises(PreconditionFailed) as caught:
        check_scale_down(EVERYTHING_WRONG)
    reasons = caught.value.reasons
    assert len(reasons) == len(REASON_KEYS)
    for key, reason in zip(REASON_KEYS, reasons, strict=True):
        assert key in reason
    assert "8 problems" in str(caught.value)


@pytest.mark.parametrize("field", ["fused_mc2", "hierarchical_comm"])
def test_a_single_failure_is_named(field: str) -> None:
    deployment = NpuDeployment(**{field: True})  # type: ignore[arg-type]
    with pytest.raises(PreconditionFailed, match="1 problem") as caught:
        check_scale_down(deployment)
    assert len(caught.value.reasons) == 1


def test_backend_start_up_checks_what_it_can_see_itself(
    npu_state: FakeNpuState, index: CheckpointIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch_npu

    monkeypatch.delattr(torch_npu, "npu_moe_distribute_dispatch_v2")
    # The host claims a good deployment; torch_npu, TP and the placement say otherwise.
    with pytest.raises(PreconditionFailed) as caught:
        make_npu_rig(index, dp_size=2, tp_size=2, num_redundant=0, deployment=NpuDeployment())
    reasons = caught.value.reasons
    assert len(reasons) == 3
    assert "num_redundant_experts > 0, found 0" in reasons[0]
    assert "tp 2" in reasons[1]
    assert "dispatch_v2" in reasons[2]


def test_with_scale_down_off_start_up_passes_and_scale_down_is_refused(
    npu_state: FakeNpuState, index: CheckpointIndex
) -> None:
    rig = make_npu_rig(
        index,
        dp_size=2,
        num_redundant=0,
        config=NpuFtConfig(scale_down=False),
        deployment=NpuDeployment(model_runner="v1"),
    )
    with pytest.raises(PreconditionFailed) as caught:
        rig.backend.mask_ranks(frozenset({1}))
    assert caught.value.reasons[0].startswith("scale-down is disabled")
    assert len(caught.value.reasons) == 3  # disabled + v1 runner + no redundancy
    with pytest.raises(PreconditionFailed):
        rig.backend.repair_experts(frozenset({1}))
    rig.backend.reset_device()  # retry still works
