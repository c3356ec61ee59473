"""Real vLLM over several hosts: each host a network namespace with its own address on a
bridge (the CPU test bed's :class:`~ftengine.testbed.cluster.netns.Hosts`), each running
one or more DP ranks' API servers with vLLM's own multi-node flags, and the faults a
multi-host deployment meets, as tools::

    layout = HostLayout.even(dp_size=4, hosts=2)            # ranks 0, 1 | 2, 3
    with MultiHostDeployment.start(config, layout) as spread:
        spread.urls                # ["http://10.x.y.10:8000", ..., "http://10.x.y.11:8003"]
        spread.kill_host(1)        # SIGKILL every process of ranks 2 and 3 at once
        spread.partition([0], [1]) # both sides live, neither reaches the other
        spread.heal()

Each rank's server runs under ``ip netns exec`` in its host's namespace, binds the host's
address, and names rank 0's host as ``--data-parallel-address`` (where vLLM binds the
handshake socket, the DP coordinator's sockets and the DP store: REFERENCE.md section 10).
Its gloo binds the host's link (``GLOO_SOCKET_IFNAME``), vLLM's ``get_ip()`` answers the
host's address (``VLLM_HOST_IP``: a namespace has no default route to guess from), and the
machine's hostname resolves to the host's address inside it (``/etc/netns/<ns>/hosts``,
which ``ip netns exec`` mounts over ``/etc/hosts``). The test process stays in the root
namespace, on the bridge, and reaches every server there.

A partition (:meth:`MultiHostDeployment.partition`) routes each side's addresses into the
other side's loopback: packets between the sides vanish (no error, no reset: what a cut
link looks like to TCP and gloo) while the clients in the root namespace still reach both
sides, so a test sees what each side answers. :meth:`MultiHostDeployment.link_down` takes
one host's whole link down instead (its clients are cut off too).

Teardown, on exit or any failure (``with``, ``atexit``, SIGTERM): every process of the
deployment by process group, then the hosts files, routes, veths, bridge and namespaces
this run made: names carry the run's tag, nothing else is touched.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType

import attrs

from ftengine.errors import ConfigError
from ftengine.testbed.cluster.netns import INNER_IF, Hosts
from ftengine.testbed.cluster.netns import _chain_sigterm as chain_sigterm
from ftengine.testbed.vllm.launcher import DeploymentConfig, VllmDeployment

NETNS_ETC = Path("/etc/netns")


def _layout(_instance: object, attribute: attrs.Attribute[tuple[int, ...]], value: object) -> None:
    if not isinstance(value, tuple) or not value or any(type(n) is not int or n < 1 for n in value):
        raise ConfigError(
            f"{attribute.name} must be a non-empty tuple of ranks per host (each >= 1), "
            f"found {value!r}"
        )


def _ints(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


@attrs.frozen
class HostLayout:
    """How many DP ranks each host runs, in rank order: ``(2, 2)`` puts ranks 0 and 1 on
    host 0 and ranks 2 and 3 on host 1 (rank 0's host holds vLLM's DP coordinator)."""

    ranks_per_host: tuple[int, ...] = attrs.field(converter=_ints, validator=_layout)

    @classmethod
    def even(cls, dp_size: int, hosts: int) -> HostLayout:
        """``dp_size`` ranks over ``hosts`` hosts, the first hosts one more when uneven."""
        if hosts < 1 or dp_size < hosts:
            raise ConfigError(f"need 1 <= hosts <= dp_size, found hosts={hosts} dp={dp_size}")
        base, extra = divmod(dp_size, hosts)
        return cls(tuple(base + (1 if h < extra else 0) for h in range(hosts)))

    @classmethod
    def parse(cls, text: str) -> HostLayout:
        """``"2,1,1"``: ranks per host."""
        try:
            return cls(tuple(int(part) for part in text.split(",")))
        except ValueError as exc:
            raise ConfigError(f"a layout is ranks per host, e.g. '2,2', found {text!r}") from exc

    @property
    def dp_size(self) -> int:
        return sum(self.ranks_per_host)

    @property
    def hosts(self) -> int:
        return len(self.ranks_per_host)

    def host_of(self, rank: int) -> int:
        """The host that runs DP rank ``rank``."""
        if not 0 <= rank < self.dp_size:
            raise ConfigError(f"rank must be in 0..{self.dp_size - 1}, found {rank}")
        first = 0
        for host, count in enumerate(self.ranks_per_host):
            if rank < first + count:
                return host
            first += count
        raise AssertionError("unreachable: rank checked above")

    def ranks_on(self, host: int) -> tuple[int, ...]:
        """The DP ranks host ``host`` runs."""
        if not 0 <= host < self.hosts:
            raise ConfigError(f"host must be in 0..{self.hosts - 1}, found {host}")
        first = sum(self.ranks_per_host[:host])
        return tuple(range(first, first + self.ranks_per_host[host]))


@attrs.frozen
class NamespacePlacement:
    """The launcher's :class:`~ftengine.testbed.vllm.launcher.Placement` for ``layout`` on
    ``hosts`` (one namespace per host)."""

    hosts: Hosts
    layout: HostLayout

    def address(self, rank: int) -> str:
        return self.hosts.address(self.layout.host_of(rank))

    def command(self, rank: int, argv: list[str]) -> list[str]:
        # ip netns exec execs the command (no fork): the pid the launcher sees is the server's
        return ["ip", "netns", "exec", self.hosts.namespaces[self.layout.host_of(rank)], *argv]

    def env(self, rank: int) -> dict[str, str]:
        return {"GLOO_SOCKET_IFNAME": INNER_IF, "VLLM_HOST_IP": self.address(rank)}


class MultiHostDeployment:
    """A started deployment over namespace hosts (use :meth:`start` as a context manager)."""

    def __init__(self, hosts: Hosts, layout: HostLayout) -> None:
        self.hosts = hosts
        self.layout = layout
        self.placement = NamespacePlacement(hosts, layout)
        self.deployment: VllmDeployment | None = None
        self.hosts_files: list[Path] = []
        self.routes: set[tuple[int, int]] = set()  # (on host, to host) routed into loopback
        self.down: set[int] = set()
        self.killed: set[int] = set()

    @classmethod
    def start(cls, config: DeploymentConfig, layout: HostLayout) -> MultiHostDeployment:
        """Make the hosts, start every rank on its host, wait until all are healthy; on any
        failure undo everything made and re-raise."""
        if config.dp_size != layout.dp_size:
            raise ConfigError(
                f"the layout places {layout.dp_size} ranks, the config has dp_size {config.dp_size}"
            )
        spread = cls(Hosts(layout.hosts), layout)
        atexit.register(spread.stop)
        chain_sigterm(spread.stop)  # processes first, then the hosts (Hosts' own handler)
        try:
            spread.hosts.create()
            spread._write_hosts_files()
            spread.deployment = VllmDeployment.start(config, spread.placement)
        except BaseException:
            spread.stop()
            raise
        return spread

    # -- where things are --------------------------------------------------------------

    @property
    def started(self) -> VllmDeployment:
        if self.deployment is None:
            raise ConfigError("the deployment has not started (or failed to)")
        return self.deployment

    @property
    def urls(self) -> list[str]:
        return self.started.urls

    def address(self, host: int) -> str:
        return self.hosts.address(host)

    def describe(self) -> list[str]:
        """One line per host (namespace, address, link) and per rank (URL, pids)."""
        lines = [f"bridge {self.hosts.bridge} {self.hosts.host}/24 (clients, root namespace)"]
        for host in range(self.layout.hosts):
            lines.append(
                f"host {host}: netns {self.hosts.namespaces[host]} {self.address(host)} "
                f"link {self.hosts.veth(host)} ranks {list(self.layout.ranks_on(host))}"
                + ("  (DP coordinator, DP store, handshake)" if host == 0 else "")
            )
        pids = self.started.pids()
        for rank in sorted(pids):
            lines.append(
                f"  rank {rank} on host {self.layout.host_of(rank)}: {self.urls[rank]}  pids "
                + " ".join(f"{role}={pid}" for role, pid in sorted(pids[rank].items()))
            )
        return lines

    # -- faults ------------------------------------------------------------------------

    def kill_host(self, host: int) -> float:
        """SIGKILL every process of every rank on ``host`` (API servers, engine cores,
        workers, by process group), one right after the other; the monotonic time of the
        first signal."""
        at = time.monotonic()
        for rank in self.layout.ranks_on(host):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.started.ranks[rank].process.pid, signal.SIGKILL)
        self.killed.add(host)
        return at

    def partition(self, side_a: Iterable[int], side_b: Iterable[int]) -> float:
        """Cut every path between the hosts of ``side_a`` and those of ``side_b`` (both
        keep running and keep their clients); the monotonic time the cut was complete."""
        a, b = sorted(set(side_a)), sorted(set(side_b))
        if set(a) & set(b) or not a or not b:
            raise ConfigError(f"a partition needs two disjoint non-empty sides, found {a} | {b}")
        for here, there in [(h, t) for h in a for t in b] + [(h, t) for h in b for t in a]:
            self._route(here, there, "add")
        return time.monotonic()

    def heal(self) -> None:
        """Undo every :meth:`partition` and :meth:`link_down`."""
        for here, there in sorted(self.routes):
            self._route(here, there, "del")
        for host in sorted(self.down):
            self.link_up(host)

    def link_down(self, host: int) -> float:
        """Take ``host``'s link down (its clients cannot reach it either)."""
        self.hosts.cut(host)
        self.down.add(host)
        return time.monotonic()

    def link_up(self, host: int) -> None:
        self.hosts.heal(host)
        self.down.discard(host)

    def _route(self, here: int, there: int, verb: str) -> None:
        ns = self.hosts.namespaces[here]
        _run(["ip", "-n", ns, "route", verb, f"{self.address(there)}/32", "dev", "lo"])
        if verb == "add":
            self.routes.add((here, there))
        else:
            self.routes.discard((here, there))

    # -- set-up and teardown -----------------------------------------------------------

    def _write_hosts_files(self) -> None:
        """Inside each host the machine's hostname is that host's address (gloo and
        torch's stores resolve it; the namespaces share one UTS name)."""
        name = socket.gethostname()
        for host, ns in enumerate(self.hosts.namespaces):
            folder = NETNS_ETC / ns
            folder.mkdir(parents=True, exist_ok=False)  # the run's own tag: never there
            self.hosts_files.append(folder)
            (folder / "hosts").write_text(f"127.0.0.1 localhost\n{self.address(host)} {name}\n")

    def stop(self) -> None:
        """Stop every process, then remove every file, route and link this run made
        (idempotent; never raises for what is already gone)."""
        deployment, self.deployment = self.deployment, None
        try:
            if deployment is not None:
                deployment.stop()
        finally:
            for folder in self.hosts_files:
                shutil.rmtree(folder, ignore_errors=True)
            self.hosts_files.clear()
            self.routes.clear()  # they live in the namespaces, which go next
            self.hosts.close()

    def __enter__(self) -> MultiHostDeployment:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _run(argv: Sequence[str]) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ConfigError(f"{' '.join(argv)!r} failed ({done.returncode}): {done.stderr.strip()}")


def leftovers(tag: str) -> list[str]:
    """Links, namespaces and ``/etc/netns`` folders whose names carry ``tag`` (a clean
    teardown leaves none)."""
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found = [line for line in (links + spaces).splitlines() if tag in line]
    if NETNS_ETC.is_dir():
        found += [str(p) for p in NETNS_ETC.iterdir() if tag in p.name]
    return found
