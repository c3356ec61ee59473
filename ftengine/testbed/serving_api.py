"""The contract between an API edge and a serving loop: one generation request, the events
it reports back while it runs, and how it finished (vLLM's ``finish_reason`` values).

Value types only, with no dependency on the cluster, so the HTTP layer and the cluster's
serving loop (``ftengine.testbed.cluster.serving``) meet here without importing each other.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable

import attrs

from ftengine.errors import ConfigError


class FinishReason(enum.Enum):
    """Why a request ended (the strings vLLM's ``RequestOutput.finish_reason`` uses)."""

    LENGTH = "length"  # max_tokens reached
    STOP = "stop"  # an end-of-sequence or stop token id was generated (and is kept)
    ABORT = "abort"  # a fault aborted it, the client went away, or the server shut down
    ERROR = "error"  # the rank serving it could not compute it (it alone failed)


def _ids(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


def _id_set(value: Iterable[int]) -> frozenset[int]:
    return frozenset(value)


def _prompt(_instance: object, _attribute: object, value: tuple[int, ...]) -> None:
    if not value or not all(type(token) is int and token >= 0 for token in value):
        raise ConfigError(f"a prompt is a non-empty tuple of token ids >= 0, found {value!r}")


def _positive(_instance: object, _attribute: object, value: int) -> None:
    if type(value) is not int or value < 1:
        raise ConfigError(f"max_tokens must be an int >= 1, found {value!r}")


@attrs.frozen
class GenerationRequest:
    """Greedy-generate up to ``max_tokens`` tokens after ``prompt_token_ids``; stop early
    (finish ``stop``) after generating any id in ``stop_token_ids``."""

    prompt_token_ids: tuple[int, ...] = attrs.field(converter=_ids, validator=_prompt)
    max_tokens: int = attrs.field(validator=_positive)
    stop_token_ids: frozenset[int] = attrs.field(default=frozenset(), converter=_id_set)


@attrs.frozen
class TokenEvent:
    """What one step brought one request: its new token ids and, on the request's last
    event, why it finished (``stop_reason``: the stop token id; ``detail``: why it was
    aborted or failed)."""

    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    detail: str | None = None

    @property
    def finished(self) -> bool:
        """True on the request's last event."""
        return self.finish_reason is not None


Listener = Callable[[TokenEvent], None]
"""Receives a request's events in order, on the serving loop's thread; it must not block."""
