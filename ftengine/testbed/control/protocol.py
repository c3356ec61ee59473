"""What the control plane needs from a cluster, a serving loop and a tokenizer
(``ftengine.testbed.cluster.Cluster``, ``ftengine.testbed.cluster.serving.ServingLoop`` and a
Hugging Face ``tokenizers`` tokenizer satisfy them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from ftengine.testbed.serving_api import GenerationRequest, Listener


class CommandOutcome(Protocol):
    """A command's result (``ftengine.engine.CommandResult`` has these fields)."""

    @property
    def request_id(self) -> str: ...

    @property
    def success(self) -> bool: ...

    @property
    def reason(self) -> str | None: ...


class ClusterHandle(Protocol):
    """The part of the ``Cluster`` API the fault-tolerance routes call."""

    def status(self) -> Mapping[str, Any]:
        """``{"schema_version", "total_engines", "engines": [...]}`` with integer statuses."""
        ...

    def apply(
        self, instruction: str, params: Mapping[str, object], request_id: str
    ) -> CommandOutcome:
        """Run one command on every live engine, to the end (blocking)."""
        ...


class Ticket(Protocol):
    """A submitted generation request."""

    def cancel(self) -> None:
        """Abort it (the client went away); no-op once it finished."""
        ...


class GenerationService(Protocol):
    """Serves generation requests concurrently (continuous batching)."""

    def submit(self, request: GenerationRequest, listener: Listener) -> Ticket:
        """Queue ``request``; ``listener`` gets its events from another thread, the last
        one with a finish reason. Raises an FTEngineError when it cannot be served now."""
        ...


class Tokenizer(Protocol):
    """Text to token ids and back (``ftengine.testbed.control.served_model.HfTokenizer``)."""

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text`` (with the special tokens the tokenizer adds)."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` (special tokens skipped)."""
        ...
