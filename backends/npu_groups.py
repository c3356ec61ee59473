"""The process groups ftengine itself owns on an NPU worker, re-created after every reset.

``reinit_process_group(None, rebuild_link=False)`` resumes every HCCL group in place after
a device restart, but a gloo group (ftengine's DP-sync / recovery groups) that timed out
on a dead peer stays broken, so the gloo groups are made again after every reset; a
scale-down rebuilds all of them among the survivors (their membership changes).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Protocol

import attrs

from ftengine.errors import BackendError

logger = logging.getLogger(__name__)


class GroupFactory(Protocol):
    """Creates and destroys process groups (torch.distributed, or a host's own)."""

    def new_group(self, ranks: Sequence[int], *, backend: str, timeout_s: float | None) -> object:
        """A collective call: every member calls it with the same ``ranks`` in the same order."""
        ...

    def destroy_group(self, group: object) -> None:
        """Release ``group``; must not block on a peer (the group may be broken)."""
        ...


class TorchGroupFactory:
    """Groups from ``torch.distributed.new_group`` (global ranks), synchronised among members."""

    def new_group(self, ranks: Sequence[int], *, backend: str, timeout_s: float | None) -> object:
        import torch.distributed as dist

        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        return dist.new_group(
            ranks=list(ranks), backend=backend, timeout=timeout, use_local_synchronization=True
        )

    def destroy_group(self, group: object) -> None:
        import torch.distributed as dist

        try:
            dist.destroy_process_group(group)  # type: ignore[arg-type]
        except (RuntimeError, ValueError) as exc:
            # A group broken by the fault may refuse a clean shutdown; the new one replaces it.
            logger.warning("could not destroy a stale process group: %s", exc)


@attrs.frozen
class GroupSpec:
    """One owned group: its name, torch backend ("gloo" / "hccl") and timeout in seconds."""

    name: str
    backend: str = "gloo"
    timeout_s: float | None = None


class OwnedGroups:
    """The groups ftengine owns among the alive ranks, rebuilt together in registration order.

    ``members`` are global ranks. gloo groups get ``cpu_timeout_s`` (the CPU distributed
    timeout, so a DP-sync collective with a dead peer raises instead of hanging); HCCL
    groups use the HCCL environment timeouts.
    """

    def __init__(
        self,
        factory: GroupFactory,
        members: Sequence[int],
        *,
        cpu_timeout_s: float | None = None,
        epoch: int = 0,
    ) -> None:
        self._factory = factory
        self._members = tuple(sorted(members))
        self._cpu_timeout_s = cpu_timeout_s
        self._epoch = epoch
        self._specs: list[GroupSpec] = []
        self._groups: dict[str, object] = {}
        self._stale = False
        self._lock = threading.Lock()

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def members(self) -> tuple[int, ...]:
        return self._members

    @property
    def stale(self) -> bool:
        """True after a local device reset until the groups are re-created."""
        return self._stale

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self._specs)

    def register(self, name: str, *, backend: str = "gloo") -> object:
        """Create and own a group over the current members (a collective call)."""
        if any(spec.name == name for spec in self._specs):
            raise BackendError(f"a process group named {name!r} is already owned; pick a new name")
        timeout = self._cpu_timeout_s if backend == "gloo" else None
        spec = GroupSpec(name=name, backend=backend, timeout_s=timeout)
        with self._lock:
            group = self._factory.new_group(self._members, backend=backend, timeout_s=timeout)
            self._specs.append(spec)
            self._groups[name] = group
        return group

    def get(self, name: str) -> object:
        """The live group ``name``; raises ``BackendError`` while the groups are stale."""
        with self._lock:
            if self._stale:
                raise BackendError(
                    f"process group {name!r} is stale after a device reset; "
                    "wait for the recovery to re-create the groups"
                )
            if name not in self._groups:
                raise BackendError(f"no owned process group {name!r}; owned: {self.names}")
            return self._groups[name]

    def mark_stale(self) -> None:
        """The device was reset locally: no group may be used until re-created."""
        with self._lock:
            self._stale = True

    def recreate(self) -> None:
        """After a device reset: re-create the gloo groups with the same members and epoch;
        the HCCL ones were resumed in place by ``reinit_process_group``."""
        with self._lock:
            for spec in self._specs:
                if spec.backend == "gloo":
                    self._remake(spec)
            self._stale = False

    def _remake(self, spec: GroupSpec) -> None:
        """Destroy ``spec``'s group (if any) and create it over the current members."""
        old = self._groups.pop(spec.name, None)
        if old is not None:
            self._factory.destroy_group(old)
        self._groups[spec.name] = self._factory.new_group(
            self._members, backend=spec.backend, timeout_s=spec.timeout_s
        )

    def rebuild(self, members: Sequence[int], epoch: int) -> None:
        """Destroy every owned group and create it again over ``members`` for ``epoch``."""
        with self._lock:
            self._members = tuple(sorted(members))
            self._epoch = epoch
            for spec in self._specs:
                self._remake(spec)
            self._stale = False
        logger.info(
            "owned process groups rebuilt",
            extra={"epoch": epoch, "members": list(self._members), "groups": list(self.names)},
        )
