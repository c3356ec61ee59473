"""The cluster's command-adapter seam: resolving ``"module:function"``, its errors, the default,
and the vLLM adapter factory answering commands through vLLM's message types."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from ftengine.backends.fake import FakeBackend
from ftengine.clock import ManualClock
from ftengine.commands import CommandResult
from ftengine.errors import ConfigError
from ftengine.faults import FaultKind, HealthStatus
from ftengine.policies import OrchestratorDriven
from ftengine.sentinel import HostedBackend, RankSentinel
from ftengine.testbed.cluster import ClusterConfig
from ftengine.testbed.cluster.adapters import build_command_adapter, resolve_adapter_factory
from ftengine.testbed.cluster.config import TORCH_DEFAULT_TIMEOUT_S
from ftengine.testbed.cluster.worker import WorkerSpec

HERE = __name__
NOT_CALLABLE = 42


class Hooks:
    """A host worker with nothing to clean, no model and no expert layers."""

    def clean_state(self) -> None:
        pass

    def run_dummy_batch(self) -> None:
        pass

    def expert_layers(self) -> tuple[object, ...]:
        return ()


class Recording:
    """An adapter that records its construction and answers every command itself."""

    def __init__(self, sentinel: RankSentinel, rank: int) -> None:
        self.sentinel = sentinel
        self.rank = rank

    def run_command(
        self, instruction: str, params: Mapping[str, object], request_id: str
    ) -> CommandResult:
        return CommandResult(request_id, False, f"rank {self.rank} saw {instruction}")


def recording(sentinel: RankSentinel, rank: int) -> Recording:
    return Recording(sentinel, rank)


def faceless(sentinel: RankSentinel, rank: int) -> object:
    return object()


def sentinel(rank: int = 1) -> RankSentinel:
    return RankSentinel(
        OrchestratorDriven(), HostedBackend(FakeBackend(rank=rank), Hooks()), rank=rank,
        world_size=4, clock=ManualClock(),
    )  # fmt: skip


def test_without_an_adapter_commands_go_to_the_sentinel() -> None:
    inner = sentinel()
    assert build_command_adapter(None, inner, 1) is inner


def test_the_named_factory_is_called_with_the_sentinel_and_the_rank() -> None:
    inner = sentinel(rank=2)
    adapter = build_command_adapter(f"{HERE}:recording", inner, 2)
    assert isinstance(adapter, Recording)
    assert (adapter.sentinel, adapter.rank) == (inner, 2)
    assert adapter.run_command("retry", {}, "r1") == CommandResult("r1", False, "rank 2 saw retry")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("ftengine.no_such_module:factory", "module 'ftengine.no_such_module' does not import"),
        (f"{HERE}:missing", "has no attribute 'missing'"),
        (f"{HERE}:NOT_CALLABLE", "'NOT_CALLABLE' is a int, not callable"),
        (f"{HERE}:", "malformed"),
    ],
)
def test_resolution_errors_name_the_spec_and_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        resolve_adapter_factory(spec)
    assert repr(spec) in str(caught.value)
    assert "package.module:function" in str(caught.value)


def test_an_import_failure_keeps_its_cause() -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_adapter_factory("ftengine.no_such_module:factory")
    assert isinstance(caught.value.__cause__, ImportError)


def test_an_adapter_without_run_command_is_refused() -> None:
    with pytest.raises(ConfigError, match="without a run_command"):
        build_command_adapter(f"{HERE}:faceless", sentinel(), 1)


@pytest.mark.parametrize("spec", ["no_colon", ":factory", "a:b:c", "module: "])
def test_config_refuses_a_malformed_name(spec: str) -> None:
    with pytest.raises(ConfigError, match=r"package\.module:function"):
        ClusterConfig("/tmp/ckpt", command_adapter=spec)


def test_worker_specs_carry_the_adapter_and_the_fault_tolerance_mode() -> None:
    on = ClusterConfig("/tmp/ckpt", op_timeout_s=2.0, command_adapter=f"{HERE}:recording")
    spec = WorkerSpec.from_config(on, 3, store_port=1234, num_redundant=8, inject_fault=None)
    assert (spec.rank, spec.world_size, spec.store_port) == (3, 4, 1234)
    assert (spec.config.command_adapter, spec.config.fault_tolerance) == (f"{HERE}:recording", True)
    assert spec.config.worker_op_timeout_s == 2.0
    off = ClusterConfig("/tmp/ckpt", op_timeout_s=2.0, fault_tolerance=False)
    spec = WorkerSpec.from_config(off, 0, store_port=1234, num_redundant=8, inject_fault=None)
    # Without ftengine a gloo op waits torch's default 30 minutes for a peer.
    assert spec.config.fault_tolerance is False
    timeouts = (spec.config.worker_op_timeout_s, spec.config.rendezvous_timeout_s)
    assert timeouts == (TORCH_DEFAULT_TIMEOUT_S, TORCH_DEFAULT_TIMEOUT_S) == (1800.0, 1800.0)


def test_the_vllm_factory_runs_commands_through_vllms_message_types() -> None:
    pytest.importorskip("vllm.v1.fault_tolerance.utils", reason="vllm is not installed")
    spec = "ftengine.testbed.vllm.cluster_adapter:vllm_command_adapter"
    inner = sentinel(rank=1)
    adapter = build_command_adapter(spec, inner, 1)

    early = adapter.run_command("retry", {}, "too-early")
    assert early == CommandResult(
        "too-early", False, "[FT] Rejecting retry on engine 1: status is HEALTHY"
    )
    inner.peer_fault(FaultKind.DEAD_PEER, 3, "rank 3 exited")
    done = adapter.run_command("scale_down", {"removed_dp_ranks": [3]}, "down")
    assert done == CommandResult("down", True, None)
    assert inner.health is HealthStatus.HEALTHY
    assert inner.engine.removed_ranks == frozenset({3})
    last_request, last_result = adapter.last_request, adapter.last_result  # type: ignore[attr-defined]
    assert type(last_request).__name__ == "FaultToleranceRequest"
    assert (last_request.instruction, last_request.params) == (
        "scale_down",
        {"removed_dp_ranks": [3]},
    )
    assert type(last_result).__name__ == "FaultToleranceResult"


def test_launch_refuses_a_bad_adapter_before_spawning_anything() -> None:
    from ftengine.testbed.cluster import Cluster

    config = ClusterConfig("/nonexistent/ckpt", command_adapter=f"{HERE}:NOT_CALLABLE")
    # The checkpoint is never opened: the adapter is resolved first, in this process.
    with pytest.raises(ConfigError, match="not callable"):
        Cluster.launch(config)
