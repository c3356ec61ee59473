"""The vLLM worker's fault adapter driven by vLLM's real message types and status enum.

The worker is the stand-in of ``test_vllm_standin`` (vLLM's names, checked there) and
the device is ftengine's recording ``FakeBackend``; ``test_vllm_npu`` runs the NPU one.
"""

from __future__ import annotations

import traceback
import weakref
from datetime import timedelta
from typing import Any

import msgspec
import pytest
import torch

from ftengine.backends.fake import FakeBackend
from ftengine.clock import ManualClock
from ftengine.faults import HealthStatus, Phase
from ftengine.integrations.vllm.config import VllmFtSettings
from ftengine.integrations.vllm.messages import DP_HOST_KEY, VllmMessages
from ftengine.integrations.vllm.worker.adapter import CommandFailed, WorkerFaultAdapter
from ftengine.integrations.vllm.worker.factory import DeviceBackend, WorkerFt
from ftengine.integrations.vllm.worker.hooks import DEAD_RANKS_ATTR, MASK_ATTR, VllmWorkerHooks
from tests.unit.test_vllm_standin import (
    Distributed,
    DpGroup,
    RunnerV1,
    RunnerV2,
    Worker,
    make_worker,
)

utils = pytest.importorskip("vllm.v1.fault_tolerance.utils", reason="vllm is not installed")
Request = utils.FaultToleranceRequest
Result = utils.FaultToleranceResult
PORTS = [41001, 41002]


class Rig:
    """One stand-in worker with its adapter, fake device, recorded process groups, clock."""

    def __init__(self, worker: Worker, *, mask: torch.Tensor | None = None) -> None:
        self.worker = worker
        self.device = FakeBackend(rank=worker.parallel_config.data_parallel_rank)
        self.dist = Distributed()
        self.clock = ManualClock()
        self.mask = mask
        self.adapter = WorkerFaultAdapter(
            worker,
            backend_factory=self._device,
            dist=self.dist,
            messages=VllmMessages.load(),
            clock=self.clock,
        )
        self.ft: WorkerFt = self.adapter.attach()

    def _device(
        self, worker: Any, hooks: VllmWorkerHooks, settings: VllmFtSettings
    ) -> DeviceBackend:
        return DeviceBackend(self.device, self.mask)

    def health(self) -> HealthStatus:
        return self.ft.sentinel.health

    def fault(self) -> None:
        self.ft.sentinel.report_fault(RuntimeError("Connection closed by peer"), step=7)

    def send(self, instruction: str, params: dict[str, Any], request_id: str) -> Any:
        # Through msgpack, as the request crosses processes in vLLM.
        wire = msgspec.msgpack.encode(Request(instruction, params, request_id))
        result = self.ft.commands.run(msgspec.msgpack.decode(wire, type=Request))
        assert isinstance(result, Result)
        return result


def rig(**kwargs: Any) -> Rig:
    return Rig(make_worker(**kwargs), mask=torch.zeros(12, dtype=torch.int32))


def test_retry_cleans_the_runner_rebuilds_the_dp_group_and_runs_a_dummy_batch() -> None:
    r = rig(dp_rank=1, configure=lambda p: setattr(p, "cpu_distributed_timeout_seconds", 30))
    r.fault()
    assert r.health() == HealthStatus.UNHEALTHY
    runner = r.worker.model_runner
    assert isinstance(runner, RunnerV1)
    assert runner.requests == {} and runner.num_prompt_logprobs == {}  # quarantine cleaned
    assert runner.execute_model_state is None and runner.kv_connector_output is None
    assert runner.input_batch.calls == ["remove:r1", "remove:r2", "condense", "refresh_metadata"]
    assert runner.input_batch.req_prompt_embeds == {}

    result = r.send("retry", {"new_stateless_dp_group_ports": PORTS}, "retry-1")

    assert (result.request_id, result.success, result.reason) == ("retry-1", True, None)
    assert r.health() is HealthStatus.HEALTHY
    # worker.rank 1 % world_size 1 = 0 -> the first port; DP rank 1 of 4 survivors.
    assert r.dist.inits == [("127.0.0.1", PORTS[0], 1, 4, timedelta(seconds=30))]
    assert r.dist.destroyed == ["group-0"] and r.dist.group.cpu_group == "group-1"
    assert r.dist.manager is not None and r.dist.manager.cleaned == 1
    assert r.worker.dummy_batches == 1
    assert r.device.names() == ["quarantine", "reset_device", "rebuild_groups"]


def test_scale_down_masks_the_all2all_manager_and_rebuilds_among_survivors() -> None:
    r = rig(dp_rank=2)
    r.fault()
    params: dict[str, Any] = {"removed_dp_ranks": [0], "new_stateless_dp_group_ports": PORTS}
    params[DP_HOST_KEY] = "10.0.0.2"  # the lowest survivor's host, which hosts the group
    result = r.send("scale_down", params, "sd-1")
    assert result.success, result.reason
    assert r.device.masked == frozenset({0}) and r.device.repaired == frozenset({0})
    manager = r.dist.manager
    assert getattr(manager, DEAD_RANKS_ATTR) == frozenset({0})
    assert getattr(manager, MASK_ATTR) is r.mask  # the device's mask, shared not copied
    # survivors 1, 2, 3: original DP rank 2 is dense rank 1 of 3, at rank 1's host
    assert [(h, rank, size) for h, _, rank, size, _ in r.dist.inits] == [("10.0.0.2", 1, 3)]
    assert r.ft.commands.status()["removed_ranks"] == [0]
    assert r.ft.commands.status()["status_name"] == "healthy"


def test_commands_are_rejected_unless_unhealthy_with_vllms_reason() -> None:
    r = rig(dp_rank=3)
    healthy = r.send("retry", {}, "early")
    assert not healthy.success
    assert healthy.reason == "[FT] Rejecting retry on engine 3: status is HEALTHY"
    assert r.device.names() == []  # nothing ran

    r.fault()
    r.clock.advance(121.0)  # past engine_recovery_timeout_sec with no command
    r.ft.sentinel.poll()
    assert r.health() is HealthStatus.DEAD
    dead = r.send("retry", {"new_stateless_dp_group_ports": PORTS}, "late")
    assert not dead.success
    assert dead.reason == "[FT] Rejecting retry on engine 3: status is DEAD"
    assert r.dist.inits == []


def test_invalid_commands_get_ftengines_reason_and_change_nothing() -> None:
    r = rig()
    r.fault()
    unknown = r.send("reboot", {}, "u1")
    assert not unknown.success and "unknown instruction 'reboot'" in str(unknown.reason)
    own = r.send("scale_down", {"removed_dp_ranks": [0]}, "u2")
    assert not own.success and "own rank 0" in str(own.reason)
    assert r.health() is HealthStatus.UNHEALTHY
    assert r.device.names() == ["quarantine"]


def test_a_replayed_request_id_returns_the_first_result() -> None:
    r = rig()
    r.fault()
    first = r.send("retry", {"new_stateless_dp_group_ports": PORTS}, "same")
    r.fault()
    again = r.send("retry", {"new_stateless_dp_group_ports": PORTS}, "same")
    assert first.success and again.success
    assert len(r.dist.inits) == 1  # the replay did not act again


def test_retry_without_vllms_ports_fails_and_says_why() -> None:
    r = rig()
    r.fault()
    result = r.send("retry", {}, "no-ports")
    assert not result.success
    assert "new_stateless_dp_group_ports" in str(result.reason)
    assert r.health() is not HealthStatus.HEALTHY


def test_single_dp_rank_needs_no_dp_group() -> None:
    r = rig(dp_size=1, redundant=8)
    r.fault()
    assert r.send("retry", {}, "solo").success
    assert r.dist.inits == []


def test_v2_runner_requests_are_removed_through_the_runner() -> None:
    r = rig(v2=True, requests=("a", "b", "c"))
    r.fault()
    runner = r.worker.model_runner
    assert isinstance(runner, RunnerV2)
    assert runner.removed == ["a", "b", "c"] and runner.req_states.req_id_to_index == {}
    assert runner.execute_model_state is None


def test_handle_command_adopts_the_engine_cores_fault_and_raises_on_failure() -> None:
    r = rig(dp_rank=1)
    assert r.health() is HealthStatus.HEALTHY  # no model step failed here
    request = Request("retry", {"new_stateless_dp_group_ports": PORTS}, "core-1")
    result = r.adapter.handle_command(request)
    assert result.success and r.ft.commands.status()["phase"] == Phase.HEALTHY.value
    assert r.device.names()[0] == "quarantine"
    with pytest.raises(CommandFailed) as failed:
        r.adapter.handle_command(Request("scale_down", {"removed_dp_ranks": [1]}, "core-2"))
    assert isinstance(failed.value.result, Result) and not failed.value.result.success
    assert "own rank 1" in str(failed.value)


def test_a_failed_steps_frames_let_go_of_their_locals_before_the_quarantine() -> None:
    r = rig(dp_rank=1)
    held = torch.zeros(1)  # stands for the process group a collective's frame holds
    ref = weakref.ref(held)

    def step(group: torch.Tensor) -> None:
        raise RuntimeError(f"gloo failed in a group of {group.numel()}")

    try:
        step(held)
    except RuntimeError as exc:
        del held
        assert ref() is not None  # the traceback's frame holds it
        r.adapter.report_exception(exc)
        assert ref() is None
        assert "step(held)" in "".join(traceback.format_exception(exc))  # lines are kept
    assert r.health() is HealthStatus.UNHEALTHY


def _closing_hooks(dp_size: int = 4) -> tuple[VllmWorkerHooks, Distributed]:
    dist = Distributed(group=DpGroup("group-0", device_group="device-0"))
    hooks = VllmWorkerHooks(make_worker(dp_rank=1, dp_size=dp_size), dist)
    hooks.gloo_device_group = True
    return hooks, dist


def test_the_dp_group_closes_once_and_the_rebuild_replaces_the_stand_in() -> None:
    hooks, dist = _closing_hooks()
    hooks.close_dp_group()
    hooks.close_dp_group()  # a second fault before the rebuild: nothing left to close
    assert dist.closed == ["group-0", "device-0"]
    assert (dist.group.cpu_group, dist.group.device_group) == ("closed-group-0",) * 2

    hooks.publish_dp_ports(PORTS)
    hooks.rebuild_dp_group(frozenset({0, 1, 2, 3}), epoch=1)
    assert dist.destroyed == []  # the stand-in has nothing to tear down
    assert (dist.group.cpu_group, dist.group.device_group) == ("group-1",) * 2

    hooks.close_dp_group()  # the next fault closes the rebuilt group
    assert dist.closed[2:] == ["group-1"]


def test_nothing_is_closed_without_peers_or_where_the_device_side_is_not_gloo() -> None:
    alone, dist = _closing_hooks(dp_size=1)
    alone.close_dp_group()
    gpu, gpu_dist = _closing_hooks()
    gpu.gloo_device_group = False  # NCCL / HCCL: a closed gloo group releases nobody there
    gpu.close_dp_group()
    assert dist.closed == gpu_dist.closed == []
    assert gpu_dist.group.cpu_group == "group-0"
