"""NPU device reset and the fault barrier that runs it on the first device error.

A device error leaves the NPU stream poisoned: any later teardown that touches it aborts
the process. So the barrier resets the device at once, before anything else runs, and
afterwards answers model calls with an empty output instead of touching the device.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from ftengine.backends.npu_groups import OwnedGroups
from ftengine.backends.npu_runtime import NpuRuntime
from ftengine.errors import DeviceError

logger = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")


class DeviceResetter:
    """Runs the reset sequence on NPU ``device_index``, then re-creates the owned groups.

    Order (REFERENCE §5): set_device → stop_device → restart_device → ``after_restart``
    (the op timeout again: a restart sets torch_npu's default) →
    reinit_process_group(None, rebuild_link=False) → synchronize → owned groups. The
    reinit resumes every HCCL group of the process in place; only the gloo groups
    ftengine owns are made again (a timed-out gloo group stays broken).
    """

    def __init__(
        self,
        runtime: NpuRuntime,
        device_index: int,
        groups: OwnedGroups,
        *,
        after_restart: Callable[[], None] = lambda: None,
    ) -> None:
        self._runtime = runtime
        self._index = device_index
        self._groups = groups
        self._after_restart = after_restart
        self.resets = 0

    def reset(self, *, recreate_groups: bool = True) -> None:
        """Reset the device; ``recreate_groups=False`` for a local reset while peers may be dead.

        Re-creating a group is a rendezvous with its members, so the local reset done at
        quarantine time only marks the groups stale; the coordinated retry re-creates them.
        """
        rt, index = self._runtime, self._index
        steps: tuple[tuple[str, Callable[[], None]], ...] = (
            ("set_device", lambda: rt.set_device(index)),
            ("stop_device", lambda: rt.stop_device(index)),
            ("restart_device", lambda: rt.restart_device(index)),
            ("set_op_timeout_ms", self._after_restart),
            ("reinit_process_group", rt.resume_hccl_groups),
            ("synchronize", rt.synchronize),
        )
        for name, step in steps:
            try:
                step()
            except DeviceError:
                raise
            except Exception as exc:  # torch_npu raises plain RuntimeError for device faults
                raise DeviceError(
                    f"NPU {index} reset failed at {name}: {exc}; the device cannot be reset "
                    "in place and the worker must be restarted"
                ) from exc
        if recreate_groups:
            self._groups.recreate()
        else:
            self._groups.mark_stale()
        self.resets += 1
        logger.info(
            "npu device reset",
            extra={"device": index, "groups_recreated": recreate_groups, "resets": self.resets},
        )


class FaultBarrier:
    """Quarantines model calls on the first error: reset the device once, then go device-free.

    ``local_reset`` is called once per fault (the first error or quarantine, whichever
    comes first). While tripped, guarded calls return ``empty()`` without running.
    """

    def __init__(self, local_reset: Callable[[], None]) -> None:
        self._local_reset = local_reset
        self._lock = threading.Lock()
        self._tripped = False
        self._reset_done = False
        self.reason: str | None = None

    @property
    def tripped(self) -> bool:
        return self._tripped

    @property
    def reset_done(self) -> bool:
        """Whether the local reset for the current fault has completed."""
        return self._reset_done

    def trip(self, reason: str) -> None:
        """Mark the worker faulted and reset the device now (once per fault).

        Raises ``DeviceError`` if the reset fails; a later ``trip`` tries again.
        """
        with self._lock:
            if not self._tripped:
                self._tripped = True
                self.reason = reason
            if self._reset_done:
                return
            self._local_reset()
            self._reset_done = True
        logger.warning("npu worker quarantined", extra={"reason": reason})

    def release(self) -> None:
        """Let model calls reach the device again (the recovery reset it and rebuilt groups)."""
        with self._lock:
            self._tripped = False
            self._reset_done = False
            self.reason = None

    def guard(self, fn: Callable[P, T], empty: Callable[[], T]) -> Callable[P, T]:
        """Wrap a model call: empty output while tripped; on an error, trip and re-raise it.

        The original exception is re-raised unchanged so the sentinel can classify it; a
        failed reset is logged and retried by ``quarantine``.
        """

        def guarded(*args: P.args, **kwargs: P.kwargs) -> T:
            if self._tripped:
                return empty()
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                try:
                    self.trip(f"{type(exc).__name__}: {exc}")
                except DeviceError as reset_exc:
                    logger.error("local reset after a device error failed: %s", reset_exc)
                raise

        return guarded
