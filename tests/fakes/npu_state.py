"""State of the fake torch_npu: every call recorded, the device and HCCL life cycle, the SoC.

The fake models what the backend depends on and what the real library enforces:

- after ``poison()`` (a device error) every device op raises until ``stop_device`` then
  ``restart_device``; a stopped device rejects ``reinit_process_group`` and
  ``synchronize`` until it is restarted;
- every HCCL group's watchdog goes STOP at ``stop_device`` and back to RUN at
  ``restart_device`` (as torch_npu's does); the communicators stay suspended from the stop
  until ``reinit_process_group(None, rebuild_link=False)`` resumes every one of them
  (``rebuild_link=True`` re-links the default group only); an MC2 op on a group that is not
  running raises;
- torch_npu's lazy initialisation (CANN >= 8.3.RC1, lazy set-device): the first stream use
  initialises the device and sets the op timeout to torch_npu's default (547 s), losing one
  set before; ``restart_device`` sets the default again too (the pessimistic reading: it
  re-initialises the device's resources);
- ``version`` picks the torch_npu release whose signatures the fake takes
  (:data:`TORCH_NPU_VERSIONS`);
- the SoC (``"A3"`` or ``"A2"``) and whether CANN has the aclnn V3 MC2 kernels (the ones
  ``elastic_info`` needs) decide what the fake MC2 ops accept;
- ``npu_format_cast`` keeps the logical size and remembers the storage format it gave.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

TORCH_NPU_VERSIONS = ("7.3.0", "26.0.0", "26.1.0")
"""The torch_npu releases the fake models: ``restart_device`` gains
``disable_tensor_unsafe_check`` only in 26.1.0."""
DEFAULT_OP_TIMEOUT_MS = 547_000
"""torch_npu's op timeout after its (lazy) device initialisation: ``kMaxOpExecuteTimeOut``."""

DEFAULT_GROUP = "hccl_world_group"
"""The name the fake gives the default HCCL process group."""

ACL_FORMAT_ND = 2

RUNNING, STOPPED, SUSPENDED = "running", "stopped", "suspended"
"""States of a group's HCCL communicator: serving; stopped by stop_device; device restarted
but the communicator not yet resumed by reinit_process_group."""
WATCHDOG_RUN, WATCHDOG_STOP = "RUN", "STOP"
"""States of a group's HCCL watchdog (torch_npu's ``WatchdogStatus``)."""

ACLNN_V3 = ("aclnnMoeDistributeDispatchV3", "aclnnMoeDistributeCombineV3")
"""The CANN kernels torch_npu's dispatch_v2 / combine_v2 switch to when elastic_info is given."""
ACLNN_V4 = ("aclnnMoeDistributeDispatchV4", "aclnnMoeDistributeCombineV4")
"""Their successors, which op-plugin prefers when CANN exports them."""
MC2_LIBRARY = "libopapi_transformer.so"
"""The op-API library CANN's ops-transformer builds the MC2 kernels into."""
OTHER_OPAPI_LIBRARIES = (
    "libopapi_math.so",
    "libopapi_nn.so",
    "libopapi_cv.so",
    "libopapi_oam.so",
    "libopapi_legacy.so",
    "libopapi.so",
)
"""The other op-API libraries of the fake CANN (none exports an MC2 kernel)."""

DISPATCH, COMBINE = "npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2"
"""The MC2 ops as the fake torch_npu records them."""


@attrs.frozen
class Call:
    """One recorded torch_npu call, with its arguments as the caller passed them."""

    name: str
    args: tuple[object, ...] = ()
    kwargs: Mapping[str, object] = attrs.field(factory=dict)


class FakeDeviceError(RuntimeError):
    """What the fake raises for a device op on a poisoned or stopped device."""


class Mc2ArgumentError(ValueError):
    """An MC2 argument the real op would reject (raised by the fake dispatch / combine)."""


class AclnnMissing(RuntimeError):
    """An op needs a CANN kernel this (fake) CANN does not have."""


class FakeNpuState:
    """Recorder and device model shared by every module of the fake torch_npu."""

    def __init__(self) -> None:
        self.reset()

    def reset(self, version: str = TORCH_NPU_VERSIONS[0]) -> None:
        if version not in TORCH_NPU_VERSIONS:
            raise ValueError(f"the fake models torch_npu {TORCH_NPU_VERSIONS}, not {version}")
        self.version = version
        self.lazy_set_device = True  # CANN >= 8.3.RC1
        self.device_initialised = False
        self.calls: list[Call] = []
        self.current_device: int | None = None
        self.stopped: set[int] = set()
        self.poisoned = False
        self.op_timeout_ms: int | None = None
        self.stop_result = 0
        self.failures: dict[str, BaseException] = {}
        self.last_dispatch: dict[str, Any] | None = None
        self.soc = "A3"
        self.aclnn: set[str] = set(ACLNN_V3)
        # The fake CANN's op-API libraries by file name; the MC2 one exports ``aclnn``.
        self.opapi_libraries: dict[str, set[str]] = {
            **{name: set() for name in OTHER_OPAPI_LIBRARIES},
            MC2_LIBRARY: self.aclnn,
        }
        self.hccl_groups: dict[str, str] = {DEFAULT_GROUP: RUNNING}
        self.watchdogs: dict[str, str] = {DEFAULT_GROUP: WATCHDOG_RUN}
        self._formats: dict[int, tuple[int, torch.Tensor]] = {}

    # Recording -----------------------------------------------------------------------------

    def record(self, name: str, *args: object, **kwargs: object) -> None:
        """Log a call; raise a failure injected for ``name`` (once)."""
        self.calls.append(Call(name=name, args=args, kwargs=dict(kwargs)))
        failure = self.failures.pop(name, None)
        if failure is not None:
            raise failure

    def names(self) -> list[str]:
        return [call.name for call in self.calls]

    def of(self, name: str) -> list[Call]:
        return [call for call in self.calls if call.name == name]

    def clear_calls(self) -> None:
        self.calls.clear()

    # Fault injection -----------------------------------------------------------------------

    def fail(self, name: str, error: BaseException) -> None:
        """Make the next call of ``name`` raise ``error`` (after being recorded)."""
        self.failures[name] = error

    def poison(self) -> None:
        """A device error: the stream is poisoned until the device is stopped and restarted."""
        self.poisoned = True

    # Device initialisation -----------------------------------------------------------------

    def initialise_device(self) -> None:
        """torch_npu's ``LazyInitialize`` on first stream use: sets the op timeout to the
        default (547 s), whatever was set before."""
        if not self.device_initialised:
            self.device_initialised = True
            self.op_timeout_ms = DEFAULT_OP_TIMEOUT_MS

    def require_usable(self, name: str) -> None:
        """Raise like CANN does when ``name`` runs on a poisoned or stopped device (a device
        op uses a stream: the device is initialised first)."""
        self.initialise_device()
        if self.poisoned:
            raise FakeDeviceError(f"{name}: the stream is poisoned by an earlier device error")
        if self.current_device is not None and self.current_device in self.stopped:
            raise FakeDeviceError(f"{name}: device {self.current_device} is stopped")

    # CANN capabilities ----------------------------------------------------------------------

    def has_aclnn(self, symbol: str) -> bool:
        """Whether the fake CANN exports ``symbol`` (the runtime's aclnn probe in tests)."""
        return symbol in self.aclnn

    def load_library(self, name: str) -> object:
        """``ctypes.CDLL(name)`` on the fake CANN: an object with one attribute per exported
        symbol; ``OSError`` for a library this CANN does not have (as ``dlopen`` fails)."""
        if name not in self.opapi_libraries:
            raise OSError(f"{name}: cannot open shared object file: No such file or directory")
        return type(name, (), dict.fromkeys(self.opapi_libraries[name], None))()

    # HCCL groups ---------------------------------------------------------------------------

    def add_hccl_group(self, name: str) -> None:
        """An HCCL communicator named ``name`` (e.g. the MC2 EP group), running; creating it
        uses streams, so the device is initialised."""
        self.initialise_device()
        self.hccl_groups[name] = RUNNING
        self.watchdogs[name] = WATCHDOG_RUN

    def set_watchdog_states(self, state: str) -> None:
        """Every group's watchdog (``stop_device``: STOP; ``restart_device``: RUN)."""
        for name in self.watchdogs:
            self.watchdogs[name] = state

    def set_watchdogs(self, state: str, *, only: str | None = None) -> None:
        for name in self.hccl_groups:
            if only is None or name == only:
                self.hccl_groups[name] = state

    def require_group(self, name: str, op: str) -> None:
        state = self.hccl_groups.get(name)
        if state is None:
            raise Mc2ArgumentError(f"{op}: no HCCL communicator named {name!r}")
        if state != RUNNING:
            raise FakeDeviceError(f"{op}: HCCL group {name!r} is {state}, not running")
        if self.watchdogs.get(name) != WATCHDOG_RUN:
            raise FakeDeviceError(f"{op}: HCCL group {name!r}'s watchdog is stopped")

    # Storage formats -----------------------------------------------------------------------

    def remember_format(self, tensor: torch.Tensor, acl_format: int) -> None:
        # The tensor itself is kept so that its address is never reused by another one.
        self._formats[tensor.untyped_storage().data_ptr()] = (acl_format, tensor)

    def format_of(self, tensor: torch.Tensor) -> int:
        """The format of ``tensor``'s storage (a view shares its base's format, as on NPU)."""
        entry = self._formats.get(tensor.untyped_storage().data_ptr())
        return entry[0] if entry is not None else ACL_FORMAT_ND


STATE = FakeNpuState()
