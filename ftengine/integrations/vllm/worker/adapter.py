"""vLLM's worker-sentinel contract over ftengine's ``WorkerSentinel``.

vLLM's engine core relays an orchestrator command to its workers as
``collective_rpc("handle_ft_command", args=(FaultToleranceRequest,))``; the worker hands
it to ``worker_sentinel.handle_command``. :class:`FtengineWorkerSentinel` answers it with
vLLM's ``FaultToleranceResult`` by running ftengine's FSM, policy and backend.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ftengine.clock import Clock, MonotonicClock
from ftengine.commands import CommandResult
from ftengine.errors import FTEngineError
from ftengine.faults import Fault, FaultKind, HealthStatus
from ftengine.integrations.vllm.messages import DP_PORTS_KEY, VllmMessages
from ftengine.status import EngineStatus

logger = logging.getLogger(__name__)

ENGINE_CORE_FAULT = "fault seen by vLLM's engine core"


class SentinelLike(Protocol):
    """What the adapter needs of ``ftengine.sentinel.WorkerSentinel``."""

    @property
    def health(self) -> HealthStatus: ...

    @property
    def serving(self) -> bool: ...

    def report(self, fault: Fault) -> None: ...

    def on_fault(self, exc: BaseException, step: int | None = None) -> Fault: ...

    def handle_ft_command(
        self, instruction: str, params: Any, request_id: str
    ) -> CommandResult: ...

    def poll(self) -> None: ...

    def status(self) -> EngineStatus: ...


class PortSink(Protocol):
    """Takes the DP-group ports vLLM's engine core publishes with a command."""

    def publish_dp_ports(self, ports: Sequence[int]) -> None: ...


class CommandFailed(FTEngineError, RuntimeError):
    """A command reached this worker and failed; ``result`` is its ``FaultToleranceResult``.

    Raised from :meth:`FtengineWorkerSentinel.handle_command` only: vLLM 0.33.0's engine
    core ignores what ``collective_rpc`` returns and sees a worker's failure only as an
    exception (it then answers ``success=False``).
    """

    def __init__(self, reason: str, result: object) -> None:
        super().__init__(reason)
        self.result = result


class FtengineWorkerSentinel:
    """One vLLM worker's sentinel, backed by an ftengine ``WorkerSentinel``.

    ``engine_index`` is vLLM's engine index (the DP rank); ``ports`` receives the DP-group
    ports a command carries (the worker's hooks). Thread-safe as far as the engine is.
    """

    def __init__(
        self,
        sentinel: SentinelLike,
        *,
        engine_index: int,
        messages: VllmMessages,
        ports: PortSink | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.sentinel = sentinel
        self.engine_index = engine_index
        self.messages = messages
        self.ports = ports
        self.clock: Clock = clock if clock is not None else MonotonicClock()
        self.on_serving: Callable[[], None] | None = None
        self.status_sink: Callable[[dict[str, object]], None] | None = None

    def serving_started(self) -> None:
        """The worker has warmed up: apply what start-up must run without (op timeouts)."""
        if self.on_serving is not None:
            self.on_serving()
        self.publish_status()

    def publish_status(self) -> None:
        """Hand the current status to ``status_sink`` (the engine core's status file)."""
        if self.status_sink is not None:
            self.status_sink(self.sentinel.status().to_dict())

    def adopt_engine_fault(self, kind: FaultKind) -> None:
        """The engine core faulted (e.g. a peer died while this worker idled): a worker
        still serving quarantines now, so its phase agrees with vLLM's status."""
        if self.sentinel.serving:
            self.sentinel.report(Fault(kind=kind, info=ENGINE_CORE_FAULT, at=self.clock.now()))

    def handle_ft_command(self, ft_request: object) -> Any:
        """Run a ``FaultToleranceRequest`` (``retry`` / ``scale_down`` with
        ``{"removed_dp_ranks": [...]}``) to its end; returns a ``FaultToleranceResult``.

        Rejected, as vLLM rejects, unless this worker is UNHEALTHY
        (``"[FT] Rejecting retry on engine 3: status is DEAD"``); invalid or out-of-phase
        commands are rejected by ftengine's engine with its reason. Never raises for a
        command that fails.
        """
        command = self.messages.split(ft_request)
        health = self.sentinel.health
        if health is not HealthStatus.UNHEALTHY:
            reason = (
                f"[FT] Rejecting {command.instruction} on engine {self.engine_index}: "
                f"status is {self.messages.status_name(health)}"
            )
            logger.warning(reason, extra={"rank": self.engine_index})
            return self.messages.result(CommandResult(command.request_id, False, reason))
        ports = command.vllm_params.get(DP_PORTS_KEY)
        if self.ports is not None and isinstance(ports, list | tuple):
            self.ports.publish_dp_ports([int(p) for p in ports])
        result = self.sentinel.handle_ft_command(
            command.instruction, command.params, command.request_id
        )
        return self.messages.result(result)

    def handle_command(self, ft_request: object) -> Any:
        """vLLM's entry (``Worker.handle_ft_command`` calls it after the engine core found
        itself UNHEALTHY). A worker still serving adopts that fault first (the engine core
        saw it, e.g. in its DP all-reduce, before any model step here did). Returns the
        ``FaultToleranceResult``; raises :class:`CommandFailed` carrying it on failure."""
        command = self.messages.split(ft_request)
        scale_down = command.instruction == "scale_down"
        self.adopt_engine_fault(FaultKind.DEAD_PEER if scale_down else FaultKind.TRANSIENT)
        result = self.handle_ft_command(ft_request)
        if not result.success:
            raise CommandFailed(str(result.reason), result)
        return result

    def on_fault(self, exc: BaseException, step: int | None = None) -> Fault:
        """Report an exception the worker caught (e.g. from ``execute_model``)."""
        return self.sentinel.on_fault(exc, step)

    def poll(self) -> None:
        """Let the engine run its time-driven decisions (call it from the worker's loop)."""
        self.sentinel.poll()

    def status(self) -> dict[str, object]:
        """ftengine's status dict with vLLM's lower-case status name as ``status_name``."""
        snapshot = self.sentinel.status()
        return {
            **snapshot.to_dict(),
            "status_name": self.messages.status_name(snapshot.status).lower(),
        }
