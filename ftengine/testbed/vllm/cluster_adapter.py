"""The vLLM adapter as the CPU reference cluster's command adapter.

Name ``ftengine.testbed.vllm.cluster_adapter:vllm_command_adapter`` in
``ClusterConfig.command_adapter`` and each worker answers the orchestrator's commands as a
vLLM worker does: the command becomes vLLM's ``FaultToleranceRequest``, crosses a msgpack
wire as it does between vLLM's processes, is run by :class:`VllmCommands` (vLLM's
rejection rules, e.g. ``"status is DEAD"``), and its ``FaultToleranceResult`` crosses the
wire back. Needs vLLM importable in the workers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from ftengine.commands import CommandResult
from ftengine.integrations.vllm.messages import VllmMessages
from ftengine.integrations.vllm.worker.commands import SentinelLike, VllmCommands


class VllmCommandAdapter:
    """Runs a cluster worker's commands through vLLM's message types and the vLLM adapter.

    ``rank`` is the worker's DP rank (vLLM's engine index). ``last_request`` and
    ``last_result`` are the vLLM structs of the last command, as decoded from the wire.
    """

    def __init__(
        self, sentinel: SentinelLike, rank: int, messages: VllmMessages | None = None
    ) -> None:
        self.messages = messages if messages is not None else VllmMessages.load()
        self.adapter = VllmCommands(sentinel, engine_index=rank, messages=self.messages)
        self.last_request: Any = None
        self.last_result: Any = None

    def run_command(
        self, instruction: str, params: Mapping[str, object], request_id: str
    ) -> CommandResult:
        """Encode the command as vLLM's request, run it, decode vLLM's result."""
        request_type: Any = self.messages.request_type
        request = request_type(instruction, dict(params), request_id)
        self.last_request = _over_the_wire(request, request_type)
        result = self.adapter.run(self.last_request)
        self.last_result = _over_the_wire(result, self.messages.result_type)
        return CommandResult(
            str(self.last_result.request_id),
            bool(self.last_result.success),
            self.last_result.reason,
        )


def _over_the_wire(struct: object, kind: Any) -> Any:
    """``struct`` msgpack-encoded and decoded as ``kind``, as vLLM's processes exchange it."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(struct), type=kind)


def vllm_command_adapter(sentinel: SentinelLike, rank: int) -> VllmCommandAdapter:
    """The cluster's command-adapter factory (``ClusterConfig.command_adapter``)."""
    return VllmCommandAdapter(sentinel, rank)
