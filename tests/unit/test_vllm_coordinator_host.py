"""A DEAD rank 0 in external LB keeps its API server (and the DP coordinator in it) up:
vLLM's own ``fault_tolerant_wrapper`` and ``ParallelConfig``, a stand-in engine only."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from vllm.config import ParallelConfig
from vllm.v1.engine import EngineStatusType
from vllm.v1.fault_tolerance.engine_core_sentinel import fault_tolerant_wrapper

from ftengine.integrations.vllm.engine_core.coordinator_host import (
    hosts_coordinator,
    park_if_coordinator_host,
)
from ftengine.integrations.vllm.engine_core.parking import ParkableEvent, install, seam_present

DEADLINE_S = 0.2


def config(dp: int, rank: int, external_lb: bool) -> ParallelConfig:
    return ParallelConfig(
        data_parallel_size=dp, data_parallel_rank=rank, data_parallel_external_lb=external_lb
    )


class Sentinel:
    """The attributes of vLLM's ``EngineCoreSentinel`` that the wrapper and ftengine read."""

    def __init__(self, parallel_config: ParallelConfig, status: EngineStatusType) -> None:
        self.engine_index = parallel_config.data_parallel_rank
        self.parallel_config = parallel_config
        self.engine_recovery_timeout_sec: float | None = DEADLINE_S
        self.resumed = threading.Event()  # vLLM's; ftengine's patched __init__ replaces it
        self.resumed.set()
        install(self)
        self.fault_status = status
        self.status_type = EngineStatusType.HEALTHY

    def on_fault(self, exc: Exception) -> None:
        self.resumed.clear()
        self.status_type = self.fault_status
        park_if_coordinator_host(self)


class Engine:
    """A busy loop that faults once, then stops the wrapper with ``SystemExit``."""

    enable_fault_tolerance = True

    def __init__(self, sentinel: Sentinel) -> None:
        self.ft_sentinel = sentinel
        self.loops = 0

    def busy_loop(self) -> None:
        self.loops += 1
        if self.loops == 1:
            raise RuntimeError("worker process died")
        raise SystemExit


def run_wrapped(sentinel: Sentinel, resume_after_s: float) -> tuple[Engine, BaseException]:
    engine = Engine(sentinel)
    threading.Timer(resume_after_s, sentinel.resumed.set).start()
    with pytest.raises((RuntimeError, SystemExit)) as raised:
        fault_tolerant_wrapper(Engine.busy_loop)(engine)
    return engine, raised.value


def test_the_installed_wrapper_reads_the_deadline_at_each_wait() -> None:
    assert seam_present(), "vLLM's fault_tolerant_wrapper moved: see parking.py"


@pytest.mark.parametrize(
    ("dp", "rank", "external_lb", "expected"),
    [(2, 0, True, True), (4, 0, True, True), (2, 1, True, False), (2, 0, False, False)],
)
def test_only_rank_0_of_an_external_lb_deployment_hosts_the_coordinator(
    dp: int, rank: int, external_lb: bool, expected: bool
) -> None:
    assert hosts_coordinator(config(dp, rank, external_lb)) is expected


def test_a_dead_coordinator_host_waits_past_vllms_deadline() -> None:
    """Resumed only after 3x the deadline: the wrapper is still waiting and goes on."""
    sentinel = Sentinel(config(3, 0, True), EngineStatusType.DEAD)
    started = time.monotonic()
    engine, raised = run_wrapped(sentinel, resume_after_s=3 * DEADLINE_S)
    assert isinstance(raised, SystemExit), raised  # the second loop ran: no give-up
    assert engine.loops == 2
    assert time.monotonic() - started >= 3 * DEADLINE_S
    assert isinstance(sentinel.resumed, ParkableEvent) and not sentinel.resumed.parked  # resumed


@pytest.mark.parametrize(
    ("parallel_config", "status"),
    [
        (config(3, 0, True), EngineStatusType.UNHEALTHY),  # transient: vLLM's deadline
        (config(3, 1, True), EngineStatusType.DEAD),  # hosts nothing
        (config(3, 0, False), EngineStatusType.DEAD),  # internal LB
    ],
)
def test_every_other_engine_gives_up_at_vllms_deadline(
    parallel_config: ParallelConfig, status: Any
) -> None:
    sentinel = Sentinel(parallel_config, status)
    engine, raised = run_wrapped(sentinel, resume_after_s=3 * DEADLINE_S)
    assert isinstance(raised, RuntimeError), raised
    assert engine.loops == 1
    assert not sentinel.resumed.parked  # type: ignore[attr-defined]


def test_the_patched_sentinel_gets_a_parkable_resumed_in_the_state_vllms_was_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's ``EngineCoreSentinel.__init__`` makes ``resumed`` (set); ftengine's patched
    ``__init__`` replaces it before anything waits on it."""
    import inspect

    from vllm.v1.fault_tolerance.engine_core_sentinel import EngineCoreSentinel

    from ftengine.integrations.vllm.engine_core import agent
    from ftengine.integrations.vllm.patches import engine_core as patches

    source = inspect.getsource(EngineCoreSentinel.__init__)
    assert "self.resumed = threading.Event()" in source and "self.resumed.set()" in source
    monkeypatch.setattr(agent, "start_agent", lambda sentinel, attr: None)

    def vllms_init(sentinel: Any) -> None:
        sentinel.resumed = threading.Event()
        sentinel.resumed.set()

    made: Any = type("Made", (), {})()
    patches._with_agent(vllms_init)(made)
    assert isinstance(made.resumed, ParkableEvent) and made.resumed.is_set()
    assert not made.resumed.parked
