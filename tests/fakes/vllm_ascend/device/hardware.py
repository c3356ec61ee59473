"""Stand-in of ``vllm_ascend.device.hardware``."""

from __future__ import annotations

from enum import Enum


class AscendDeviceType(Enum):
    A2 = 0
    A3 = 1
    _310P = 2
    A5 = 3
