"""NPU scale-down preconditions: every failure listed at once, at start-up."""

from __future__ import annotations

import pytest
import torch

from ftengine.backends.npu import NpuBackend
from ftengine.backends.npu_config import NpuFtConfig
from ftengine.backends.npu_host import NpuTopology
from ftengine.backends.npu_preconditions import NpuDeployment, check_scale_down
from ftengine.backends.npu_runtime import NpuRuntime
from ftengine.errors import PreconditionFailed
from ftengine.weights.index import CheckpointIndex
from tests.fakes.npu_host import FakeNpuHost, RecordingGroupFactory, make_npu_rig
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
    has_dispatch_v2=False,
    elastic_info_kernels=False,
    device_type="A2",
)
REASON_KEYS = (
    "v2 model runner",
    "EPLB",
    "num_redundant_experts > 0",
    "fused MC2",
    "hierarchical",
    "npu_moe_distribute_dispatch_v2",
    "aclnnMoeDistributeDispatchV3",
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
    npu_state.aclnn.clear()  # a CANN without the aclnn V3 MC2 kernels
    # The host claims a good deployment; torch_npu, CANN and the placement say otherwise.
    with pytest.raises(PreconditionFailed) as caught:
        make_npu_rig(index, dp_size=2, num_redundant=0, deployment=NpuDeployment())
    reasons = caught.value.reasons
    assert len(reasons) == 3
    assert "num_redundant_experts > 0, found 0" in reasons[0]
    assert "dispatch_v2" in reasons[1]
    assert "aclnnMoeDistributeDispatchV3" in reasons[2]


def test_tp_2_passes_start_up_each_dp_rank_owning_two_ep_ranks(
    npu_state: FakeNpuState, index: CheckpointIndex
) -> None:
    rig = make_npu_rig(index, dp_size=2, tp_size=2, num_redundant=4)
    assert rig.backend.topology.ep_size == 4
    assert rig.backend.elastic.world == 4


def backend_with_unknown_aclnn(index: CheckpointIndex, declared: bool | None) -> NpuBackend:
    """A backend whose aclnn probe cannot tell (no CANN library to ask), the host declaring
    ``declared``."""
    return NpuBackend(
        FakeNpuHost(index, ep_size=2, ep_rank=0, num_redundant=4),
        NpuTopology(dp_rank=0, dp_size=2, device_index=0),
        deployment=NpuDeployment(elastic_info_kernels=declared),
        runtime=NpuRuntime.load(aclnn_probe=lambda symbol: None),
        group_factory=RecordingGroupFactory(),
        environ={},
        device=torch.device("cpu"),
    )


def test_an_aclnn_probe_that_cannot_tell_keeps_the_hosts_word(
    npu_state: FakeNpuState, index: CheckpointIndex, caplog: pytest.LogCaptureFixture
) -> None:
    assert backend_with_unknown_aclnn(index, True).deployment.elastic_info_kernels is True
    with pytest.raises(PreconditionFailed, match="aclnnMoeDistributeDispatchV3"):
        backend_with_unknown_aclnn(index, False)
    with caplog.at_level("WARNING"):
        backend_with_unknown_aclnn(index, None)
    assert "could not tell whether CANN has the aclnn V4 / V3 MC2 kernels" in caplog.text


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
