"""Lazy, typed access to ``torch_npu``: imported only when an NPU backend is built.

Every torch_npu / CANN call the NPU backend makes goes through :class:`NpuRuntime`, so
the rest of the backend is typed and a test can put a recording fake in its place.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import torch

from ftengine.errors import BackendError, DeviceError

logger = logging.getLogger(__name__)

# Attribute paths (relative to the torch_npu module) the backend cannot run without.
REQUIRED_APIS: tuple[str, ...] = (
    "npu.set_device",
    "npu.current_stream",
    "npu.synchronize",
    "npu.stop_device",
    "npu.restart_device",
    "distributed.reinit_process_group",
    "npu_format_cast",
)
# Only a non-zero ft_communication_abort_timeout needs it (torch_npu >= 7.3.0).
OP_TIMEOUT_API = "npu.set_op_timeout_ms"
# Only scale-down needs these (checked by the start-up preconditions, not here).
MC2_V2_APIS: tuple[str, ...] = (
    "npu_moe_distribute_dispatch_v2",
    "npu_moe_distribute_combine_v2",
)
ELASTIC_INFO_KERNELS: tuple[tuple[str, str], ...] = (
    ("aclnnMoeDistributeDispatchV4", "aclnnMoeDistributeCombineV4"),
    ("aclnnMoeDistributeDispatchV3", "aclnnMoeDistributeCombineV3"),
)
"""The CANN kernel pairs dispatch_v2 / combine_v2 switch to when ``elastic_info`` is passed:
op-plugin prefers V4 when CANN exports it, else V3; either whole pair will do."""
OPAPI_LIBRARIES: tuple[str, ...] = (
    "libopapi_math.so",
    "libopapi_nn.so",
    "libopapi_cv.so",
    "libopapi_transformer.so",
    "libopapi_oam.so",
    "libopapi_legacy.so",
    "libopapi.so",
)
"""CANN's op-API libraries in op-plugin's search order (``op_api_common.h``, 7.3.0): the
per-package ones first (ops-transformer, where the MC2 kernels are built, makes
``libopapi_transformer.so``), the monolithic ``libopapi.so`` last."""

AclnnProbe = Callable[[str], "bool | None"]
"""Whether CANN exports an aclnn kernel symbol (None: cannot tell)."""

_CANN_HINT = (
    "source the CANN environment first (e.g. `source /usr/local/Ascend/ascend-toolkit/set_env.sh`)"
)


class TorchNpuUnavailable(BackendError, ImportError):
    """torch_npu (or the CANN libraries under it) cannot be imported or lacks an API we call."""


def cann_exports(symbol: str) -> bool | None:
    """Whether CANN exports ``symbol`` from one of :data:`OPAPI_LIBRARIES`, searched as
    op-plugin does: True once found; False only when every library loaded and none has it;
    None when it was not found but some library could not be loaded (the search was partial).
    """
    partial = False
    for name in OPAPI_LIBRARIES:
        try:
            library = ctypes.CDLL(name)
        except OSError:
            partial = True
            continue
        if hasattr(library, symbol):
            return True
    return None if partial else False


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

    ``module`` is the imported torch_npu (or a test fake with the same attribute layout);
    ``aclnn_probe`` answers whether CANN has a kernel (default: :func:`cann_exports`).
    """

    def __init__(self, module: ModuleType, *, aclnn_probe: AclnnProbe | None = None) -> None:
        self._mod = module
        self._aclnn_probe: AclnnProbe = aclnn_probe if aclnn_probe is not None else cann_exports

    @classmethod
    def load(
        cls, module_name: str = "torch_npu", *, aclnn_probe: AclnnProbe | None = None
    ) -> NpuRuntime:
        """Import torch_npu now (never at ftengine import time)."""
        return cls(import_torch_npu(module_name), aclnn_probe=aclnn_probe)

    @property
    def module(self) -> ModuleType:
        return self._mod

    @property
    def version(self) -> str:
        return str(getattr(self._mod, "__version__", "unknown"))

    @property
    def has_mc2_v2(self) -> bool:
        """Whether ``npu_moe_distribute_dispatch_v2`` / ``combine_v2`` exist in this torch_npu."""
        return all(_has(self._mod, path) for path in MC2_V2_APIS)

    @property
    def has_op_timeout(self) -> bool:
        """Whether this torch_npu has ``npu.set_op_timeout_ms`` (torch_npu >= 7.3.0)."""
        return _has(self._mod, OP_TIMEOUT_API)

    @property
    def has_elastic_info_kernels(self) -> bool | None:
        """Whether CANN has a whole aclnn V4 or V3 MC2 kernel pair, which ``elastic_info``
        needs: True when one pair is found, False only when every pair is known to lack a
        kernel, None (unknown) otherwise."""
        answers = [[self._aclnn_probe(symbol) for symbol in pair] for pair in ELASTIC_INFO_KERNELS]
        if any(all(answer is True for answer in pair) for pair in answers):
            return True
        if all(any(answer is False for answer in pair) for pair in answers):
            return False
        return None

    def device(self, index: int) -> torch.device:
        """The torch device of NPU ``index``."""
        return torch.device("npu", index)

    # Device control -------------------------------------------------------------------------

    def set_device(self, index: int) -> None:
        self._mod.npu.set_device(index)

    def initialise_device(self, index: int) -> None:
        """Set NPU ``index`` and make torch_npu initialise it now: with CANN >= 8.3.RC1
        (lazy set-device) torch_npu's lazy initialisation runs on the first stream use and
        sets the op timeout back to its default (547 s), so a timeout must be set after it."""
        self._mod.npu.set_device(index)
        self._mod.npu.current_stream()

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
        """Recover the device's streams (``rebuild_all_resources`` left False: keep the
        allocations the model holds)."""
        self._mod.npu.restart_device(index)

    def resume_hccl_groups(self) -> None:
        """``reinit_process_group(None, rebuild_link=False)``: resume every HCCL group of the
        process in place, keeping its links (no new rendezvous with peers)."""
        self._mod.distributed.reinit_process_group(None, rebuild_link=False)

    def synchronize(self) -> None:
        self._mod.npu.synchronize()

    def set_op_timeout_ms(self, milliseconds: int) -> None:
        """Abort any NPU op (communication ops included) running longer than this.

        ``TorchNpuUnavailable`` when this torch_npu predates the API (see
        :func:`op_timeout_missing`).
        """
        if not self.has_op_timeout:
            raise op_timeout_missing(self.version, milliseconds)
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


def op_timeout_missing(version: str, milliseconds: int) -> TorchNpuUnavailable:
    """The error for an op timeout this torch_npu cannot install."""
    return TorchNpuUnavailable(
        f"an op timeout of {milliseconds} ms needs torch_npu.{OP_TIMEOUT_API}, which torch_npu "
        f"{version} lacks: it exists from torch_npu 7.3.0 and calls aclrtSetOpExecuteTimeOutV2, "
        "so it also needs a CANN with that V2 call; upgrade torch_npu and CANN together, or "
        "set ft_communication_abort_timeout to 0 (no op timeout)"
    )
