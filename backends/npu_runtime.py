"""Lazy, typed access to ``torch_npu``: imported only when an NPU backend is built.

Every torch_npu / CANN call the NPU backend makes goes through :class:`NpuRuntime`, so
the rest of the backend is typed and a test can put a recording fake in its place.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import torch

from ftengine.errors import BackendError, DeviceError

logger = logging.getLogger(__name__)

# Attribute paths (relative to the torch_npu module) the backend cannot run without.
REQUIRED_APIS: tuple[str, ...] = (
    "npu.set_device",
    "npu.synchronize",
    "npu.set_op_timeout_ms",
    "npu.stop_device",
    "npu.restart_device",
    "distributed.reinit_process_group",
    "npu_format_cast",
)
# Only scale-down needs these (checked by the start-up preconditions, not here).
MC2_V2_APIS: tuple[str, ...] = (
    "npu_moe_distribute_dispatch_v2",
    "npu_moe_distribute_combine_v2",
)

_CANN_HINT = (
    "source the CANN environment first (e.g. `source /usr/local/Ascend/ascend-toolkit/set_env.sh`)"
)


class TorchNpuUnavailable(BackendError, ImportError):
    """torch_npu (or the CANN libraries under it) cannot be imported or lacks an API we call."""


def _lookup(module: ModuleType, path: str) -> Any:
    target: Any = module
    for part in path.split("."):
        target = getattr(target, part)
    return target


def _has(module: ModuleType, path: str) -> bool:
    try:
        _lookup(module, path)
    except AttributeError:
        return False
    return True


def import_torch_npu(module_name: str = "torch_npu") -> ModuleType:
    """Import torch_npu (and its ``npu`` / ``distributed`` submodules) or explain what is missing.

    Raises :class:`TorchNpuUnavailable` naming the module, the missing APIs and what to do.
    """
    try:
        module = importlib.import_module(module_name)
        for sub in ("npu", "distributed"):
            importlib.import_module(f"{module_name}.{sub}")
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] == module_name:
            raise TorchNpuUnavailable(
                f"the NPU backend needs the `{module_name}` package, which is not installed: "
                f"install the torch_npu wheel matching torch {torch.__version__} and "
                f"{_CANN_HINT}; to run without an NPU use the cpu backend"
            ) from exc
        raise TorchNpuUnavailable(
            f"`{module_name}` is installed but importing it failed on `{exc.name}`: "
            f"{exc}; {_CANN_HINT}"
        ) from exc
    except (ImportError, OSError) as exc:
        raise TorchNpuUnavailable(
            f"`{module_name}` is installed but failed to load ({exc}); "
            f"the CANN runtime libraries are probably missing: {_CANN_HINT}"
        ) from exc
    missing = [path for path in REQUIRED_APIS if not _has(module, path)]
    if missing:
        version = getattr(module, "__version__", "unknown")
        raise TorchNpuUnavailable(
            f"`{module_name}` {version} lacks {', '.join(module_name + '.' + m for m in missing)}; "
            "the NPU fault-tolerance backend needs a torch_npu release with the device "
            "stop/restart and op-timeout APIs: upgrade torch_npu and CANN together"
        )
    return module


class NpuRuntime:
    """The torch_npu calls the NPU backend makes, one typed method each.

    ``module`` is the imported torch_npu (or a test fake with the same attribute layout).
    """

    def __init__(self, module: ModuleType) -> None:
        self._mod = module

    @classmethod
    def load(cls, module_name: str = "torch_npu") -> NpuRuntime:
        """Import torch_npu now (never at ftengine import time)."""
        return cls(import_torch_npu(module_name))

    @property
    def module(self) -> ModuleType:
        return self._mod

    @property
    def has_mc2_v2(self) -> bool:
        """Whether ``npu_moe_distribute_dispatch_v2`` / ``combine_v2`` exist in this torch_npu."""
        return all(_has(self._mod, path) for path in MC2_V2_APIS)

    def device(self, index: int) -> torch.device:
        """The torch device of NPU ``index``."""
        return torch.device("npu", index)

    # Device control -------------------------------------------------------------------------

    def set_device(self, index: int) -> None:
        self._mod.npu.set_device(index)

    def stop_device(self, index: int) -> None:
        """Stop the device: clear queued work, mark every HCCL watchdog STOP.

        torch_npu returns 0 on success and 1 on failure; a failure raises ``DeviceError``.
        """
        result = self._mod.npu.stop_device(index)
        if result not in (None, 0):
            raise DeviceError(
                f"torch_npu.npu.stop_device({index}) returned {result!r}, expected 0; "
                "the device could not be stopped, so the worker cannot be reset in place "
                "and must be restarted"
            )

    def restart_device(self, index: int) -> None:
        """Recover the device's streams; HCCL watchdogs go back to RUN."""
        self._mod.npu.restart_device(index)

    def reinit_default_group(self) -> None:
        """Re-initialise the default HCCL group keeping its links (no new rendezvous)."""
        self._mod.distributed.reinit_process_group(None, rebuild_link=False)

    def synchronize(self) -> None:
        self._mod.npu.synchronize()

    def set_op_timeout_ms(self, milliseconds: int) -> None:
        """Abort any NPU op (communication ops included) running longer than this."""
        self._mod.npu.set_op_timeout_ms(milliseconds)

    # Ops ------------------------------------------------------------------------------------

    def format_cast(self, tensor: torch.Tensor, acl_format: int) -> torch.Tensor:
        """``torch_npu.npu_format_cast``: same logical size, device storage in ``acl_format``."""
        result: torch.Tensor = self._mod.npu_format_cast(tensor, acl_format)
        return result

    def dispatch_v2(self, kwargs: Mapping[str, object]) -> tuple[torch.Tensor | None, ...]:
        """``torch_npu.npu_moe_distribute_dispatch_v2(**kwargs)`` (7 outputs)."""
        result: tuple[torch.Tensor | None, ...] = tuple(
            self._mod.npu_moe_distribute_dispatch_v2(**kwargs)
        )
        return result

    def combine_v2(self, kwargs: Mapping[str, object]) -> torch.Tensor:
        """``torch_npu.npu_moe_distribute_combine_v2(**kwargs)``."""
        result: torch.Tensor = self._mod.npu_moe_distribute_combine_v2(**kwargs)
        return result
