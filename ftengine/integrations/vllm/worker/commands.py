"""vLLM's fault-tolerance commands run on ftengine's ``RankSentinel``.

vLLM's engine core relays an orchestrator command to its workers as
``collective_rpc("handle_ft_command", args=(FaultToleranceRequest,))``; the worker's fault
adapter (``adapter.WorkerFaultAdapter``) hands it to :class:`VllmCommands`, which applies
vLLM's rejection rule, passes on the DP-group ports the command carries and answers with
vLLM's ``FaultToleranceResult`` from ftengine's FSM, policy and backend. The CPU cluster's
vLLM command adapter uses it too, without a vLLM worker.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import attrs

from ftengine.commands import ADDED_KEY, CommandResult
from ftengine.faults import HealthStatus
from ftengine.integrations.vllm.messages import DP_HOST_KEY, DP_PORTS_KEY, VllmMessages
from ftengine.status import EngineStatus

logger = logging.getLogger(__name__)


class SentinelLike(Protocol):
    """What :class:`VllmCommands` needs of ``ftengine.sentinel.RankSentinel``."""

    @property
    def health(self) -> HealthStatus: ...

    def run_command(self, instruction: str, params: Any, request_id: str) -> CommandResult: ...

    def note_ready(self, ranks: frozenset[int]) -> None: ...

    def status(self) -> EngineStatus: ...


class PortSink(Protocol):
    """Takes the DP-group ports (and their host) the engine core publishes with a command."""

    def publish_dp_ports(self, ports: Sequence[int], host: str | None = None) -> None: ...


@attrs.frozen
class VllmCommands:
    """One worker's ``sentinel`` seen through vLLM's message types.

    ``engine_index`` is vLLM's engine index (the DP rank); ``ports`` receives the DP-group
    ports a command carries (the worker's hooks). Thread-safe as far as the engine is.
    """

    sentinel: SentinelLike
    engine_index: int
    messages: VllmMessages
    ports: PortSink | None = None

    def run(self, ft_request: object) -> Any:
        """Run a ``FaultToleranceRequest`` (``retry`` / ``scale_down`` with
        ``{"removed_dp_ranks": [...]}``) to its end; returns a ``FaultToleranceResult``.

        Rejected, as vLLM rejects, unless this worker is UNHEALTHY
        (``"[FT] Rejecting retry on engine 3: status is DEAD"``); invalid or out-of-phase
        commands are rejected by ftengine's engine with its reason. Never raises for a
        command that fails.
        """
        command = self.messages.split(ft_request)
        health = self.sentinel.health
        if command.instruction == "scale_up":
            # No fault: a survivor admits while HEALTHY, the returning rank once READY (the
            # FSM checks its phase). The engine core saw the returning ranks' join keys.
            added = command.params.get(ADDED_KEY) if isinstance(command.params, dict) else None
            if health is HealthStatus.HEALTHY and isinstance(added, list):
                self.sentinel.note_ready(frozenset(int(r) for r in added))
        elif health is not HealthStatus.UNHEALTHY:
            reason = (
                f"[FT] Rejecting {command.instruction} on engine {self.engine_index}: "
                f"status is {self.messages.status_name(health)}"
            )
            logger.warning(reason, extra={"rank": self.engine_index})
            return self.messages.result(CommandResult(command.request_id, False, reason))
        ports = command.vllm_params.get(DP_PORTS_KEY)
        if self.ports is not None and isinstance(ports, list | tuple):
            host = command.vllm_params.get(DP_HOST_KEY)
            self.ports.publish_dp_ports([int(p) for p in ports], str(host) if host else None)
        result = self.sentinel.run_command(command.instruction, command.params, command.request_id)
        return self.messages.result(result)

    def status(self) -> dict[str, object]:
        """ftengine's status dict with vLLM's lower-case status name as ``status_name``."""
        snapshot = self.sentinel.status()
        return {
            **snapshot.to_dict(),
            "status_name": self.messages.status_name(snapshot.status).lower(),
        }
