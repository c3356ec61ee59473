"""Fake ``torch_npu.npu``: device control and the op timeout, with torch_npu 7.3's signatures.

Each function takes exactly the parameters the published API has (an unknown keyword is a
``TypeError``, as it is for the real binding) and records the positional ones, plus the
optional ones that differ from their defaults. ``set_op_timeout_ms`` is new in torch_npu
7.3.0; a test deletes it to model 7.2. What it does with 0 is not documented, so the fake
refuses it: the backend must never rely on it.
"""

from __future__ import annotations

from tests.fakes.npu_state import RUNNING, STATE, STOPPED, SUSPENDED


def set_device(device: int, /) -> None:
    STATE.record("npu.set_device", device)
    STATE.current_device = device


def current_device() -> int:
    STATE.record("npu.current_device")
    return STATE.current_device if STATE.current_device is not None else 0


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
    return STATE.stop_result


def restart_device(
    device_id: int, rebuild_all_resources: bool = False, disable_tensor_unsafe_check: bool = False
) -> None:
    """Recover the streams of a stopped device; its HCCL groups wait for a resume."""
    STATE.record(
        "npu.restart_device",
        device_id,
        **_given(rebuild_all_resources, disable_tensor_unsafe_check),
    )
    if device_id in STATE.stopped:
        STATE.stopped.discard(device_id)
        # Only a stop clears queued work; restarting a running device keeps a poisoned stream.
        STATE.poisoned = False
        for name, state in STATE.hccl_groups.items():
            if state != RUNNING:
                STATE.hccl_groups[name] = SUSPENDED


def _given(rebuild_all_resources: bool, disable_tensor_unsafe_check: bool) -> dict[str, bool]:
    """The optional arguments that differ from their defaults (what the caller asked for)."""
    given = {}
    if rebuild_all_resources:
        given["rebuild_all_resources"] = True
    if disable_tensor_unsafe_check:
        given["disable_tensor_unsafe_check"] = True
    return given
