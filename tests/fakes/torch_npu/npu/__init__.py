"""Fake ``torch_npu.npu``: device control and the op timeout, recorded in ``STATE``."""

from __future__ import annotations

from tests.fakes.npu_state import STATE


def set_device(device: int) -> None:
    STATE.record("npu.set_device", device)
    STATE.current_device = device


def current_device() -> int:
    STATE.record("npu.current_device")
    return STATE.current_device if STATE.current_device is not None else 0


def synchronize(device: int | None = None) -> None:
    STATE.record("npu.synchronize", *(() if device is None else (device,)))
    STATE.require_usable("npu.synchronize")


def set_op_timeout_ms(timeout: int) -> None:
    STATE.record("npu.set_op_timeout_ms", timeout)
    if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout < 0:
        raise TypeError(f"set_op_timeout_ms expects a non-negative int, got {timeout!r}")
    STATE.op_timeout_ms = timeout


def stop_device(device_id: int) -> int:
    """0 on success, 1 on failure (``STATE.stop_result``), as the torch_npu docs say."""
    STATE.record("npu.stop_device", device_id)
    if STATE.stop_result == 0:
        STATE.stopped.add(device_id)
    return STATE.stop_result


def restart_device(device_id: int, rebuild_all_resource: bool = False) -> None:
    STATE.record("npu.restart_device", device_id, rebuild_all_resource=rebuild_all_resource)
    if device_id in STATE.stopped:
        STATE.stopped.discard(device_id)
        # Only a stop clears queued work; restarting a running device keeps a poisoned stream.
        STATE.poisoned = False
