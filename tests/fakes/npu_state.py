"""State of the fake torch_npu: every call recorded with its arguments, device faults injectable.

The fake models the device life cycle the backend depends on: after ``poison()`` (a device
error) every device op raises until ``stop_device`` then ``restart_device``; a stopped
device rejects ``reinit_process_group`` and ``synchronize`` until it is restarted.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs


@attrs.frozen
class Call:
    """One recorded torch_npu call."""

    name: str
    args: tuple[object, ...] = ()
    kwargs: Mapping[str, object] = attrs.field(factory=dict)


class FakeDeviceError(RuntimeError):
    """What the fake raises for a device op on a poisoned or stopped device."""


class Mc2ArgumentError(ValueError):
    """An MC2 argument the real op would reject (raised by the fake dispatch / combine)."""


class FakeNpuState:
    """Recorder and device model shared by every module of the fake torch_npu."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.calls: list[Call] = []
        self.current_device: int | None = None
        self.stopped: set[int] = set()
        self.poisoned = False
        self.op_timeout_ms: int | None = None
        self.stop_result = 0
        self.failures: dict[str, BaseException] = {}
        self.last_dispatch: dict[str, object] | None = None

    # Recording -----------------------------------------------------------------------------

    def record(self, name: str, *args: object, **kwargs: object) -> None:
        """Log a call; raise a failure injected for ``name`` (once)."""
        self.calls.append(Call(name=name, args=args, kwargs=dict(kwargs)))
        failure = self.failures.pop(name, None)
        if failure is not None:
            raise failure

    def names(self) -> list[str]:
        return [call.name for call in self.calls]

    def of(self, name: str) -> list[Call]:
        return [call for call in self.calls if call.name == name]

    def clear_calls(self) -> None:
        self.calls.clear()

    # Fault injection -----------------------------------------------------------------------

    def fail(self, name: str, error: BaseException) -> None:
        """Make the next call of ``name`` raise ``error`` (after being recorded)."""
        self.failures[name] = error

    def poison(self) -> None:
        """A device error: the stream is poisoned until the device is stopped and restarted."""
        self.poisoned = True

    def require_usable(self, name: str) -> None:
        """Raise like CANN does when ``name`` runs on a poisoned or stopped device."""
        if self.poisoned:
            raise FakeDeviceError(f"{name}: the stream is poisoned by an earlier device error")
        if self.current_device is not None and self.current_device in self.stopped:
            raise FakeDeviceError(f"{name}: device {self.current_device} is stopped")


STATE = FakeNpuState()
