"""Fake ``torch_npu.npu``: device control and the op timeout, with the signatures of the
torch_npu release ``STATE.version`` names (chosen before the fake is imported).

Each function takes exactly the parameters the published API has (an unknown keyword is a
``TypeError``, as it is for the real binding) and records the positional ones, plus the
optional ones that differ from their defaults. ``restart_device`` is
``(device_id, rebuild_all_resources=False)`` in 7.3.0 and 26.0.0 and gains
``disable_tensor_unsafe_check`` in 26.1.0. ``set_op_timeout_ms`` is new in torch_npu 7.3.0;
a test deletes it to model 7.2. What it does with 0 is not documented, so the fake refuses
it: the backend must never rely on it.
"""

from __future__ import annotations

from tests.fakes.npu_state import (
    RUNNING,
    STATE,
    STOPPED,
    SUSPENDED,
    WATCHDOG_RUN,
    WATCHDOG_STOP,
)


def set_device(device: int, /) -> None:
    STATE.record("npu.set_device", device)
    STATE.current_device = device
    if not STATE.lazy_set_device:  # CANN < 8.3.RC1: the device is initialised here
        STATE.initialise_device()


def current_device() -> int:
    STATE.record("npu.current_device")
    return STATE.current_device if STATE.current_device is not None else 0


def current_stream(device: int | None = None) -> object:
    """The current stream: creating it runs torch_npu's lazy device initialisation."""
    STATE.record("npu.current_stream", *(() if device is None else (device,)))
    STATE.initialise_device()
    return ("stream", STATE.current_device if device is None else device)


def synchronize(device: int | None = None) -> None:
    STATE.record("npu.synchronize", *(() if device is None else (device,)))
    STATE.require_usable("npu.synchronize")


def set_op_timeout_ms(timeout: int) -> None:
    """``aclrtSetOpExecuteTimeOutV2``: the timeout of every op, in milliseconds."""
    STATE.record("npu.set_op_timeout_ms", timeout)
    if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout <= 0:
        raise TypeError(f"set_op_timeout_ms expects a positive int of ms, got {timeout!r}")
    STATE.op_timeout_ms = timeout


def stop_device(device_id: int) -> int:
    """0 on success, 1 on failure (``STATE.stop_result``); every HCCL watchdog goes STOP."""
    STATE.record("npu.stop_device", device_id)
    if STATE.stop_result == 0:
        STATE.stopped.add(device_id)
        STATE.set_watchdogs(STOPPED)
        STATE.set_watchdog_states(WATCHDOG_STOP)
    return STATE.stop_result


def _restart(device_id: int, given: dict[str, bool]) -> None:
    """Recover the streams of a stopped device: every watchdog back to RUN, the
    communicators suspended until a resume, the op timeout back to torch_npu's default."""
    STATE.record("npu.restart_device", device_id, **given)
    if device_id in STATE.stopped:
        STATE.stopped.discard(device_id)
        # Only a stop clears queued work; restarting a running device keeps a poisoned stream.
        STATE.poisoned = False
        for name, state in STATE.hccl_groups.items():
            if state != RUNNING:
                STATE.hccl_groups[name] = SUSPENDED
        STATE.set_watchdog_states(WATCHDOG_RUN)
        STATE.device_initialised = False
        STATE.initialise_device()


def _restart_device_7_3(device_id: int, rebuild_all_resources: bool = False) -> None:
    """torch_npu 7.3.0 / 26.0.0."""
    _restart(device_id, {"rebuild_all_resources": True} if rebuild_all_resources else {})


def _restart_device_26_1(
    device_id: int, rebuild_all_resources: bool = False, disable_tensor_unsafe_check: bool = False
) -> None:
    """torch_npu 26.1.0."""
    given = {}
    if rebuild_all_resources:
        given["rebuild_all_resources"] = True
    if disable_tensor_unsafe_check:
        given["disable_tensor_unsafe_check"] = True
    _restart(device_id, given)


restart_device = _restart_device_26_1 if STATE.version == "26.1.0" else _restart_device_7_3
