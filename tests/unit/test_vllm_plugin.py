"""The vLLM general plugin, loaded by vLLM's own plugin loader and driven by vLLM's real
engine-core sentinel (``EngineCoreSentinel``) through the real ``Worker.handle_ft_command``.

The workers and the engine core's engine/executor are stand-ins (see
``test_vllm_standin`` for why a real ``Worker`` cannot be built here); the executor's
``collective_rpc`` calls each worker in-process instead of over vLLM's shared-memory queue.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest

from ftengine.backends.fake import FakeBackend
from ftengine.clock import ManualClock
from ftengine.collective_errors import classify_exception
from ftengine.errors import CollectiveTimeout, PeerDead
from ftengine.faults import FaultKind, HealthStatus
from ftengine.integrations.vllm import plugin
from ftengine.integrations.vllm.config import VllmConfigError, VllmFtSettings
from ftengine.integrations.vllm.messages import VllmMessages
from ftengine.integrations.vllm.patches.install import PATCHES
from ftengine.integrations.vllm.patches.mechanism import VllmSeamMoved
from ftengine.integrations.vllm.worker import adapter as adapter_module
from ftengine.integrations.vllm.worker.adapter import WorkerFaultAdapter
from ftengine.integrations.vllm.worker.factory import (
    DeviceBackend,
    UnsupportedPlatform,
    backend_for_platform,
    vllm_cpu_backend,
)
from ftengine.integrations.vllm.worker.hooks import VllmWorkerHooks
from ftengine.integrations.vllm.worker.step_wrappers import hidden_peer_error
from tests.unit.test_vllm_standin import Distributed, Worker, make_worker

gpu_worker = pytest.importorskip("vllm.v1.worker.gpu_worker", reason="vllm is not installed")
sentinel_module = pytest.importorskip("vllm.v1.worker.sentinel.gpu_worker_sentinel")
core_sentinel = pytest.importorskip("vllm.v1.fault_tolerance.engine_core_sentinel")
vllm_plugins = pytest.importorskip("vllm.plugins")
vllm_config = pytest.importorskip("vllm.config")
Request = pytest.importorskip("vllm.v1.fault_tolerance.utils").FaultToleranceRequest
EngineStatusType = pytest.importorskip("vllm.v1.engine").EngineStatusType


@pytest.fixture
def restored(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Whatever the plugin patches in vLLM is put back after the test."""
    for module in (sentinel_module, gpu_worker):
        monkeypatch.setattr(module, plugin.SENTINEL_NAME, getattr(module, plugin.SENTINEL_NAME))
    for patch in PATCHES:
        owner, _ = patch.target()
        monkeypatch.setattr(owner, patch.name, getattr(owner, patch.name))
    monkeypatch.setattr(vllm_plugins, "plugins_loaded", False)
    yield


def fake_device(worker: Any, hooks: VllmWorkerHooks, settings: VllmFtSettings) -> DeviceBackend:
    return DeviceBackend(FakeBackend(rank=worker.parallel_config.data_parallel_rank))


def plugged(worker: Worker) -> WorkerFaultAdapter:
    """What vLLM's Worker.__init__ does with the plugin installed, plus test seams."""
    adapter = WorkerFaultAdapter(
        worker,
        backend_factory=fake_device,
        dist=Distributed(),
        messages=VllmMessages.load(),
        clock=ManualClock(),
    )
    worker.worker_sentinel = adapter
    return adapter


def test_vllms_plugin_loader_installs_the_sentinel(
    restored: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_PLUGINS", "ftengine")
    upstream = sentinel_module.WorkerSentinel
    assert upstream is not plugin.worker_fault_adapter
    vllm_plugins.load_general_plugins()
    assert sentinel_module.WorkerSentinel is plugin.worker_fault_adapter
    assert gpu_worker.WorkerSentinel is plugin.worker_fault_adapter  # bound at its import
    plugin.register()  # vLLM may load plugins again in another code path
    assert gpu_worker.WorkerSentinel is plugin.worker_fault_adapter
    assert plugin._upstream[plugin.SENTINEL_NAME] is upstream


def test_other_platforms_keep_vllms_own_sentinel_with_one_warning(
    restored: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    plugin.register()
    built: list[object] = []
    monkeypatch.setitem(plugin._upstream, plugin.SENTINEL_NAME, lambda worker: built.append(worker))
    monkeypatch.setattr(plugin, "current_device_type", lambda: "cuda")
    monkeypatch.setattr(plugin, "_warned", [])
    workers = [make_worker(), make_worker(dp_rank=1)]
    with caplog.at_level("WARNING", logger=plugin.__name__):
        for worker in workers:
            gpu_worker.WorkerSentinel(worker=worker)
    assert built == workers  # vLLM's own sentinel, untouched
    warnings = [r for r in caplog.records if "does not support vLLM platform 'cuda'" in r.message]
    assert len(warnings) == 1


def test_the_cpu_platform_gets_ftengines_sentinel_and_cpu_backend(
    restored: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    plugin.register()
    monkeypatch.setattr(plugin, "current_device_type", lambda: "cpu")
    monkeypatch.setattr(adapter_module, "current_device_type", lambda: "cpu")
    adapter = gpu_worker.WorkerSentinel(worker=make_worker())
    assert isinstance(adapter, WorkerFaultAdapter)
    assert backend_for_platform("cpu") is vllm_cpu_backend
    with pytest.raises(UnsupportedPlatform, match=r"no backend for vLLM platform 'cuda'"):
        backend_for_platform("cuda")


def test_bad_flags_stop_start_up_naming_the_key() -> None:
    worker = make_worker(additional={"ftengine": {"policy": "sometimes"}})
    with pytest.raises(VllmConfigError, match=r"--additional-config: ftengine\.policy"):
        plugged(worker)


def test_model_load_builds_the_engine_and_a_failed_step_reports_the_fault() -> None:
    worker = make_worker()
    adapter = plugged(worker)
    assert adapter.ft is None
    worker.load_model()
    assert worker.loaded and adapter.ft is not None
    worker.step_error = RuntimeError("Connection closed by peer")
    with pytest.raises(RuntimeError, match="Connection closed"):
        worker.execute_model("batch")
    assert adapter.ft.sentinel.health is HealthStatus.UNHEALTHY


def test_an_idle_ranks_dummy_batch_reports_a_peers_error_as_a_peer_fault() -> None:
    # vLLM's engine core runs execute_dummy_batch on an idle DP rank to meet its busy peers
    # in the step's collectives: a peer that raised is seen there first.
    worker = make_worker()
    adapter = plugged(worker)
    worker.load_model()
    assert adapter.ft is not None
    gloo = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:7044.")
    worker.dummy_error = _wrapped(ValueError("not initialized in the world group map"), gloo)
    with pytest.raises(PeerDead, match="Connection closed by peer"):
        worker.execute_dummy_batch()
    assert adapter.ft.sentinel.health is HealthStatus.UNHEALTHY
    assert "PeerDead" in str(adapter.ft.sentinel.status().fault_info)


def test_the_recoverys_own_dummy_batch_runs_unwrapped() -> None:
    # Inside a recovery the dummy batch's failure is the recovery step's: not a new fault.
    worker = make_worker()
    adapter = plugged(worker)
    worker.load_model()
    assert adapter.ft is not None
    hooks = VllmWorkerHooks(cast(Any, worker), Distributed())
    worker.dummy_error = RuntimeError("dummy batch failed")
    with pytest.raises(RuntimeError, match="dummy batch failed"):
        hooks.run_dummy_batch()
    assert worker.dummy_batches == 1
    assert adapter.ft.sentinel.health is HealthStatus.HEALTHY


def _wrapped(outer: Exception, inner: Exception) -> Exception:
    """``outer`` raised while handling ``inner`` (torch's logging wrapper of a collective)."""
    try:
        try:
            raise inner
        except Exception:
            raise outer  # noqa: B904 - the implicit context, as torch's wrapper leaves it
    except Exception as exc:
        return exc


def test_a_peers_error_under_torchs_valueerror_is_raised_as_a_peer_fault() -> None:
    worker = make_worker()
    adapter = plugged(worker)
    worker.load_model()
    assert adapter.ft is not None
    gloo = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:7044.\ntrace")
    worker.step_error = _wrapped(ValueError("not initialized in the world group map"), gloo)
    with pytest.raises(PeerDead, match=r"^\[pair\.cc:553\] Connection closed by peer") as raised:
        worker.execute_model("batch")
    assert raised.value.__cause__ is worker.step_error  # the cause kept
    assert classify_exception(raised.value) is FaultKind.DEAD_PEER
    assert adapter.ft.sentinel.health is HealthStatus.UNHEALTHY
    assert "PeerDead" in str(adapter.ft.sentinel.status().fault_info)


def test_an_error_that_says_what_it_is_is_raised_unchanged() -> None:
    assert hidden_peer_error(_wrapped(TimeoutError("timed out"), ValueError("x"))) is None
    assert hidden_peer_error(ValueError("bad shape")) is None  # nothing under it
    assert hidden_peer_error(_wrapped(ValueError("bad shape"), KeyError("r1"))) is None
    hung = hidden_peer_error(_wrapped(ValueError("x"), RuntimeError("Wait timed out after 5s")))
    assert isinstance(hung, CollectiveTimeout) and str(hung) == "Wait timed out after 5s"


class Executor:
    """The engine core's executor: collective_rpc runs the method on every worker."""

    def __init__(self, workers: list[Worker]) -> None:
        self.workers = workers
        self.is_failed = False

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        # vLLM's parameters (MultiprocExecutor.collective_rpc); a name runs the real Worker
        # method, so the stand-in is driven exactly as vLLM drives a worker; a function is
        # called with the worker first, as vLLM's run_method does
        kw = kwargs or {}
        if isinstance(method, str):
            return [getattr(gpu_worker.Worker, method)(w, *args, **kw) for w in self.workers]
        return [method(w, *args, **kw) for w in self.workers]


class Scheduler:
    def finish_requests(self, request_ids: object, status: object) -> list[str]:
        return []


class Engine:
    """What vLLM's EngineCoreSentinel reads of its EngineCoreProc."""

    def __init__(self, workers: list[Worker]) -> None:
        self.engine_index = workers[0].parallel_config.data_parallel_rank
        self.output_queue: queue.Queue[tuple[int, Any]] = queue.Queue()
        self.scheduler = Scheduler()
        self.model_executor = Executor(workers)
        self.batch_queue = None
        self.step_counter = 5

    def _send_abort_outputs(self, aborted: object) -> None:
        pass


def engine_core(workers: list[Worker]) -> tuple[Any, Engine]:
    parallel = vllm_config.ParallelConfig(
        enable_fault_tolerance=True,
        fault_tolerance_config=vllm_config.FaultToleranceConfig(engine_recovery_timeout_sec=30),
    )
    engine = Engine(workers)
    return core_sentinel.EngineCoreSentinel(engine, parallel), engine


def answer(engine: Engine) -> dict[str, Any]:
    """The FaultToleranceResult the engine core queued for the client."""
    while True:
        _, outputs = engine.output_queue.get_nowait()
        utility = outputs.utility_output
        if utility.call_id == 11:
            result: dict[str, Any] = utility.result.result
            return result


def test_vllms_engine_core_retry_reaches_every_worker() -> None:
    workers = [make_worker(dp_size=1, requests=("a",)) for _ in range(2)]
    for worker in workers:
        plugged(worker)
        worker.load_model()
    core, engine = engine_core(workers)
    core.on_fault(RuntimeError("DP all-reduce timed out"))  # only the engine core saw it
    assert core.status_type == EngineStatusType.UNHEALTHY
    core.handle_command(0, 11, {"instruction": "retry", "params": {}, "request_id": "r1"})
    assert answer(engine) == {"request_id": "r1", "success": True, "reason": None}
    assert core.status_type == EngineStatusType.HEALTHY
    for worker in workers:
        assert worker.dummy_batches == 1 and worker.model_runner.requests == {}  # type: ignore[union-attr]


def test_a_worker_failure_reaches_the_orchestrator_through_vllms_engine_core() -> None:
    workers = [make_worker(dp_size=4, dp_rank=2)]
    plugged(workers[0]).attach()
    core, engine = engine_core(workers)
    core.on_fault(RuntimeError("boom"))
    # vLLM 0.33.0's engine core publishes DP ports only with a DP group of its own
    core.handle_command(0, 11, {"instruction": "retry", "params": {}, "request_id": "r2"})
    result = answer(engine)
    assert result["success"] is False
    assert "new_stateless_dp_group_ports" in result["reason"]


def test_vllms_engine_core_has_no_scale_down_so_it_never_reaches_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM 0.33.0's EngineCoreSentinel has only ``retry``; scale_down needs an engine core
    that relays it (vLLM-Ascend's, or ftengine's ``scale_down`` patch: tests/unit/
    test_vllm_scale_down.py), which then reaches ``handle_ft_command`` as retry does."""
    monkeypatch.delattr(core_sentinel.EngineCoreSentinel, "scale_down", raising=False)
    workers = [make_worker()]
    plugged(workers[0]).attach()
    core, engine = engine_core(workers)
    core.on_fault(RuntimeError("boom"))
    params = {"removed_dp_ranks": [3]}
    core.handle_command(0, 11, {"instruction": "scale_down", "params": params, "request_id": "s"})
    result = answer(engine)
    assert result["success"] is False and "scale_down" in result["reason"]


def test_a_vllm_whose_seams_moved_keeps_running_without_ftengines_patches(
    restored: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def moved() -> None:
        raise VllmSeamMoved("expected vllm.x.Y.z in the installed vLLM, found none")

    monkeypatch.setattr(plugin, "apply_engine_core_patches", moved)
    monkeypatch.setattr(plugin, "current_device_type", lambda: "cpu")
    with caplog.at_level("ERROR", logger=plugin.__name__):
        plugin.register()  # no exception: vLLM starts as it would without ftengine
    assert any("patches are off" in r.message for r in caplog.records)
