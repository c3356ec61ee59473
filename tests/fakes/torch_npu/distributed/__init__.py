"""Fake ``torch_npu.distributed``: ``reinit_process_group`` with torch_npu's signature."""

from __future__ import annotations

from tests.fakes.npu_state import DEFAULT_GROUP, RUNNING, STATE, FakeDeviceError


def reinit_process_group(group: object = None, rebuild_link: bool = True) -> None:
    """Re-initialise HCCL after a device restart.

    ``rebuild_link=False`` resumes every suspended HCCL group in place (no rendezvous);
    ``rebuild_link=True`` rebuilds the links of ``group`` (None: the default group) only.
    """
    STATE.record("distributed.reinit_process_group", group, rebuild_link=rebuild_link)
    if STATE.current_device is not None and STATE.current_device in STATE.stopped:
        raise FakeDeviceError("reinit_process_group on a stopped device: restart it first")
    if STATE.poisoned:
        raise FakeDeviceError("reinit_process_group on a poisoned stream: stop and restart first")
    if rebuild_link:
        STATE.set_watchdogs(RUNNING, only=DEFAULT_GROUP if group is None else str(group))
    else:
        STATE.set_watchdogs(RUNNING)
