"""Stand-in of ``vllm_ascend.ascend_config``: the options ftengine reads, from additional_config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class AscendConfig:
    """The ``AscendConfig`` fields ftengine reads (names as on vLLM-Ascend's FT branch)."""

    enable_fused_mc2: int = 0
    enable_mc2_hierarchy_comm: bool = False
    weight_nz_mode: int = 1
    ft_communication_abort_timeout: int = 0


_ASCEND_CONFIG: AscendConfig | None = None


def _abort_timeout(value: object) -> int:
    """vLLM-Ascend (#14113) accepts only an int here: ``30.0`` stops its start-up."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"ft_communication_abort_timeout must be an int, got {value!r}")
    return value


def init_ascend_config(vllm_config: Any) -> AscendConfig:
    """Read vLLM-Ascend's keys of ``--additional-config`` (others, e.g. ``ftengine``, ignored)."""
    global _ASCEND_CONFIG
    extra = dict(vllm_config.additional_config or {})
    _ASCEND_CONFIG = AscendConfig(
        enable_fused_mc2=int(extra.get("enable_fused_mc2", 0)),
        enable_mc2_hierarchy_comm=bool(extra.get("enable_mc2_hierarchy_comm", False)),
        weight_nz_mode=int(extra.get("weight_nz_mode", 1)),
        ft_communication_abort_timeout=_abort_timeout(
            extra.get("ft_communication_abort_timeout", 0)
        ),
    )
    return _ASCEND_CONFIG


def get_ascend_config() -> AscendConfig:
    if _ASCEND_CONFIG is None:
        raise RuntimeError("get_ascend_config() before init_ascend_config()")
    return _ASCEND_CONFIG
