"""Turn a hung NPU op into an error: ``ft_communication_abort_timeout`` → HCCL env + op timeout.

T seconds (0 = off, else an integer >= 2) gives ``HCCL_EVENT_TIMEOUT = T`` and
``HCCL_EXEC_TIMEOUT = T - 1`` unless the user set them, and
``torch_npu.npu.set_op_timeout_ms(T * 1000)`` (torch_npu >= 7.3.0, needed only when T > 0).
Turning T off after it was on restores torch_npu's own default op timeout (547 s). HCCL
reads its variables when a communicator is created, so the plan must be applied before the
distributed init; the op timeout, on the contrary, only holds once the device is really
initialised: torch_npu's lazy initialisation (CANN >= 8.3.RC1) and ``restart_device`` set
the default again, so the controller initialises the device before installing it and
:meth:`OpTimeoutController.reapply` puts it back after every restart.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping

import attrs

from ftengine.backends.npu_runtime import NpuRuntime, op_timeout_missing
from ftengine.errors import ConfigError

logger = logging.getLogger(__name__)

ABORT_TIMEOUT_KEY = "ft_communication_abort_timeout"
HCCL_EVENT_TIMEOUT = "HCCL_EVENT_TIMEOUT"
HCCL_EXEC_TIMEOUT = "HCCL_EXEC_TIMEOUT"
HCCL_CONNECT_TIMEOUT = "HCCL_CONNECT_TIMEOUT"
# CANN's defaults when nothing is set (seconds); documented, not applied by us.
DEFAULT_HCCL_EXEC_TIMEOUT_S = 1836
DEFAULT_HCCL_EVENT_TIMEOUT_S = 1868
DEFAULT_HCCL_CONNECT_TIMEOUT_S = 120
TORCH_NPU_DEFAULT_OP_TIMEOUT_MS = 547_000
"""torch_npu's op timeout when nobody set one (``kMaxOpExecuteTimeOut``, 547 s)."""


def validate_abort_timeout(
    value: object, *, key: str = ABORT_TIMEOUT_KEY, integral_float: bool = False
) -> int:
    """Check T: 0 (off) or an integer >= 2 (``HCCL_EXEC_TIMEOUT = T - 1`` must stay >= 1).

    As vLLM-Ascend does for ``ft_communication_abort_timeout`` (#14113 ``ascend_config.py``),
    only an int is accepted: ``30.0`` is rejected. ``integral_float`` admits ``30.0`` for the
    backend call, whose protocol takes float seconds; booleans, fractions, negatives and 1
    are never accepted.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(
            f"{key} must be an integer number of seconds (0 = off, else >= 2), "
            f"found {value!r} of type {type(value).__name__}"
        )
    if isinstance(value, float) and not value.is_integer():
        raise ConfigError(
            f"{key} must be a whole number of seconds (0 = off, else >= 2), found {value!r}; "
            f"round it to {max(2, round(value))}"
        )
    if isinstance(value, float) and not integral_float:
        raise ConfigError(
            f"{key} must be an integer number of seconds, found {value!r} (a float, which "
            f"vLLM-Ascend rejects too): write {int(value)}"
        )
    seconds = int(value)
    if seconds < 0 or seconds == 1:
        raise ConfigError(
            f"{key} must be 0 (off) or an integer >= 2, found {seconds}: "
            "HCCL_EXEC_TIMEOUT is derived as T - 1 and must be at least 1 second"
        )
    return seconds


def _env_seconds(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        seconds = int(raw.strip())
    except ValueError as exc:
        raise ConfigError(
            f"environment variable {name} must be an integer number of seconds, found {raw!r}"
        ) from exc
    if seconds < 0:
        raise ConfigError(f"environment variable {name} must be >= 0 seconds, found {seconds}")
    return seconds


@attrs.frozen
class OpTimeoutPlan:
    """What applying T does: the env variables to set and the op timeout to install.

    ``env`` holds only the variables the user did not set; ``event_timeout_s`` /
    ``exec_timeout_s`` are the effective HCCL values (None when unknown: CANN default);
    ``op_timeout_ms`` is None when the timeout is off.
    """

    seconds: int
    env: Mapping[str, str] = attrs.field(factory=dict)
    event_timeout_s: int | None = None
    exec_timeout_s: int | None = None
    op_timeout_ms: int | None = None


def plan_op_timeout(seconds: int, environ: Mapping[str, str]) -> OpTimeoutPlan:
    """Derive the HCCL variables and op timeout for T = ``seconds`` given the user's env.

    Raises ``ConfigError`` for a bad T, a non-integer HCCL variable, or an effective
    ``HCCL_EVENT_TIMEOUT <= HCCL_EXEC_TIMEOUT`` (the event wait must outlast the op).
    """
    seconds = validate_abort_timeout(seconds)
    user_event = _env_seconds(environ, HCCL_EVENT_TIMEOUT)
    user_exec = _env_seconds(environ, HCCL_EXEC_TIMEOUT)
    env: dict[str, str] = {}
    event, exec_ = user_event, user_exec
    if seconds > 0:
        if event is None:
            event = seconds
            env[HCCL_EVENT_TIMEOUT] = str(seconds)
        if exec_ is None:
            exec_ = seconds - 1
            env[HCCL_EXEC_TIMEOUT] = str(seconds - 1)
    if event is not None and exec_ is not None and event <= exec_:
        set_by = [
            name
            for name, user in ((HCCL_EVENT_TIMEOUT, user_event), (HCCL_EXEC_TIMEOUT, user_exec))
            if user is not None
        ]
        raise ConfigError(
            f"{HCCL_EVENT_TIMEOUT}={event} must be greater than {HCCL_EXEC_TIMEOUT}={exec_} "
            f"({' and '.join(set_by)} set in the environment, {ABORT_TIMEOUT_KEY}={seconds}): "
            "raise the event timeout or lower the exec timeout"
        )
    return OpTimeoutPlan(
        seconds=seconds,
        env=env,
        event_timeout_s=event,
        exec_timeout_s=exec_,
        op_timeout_ms=seconds * 1000 if seconds > 0 else None,
    )


class OpTimeoutController:
    """Applies T to one process: env variables first, then ``set_op_timeout_ms``.

    Remembers which variables it set itself, so a second ``apply`` with another T replaces
    them instead of mistaking them for the user's. With ``device_index`` the device is
    initialised (``NpuRuntime.initialise_device``) before the op timeout is installed;
    without it (before the worker sets its device up) the op timeout may be lost to
    torch_npu's lazy initialisation, and whoever owns the device must apply it again.
    """

    def __init__(
        self,
        runtime: NpuRuntime,
        environ: MutableMapping[str, str],
        *,
        device_index: int | None = None,
    ) -> None:
        self._runtime = runtime
        self._environ = environ
        self._device_index = device_index
        self._ours: dict[str, str] = {}
        self._installed_ms: int | None = None
        self.plan: OpTimeoutPlan | None = None

    def apply(self, seconds: int | float) -> OpTimeoutPlan:
        """Validate and apply T seconds (0 = off); returns the plan that was applied.

        Nothing is changed when T > 0 and this torch_npu has no ``set_op_timeout_ms``
        (``TorchNpuUnavailable`` naming the torch_npu and CANN versions it needs).
        """
        seconds = validate_abort_timeout(seconds, integral_float=True)
        if seconds > 0 and not self._runtime.has_op_timeout:
            raise op_timeout_missing(self._runtime.version, seconds * 1000)
        user_env = {
            name: value
            for name, value in self._environ.items()
            if name not in self._ours or self._ours[name] != value
        }
        plan = plan_op_timeout(seconds, user_env)
        for name in self._ours:
            if name not in plan.env and self._environ.get(name) == self._ours[name]:
                del self._environ[name]
        self._environ.update(plan.env)
        self._ours = dict(plan.env)
        if plan.op_timeout_ms is not None:
            self._install(plan.op_timeout_ms)
        elif self._installed_ms is not None:
            # Off after on: back to torch_npu's own default, not 0 (what 0 means to
            # aclrtSetOpExecuteTimeOutV2 is not documented for torch_npu).
            self._install(TORCH_NPU_DEFAULT_OP_TIMEOUT_MS)
        self._installed_ms = plan.op_timeout_ms
        self.plan = plan
        logger.info(
            "op timeout applied: %s ms in effect"
            if self._device_index is not None or plan.op_timeout_ms is None
            else "op timeout set to %s ms before the device is initialised (torch_npu's lazy "
            "initialisation may set its default again; the NPU backend sets it once more)",
            plan.op_timeout_ms or "torch_npu's default",
            extra={
                "abort_timeout_s": plan.seconds,
                "op_timeout_ms": plan.op_timeout_ms,
                "hccl_event_timeout_s": plan.event_timeout_s,
                "hccl_exec_timeout_s": plan.exec_timeout_s,
            },
        )
        return plan

    def reapply(self) -> None:
        """Install the op timeout again after ``restart_device`` (which sets torch_npu's
        default again); nothing when none is installed."""
        if self._installed_ms is None:
            return
        self._install(self._installed_ms)
        logger.info(
            "op timeout re-applied after a device restart: %d ms in effect",
            self._installed_ms,
            extra={"op_timeout_ms": self._installed_ms},
        )

    def _install(self, milliseconds: int) -> None:
        if self._device_index is not None:
            self._runtime.initialise_device(self._device_index)
        self._runtime.set_op_timeout_ms(milliseconds)
