"""What a campaign's run left behind, on either target: every pid and port its deployments
used is noted, and :meth:`Census.leftovers` lists those still alive (zombies count as gone)
or still listening once the run ended, and what a deployment over namespace hosts left of
its namespaces, links and files when it stopped (``note_network``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import psutil


@attrs.frozen
class Leftovers:
    """What a run left behind: processes still alive, ports still listening, and network
    namespaces, links or hosts files its deployments did not remove."""

    processes: tuple[int, ...]
    ports: tuple[int, ...]
    network: tuple[str, ...] = ()

    @property
    def count(self) -> int:
        return len(self.processes) + len(self.ports) + len(self.network)

    def to_dict(self) -> dict[str, Any]:
        return {
            "processes": list(self.processes),
            "ports": list(self.ports),
            "network": list(self.network),
        }


def listening_here() -> set[int]:
    """TCP ports this process listens on (the CPU cluster's deployment serves in-process)."""
    me = psutil.Process()
    return {c.laddr.port for c in me.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}


def listening_anywhere() -> set[int]:
    """Every TCP port any process on this machine listens on (vLLM's servers are children)."""
    ports = set()
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr:
            ports.add(int(conn.laddr[1]))
    return ports


@attrs.define
class Census:
    """Every pid and port the run's deployments used; :meth:`leftovers` after the run, once
    none is left or after ``grace_s`` (exits take a moment), reading ``listening`` every
    ``poll_s``."""

    listening: Callable[[], set[int]]
    grace_s: float
    poll_s: float
    pids: set[int] = attrs.field(factory=set)
    ports: set[int] = attrs.field(factory=set)
    network: list[str] = attrs.field(factory=list)

    def note(self, pids: Iterable[int], ports: Iterable[int]) -> None:
        self.pids.update(pids)
        self.ports.update(ports)

    def note_network(self, left: Iterable[str]) -> None:
        """What a stopped deployment left of its namespaces, links and files (``ip``'s
        lines naming them)."""
        self.network.extend(left)

    def leftovers(self) -> Leftovers:
        """Processes still alive (zombies count as gone), ports still listening, and what
        :meth:`note_network` was told."""
        found = wait_for_leftovers(self.pids, self.ports, self.listening, self.grace_s, self.poll_s)
        return attrs.evolve(found, network=tuple(self.network))


def wait_for_leftovers(
    pids: Iterable[int],
    ports: Iterable[int],
    listening: Callable[[], set[int]],
    grace_s: float,
    poll_s: float,
) -> Leftovers:
    """Of ``pids`` those still alive (zombies count as gone) and of ``ports`` those still
    in ``listening()``, once none is left or after ``grace_s`` (exits take a moment)."""
    pids, ports = set(pids), set(ports)
    deadline = time.monotonic() + grace_s
    while True:
        alive = tuple(sorted(p for p in pids if _alive(p)))
        bound = tuple(sorted(ports & listening()))
        if not (alive or bound) or time.monotonic() > deadline:
            return Leftovers(alive, bound)
        time.sleep(poll_s)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
