"""Stand-in of ``vllm_ascend.device.device_config``: the SoC is the fake torch_npu's."""

from __future__ import annotations

from tests.fakes.npu_state import STATE

from .hardware import AscendDeviceType


def get_ascend_device_type() -> AscendDeviceType:
    return AscendDeviceType[STATE.soc]
