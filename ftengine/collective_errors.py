"""One classifier of the errors collectives raise: by type first, by message only for the plain
``RuntimeError`` of gloo (and HCCL), through one table of message families.

The CPU backend turns gloo's RuntimeError into a typed error with this table
(``ftengine/testbed/cpu/comm.py``) and the sentinel classifies what reaches the host with it, so a
message means the same fault on both paths.
"""

from __future__ import annotations

import re

import attrs

from ftengine.errors import CollectiveTimeout, DeviceError, PeerDead
from ftengine.faults import FaultKind


def _case_insensitive(pattern: str | re.Pattern[str]) -> re.Pattern[str]:
    return pattern if isinstance(pattern, re.Pattern) else re.compile(pattern, re.IGNORECASE)


@attrs.frozen
class MessageFamily:
    """Library messages that stand for one fault kind; ``pattern`` is searched in the text
    (a string is compiled case-insensitively)."""

    name: str
    kind: FaultKind
    pattern: re.Pattern[str] = attrs.field(converter=_case_insensitive)


_DEAD, _HUNG = FaultKind.DEAD_PEER, FaultKind.HUNG_PEER

# Tried in order. A closed, reset or refused socket says the peer is gone, a timeout only
# that it did not answer: where one message says both, the stronger evidence wins.
MESSAGE_FAMILIES: tuple[MessageFamily, ...] = (
    MessageFamily(
        "connection closed by peer", _DEAD, r"connection closed|closed by peer|peer .*(closed|gone)"
    ),
    MessageFamily("connection reset / refused", _DEAD, r"connection (reset|refused)"),
    MessageFamily("broken pipe / end of file", _DEAD, r"broken pipe|end of file|\bEOF\b"),
    MessageFamily("timeout", _HUNG, r"timed out|timeout|deadline exceeded"),
)


def error_text(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type name if empty).

    Only the first line is the library's message; what may follow is a C++ backtrace
    (``TORCH_SHOW_CPP_STACKTRACES``) whose frame names must not count as evidence.
    """
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def message_family(text: str) -> MessageFamily | None:
    """The first family of ``MESSAGE_FAMILIES`` whose pattern occurs in ``text``, if any."""
    return next((family for family in MESSAGE_FAMILIES if family.pattern.search(text)), None)


def classify_exception(exc: BaseException) -> FaultKind:
    """The fault kind an exception caught on a worker stands for.

    By type first (ftengine's own errors, then the builtin ``TimeoutError`` /
    ``ConnectionError``); by message only for a plain ``RuntimeError`` (gloo, HCCL): a
    subclass such as ``BackendError`` has said what it is by its type. Anything else is
    ``TRANSIENT``: a retry may clear it.
    """
    if isinstance(exc, CollectiveTimeout | TimeoutError):
        return FaultKind.HUNG_PEER
    if isinstance(exc, PeerDead | ConnectionError):
        return FaultKind.DEAD_PEER
    if isinstance(exc, DeviceError):
        return FaultKind.DEVICE_ERROR
    if type(exc) is RuntimeError:
        family = message_family(error_text(exc))
        if family is not None:
            return family.kind
    return FaultKind.TRANSIENT
