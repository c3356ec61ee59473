"""What the control plane needs from a cluster (``ftengine.cluster.Cluster`` satisfies it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol


class CommandOutcome(Protocol):
    """A command's result (``ftengine.engine.CommandResult`` has these fields)."""

    @property
    def request_id(self) -> str: ...

    @property
    def success(self) -> bool: ...

    @property
    def reason(self) -> str | None: ...


class ClusterHandle(Protocol):
    """The part of the ``Cluster`` API the HTTP layer calls."""

    def status(self) -> Mapping[str, Any]:
        """vLLM-shaped status: ``{"schema_version", "total_engines", "engines": [...]}``."""
        ...

    def apply(
        self, instruction: str, params: Mapping[str, object], request_id: str
    ) -> CommandOutcome:
        """Run one command on every live engine, to the end (blocking)."""
        ...

    def generate(self, prompt_token_ids: list[int], max_tokens: int) -> list[int]:
        """Greedy generation on a live DP rank: returns the new token ids."""
        ...
