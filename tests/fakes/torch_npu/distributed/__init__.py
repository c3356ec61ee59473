"""Fake ``torch_npu.distributed``: only ``reinit_process_group``, recorded in ``STATE``."""

from __future__ import annotations

from tests.fakes.npu_state import STATE, FakeDeviceError


def reinit_process_group(group: object = None, rebuild_link: bool = True) -> None:
    """Re-initialise HCCL on ``group`` (None = the default group); needs a restarted device."""
    STATE.record("distributed.reinit_process_group", group, rebuild_link=rebuild_link)
    if STATE.current_device is not None and STATE.current_device in STATE.stopped:
        raise FakeDeviceError("reinit_process_group on a stopped device: restart it first")
    if STATE.poisoned:
        raise FakeDeviceError("reinit_process_group on a poisoned stream: stop and restart first")
