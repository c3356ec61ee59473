"""The process environment fault tolerance forces on an NPU worker, besides the HCCL timeouts.

``TASK_QUEUE_ENABLE=0`` (with torch_npu's task queue the v2 model runner hangs on a faulted
step instead of raising) and, with TP > 1, HCCL's async error handling off (otherwise the
HCCL watchdog tears the worker down on the first error in the TP group, before the
sentinel can quarantine it). The async error handling is set under both of torch_npu's
names: ``HCCL_ASYNC_ERROR_HANDLING`` (torch_npu 7.3.0 / 26.x) and
``TORCH_HCCL_ASYNC_ERROR_HANDLING`` (torch_npu master, which marks the old name
deprecated and reads the new one first). torch_npu reads them on first use of the task
queue and when the communicators are set up, so they must be in place before the device is
set up. vLLM-Ascend's FT branches were said to force these too; no readable revision does
(#14113 does not), so ftengine sets them itself.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping

from ftengine.errors import ConfigError

logger = logging.getLogger(__name__)

TASK_QUEUE_ENABLE = "TASK_QUEUE_ENABLE"
ASYNC_ERROR_HANDLING_NAMES = ("HCCL_ASYNC_ERROR_HANDLING", "TORCH_HCCL_ASYNC_ERROR_HANDLING")
"""HCCL's async error handling under torch_npu 7.3.0 / 26.x's name and master's."""


def ft_environment(tp_size: int) -> dict[str, str]:
    """The variables FT forces for a worker of tensor-parallel size ``tp_size``."""
    if tp_size < 1:
        raise ConfigError(f"tp_size must be >= 1, found {tp_size}")
    env = {TASK_QUEUE_ENABLE: "0"}
    if tp_size > 1:
        env.update(dict.fromkeys(ASYNC_ERROR_HANDLING_NAMES, "0"))
    return env


def apply_ft_environment(environ: MutableMapping[str, str], tp_size: int) -> dict[str, str]:
    """Force :func:`ft_environment` into ``environ``; returns the values it replaced.

    A value the user set differently is overridden (FT cannot work with it) and logged.
    """
    replaced: dict[str, str] = {}
    for name, value in ft_environment(tp_size).items():
        old = environ.get(name)
        if old is not None and old != value:
            replaced[name] = old
            logger.warning(
                "%s=%s overridden to %s: fault tolerance needs it",
                name,
                old,
                value,
            )
        environ[name] = value
    return replaced


def ft_environment_problems(environ: Mapping[str, str], tp_size: int) -> tuple[str, ...]:
    """What in ``environ`` differs from :func:`ft_environment` (empty when all is in place)."""
    return tuple(
        f"{name} is {environ.get(name)!r}, fault tolerance needs {value!r} before the NPU "
        "is set up: export it in the launching shell"
        for name, value in ft_environment(tp_size).items()
        if environ.get(name) != value
    )
