"""The ftengine error hierarchy: one root, specific subclasses that also subclass a builtin."""

from __future__ import annotations


class FTEngineError(Exception):
    """Root of every error ftengine raises on purpose."""


class PreconditionFailed(FTEngineError, ValueError):
    """A recovery or configuration precondition does not hold.

    ``reasons`` lists every failed precondition, so a caller sees them all at once.
    """

    def __init__(self, message: str, reasons: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.reasons: tuple[str, ...] = reasons or (message,)


class ConfigError(FTEngineError, ValueError):
    """A configuration value is invalid (names the key, the value and what was expected)."""


class CommandRejected(FTEngineError, ValueError):
    """An orchestrator command was refused; ``reason`` is the vLLM-style reason string."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class TransitionError(FTEngineError, RuntimeError):
    """A trigger was fired from a phase whose table row does not allow it."""


class BackendError(FTEngineError, RuntimeError):
    """A backend action failed; the original error is kept as ``__cause__``."""


class CollectiveTimeout(BackendError, TimeoutError):
    """A collective did not finish within the op timeout (a hung or dead peer)."""


class PeerDead(BackendError, ConnectionError):
    """A peer rank is gone (its socket closed or its process exited)."""


class DeviceError(BackendError):
    """The device reported an error; its stream must be treated as poisoned."""


class WeightLoadError(FTEngineError, OSError):
    """Expert weights could not be read or validated; names the file and the tensor."""


class PlacementError(FTEngineError, ValueError):
    """Expert placement maps are inconsistent or cannot be built."""
