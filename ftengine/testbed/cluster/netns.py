"""Hosts in network namespaces: each worker of a cluster in its own network namespace with
its own address on a bridge this run creates, the supervisor (and its store) in the root
namespace on that bridge, so ``ip link set <veth> down`` cuts one rank off and kills
nothing (:meth:`Hosts.cut`).

Only names this run made are touched: every bridge, veth and namespace carries the run's
unique tag, and :meth:`Hosts.close` removes them all, also when the run fails or is
interrupted (``with``, ``atexit`` and a SIGTERM handler). Needs root and iproute2.

Workers enter their namespace with ``setns(2)`` through ctypes at the top of
``worker_main`` rather than being started under ``ip netns exec``: multiprocessing's spawn
then keeps the supervisor's pipe (an inherited AF_UNIX socket, which no network namespace
affects), ``PR_SET_PDEATHSIG`` and the process tree it watches; the worker is
single-threaded at that point, and every socket and thread it makes afterwards
(TCPStore, gloo, torch's pool) is in the new namespace. In this mode a heartbeat proves
the network path: the worker counts it on the supervisor's store before sending it on the
pipe (:func:`network_beat`), so a cut rank falls silent and the supervisor fences it
(the side with the supervisor and the store serves on; the cut side never serves again).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import ipaddress
import logging
import os
import random
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from types import FrameType

from torch._C._distributed_c10d import TCPStore

from ftengine.errors import ConfigError

logger = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000
INNER_IF = "ftw0"  # the worker-side veth, the same name in every namespace (GLOO_SOCKET_IFNAME)
BEAT_KEY = "ftengine/net-heartbeat"


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ConfigError(
            f"'ip {' '.join(args)}' failed ({done.returncode}): {done.stderr.strip()}"
        )


def _free_subnet(rng: random.Random) -> ipaddress.IPv4Network:
    used = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True, check=False).stdout
    for _ in range(64):
        net = ipaddress.IPv4Network(f"10.{rng.randint(200, 249)}.{rng.randint(0, 255)}.0/24")
        if f"inet {str(net.network_address)[:-1]}" not in used:
            return net
    raise ConfigError("no free 10.200-249.x.0/24 subnet for the cluster's bridge")


class Hosts:
    """``ranks`` network namespaces on one bridge; :meth:`create` makes them."""

    def __init__(self, ranks: int, tag: str | None = None) -> None:
        rng = random.Random()
        self.tag = tag or f"ft{os.getpid() % 1000:03d}{rng.randrange(36**2):03x}"
        if len(self.tag) > 9:
            raise ConfigError(f"netns tag must be <= 9 characters (link names), found {self.tag!r}")
        self.ranks = ranks
        self.subnet = _free_subnet(rng)
        self.bridge = f"{self.tag}br"
        self.namespaces = tuple(f"{self.tag}n{r}" for r in range(ranks))
        self._closed = threading.Lock()
        self._made: list[Callable[[], None]] = []

    @property
    def host(self) -> str:
        """The supervisor's (and the store's) address on the bridge."""
        return str(self.subnet.network_address + 1)

    def address(self, rank: int) -> str:
        """Worker ``rank``'s address."""
        return str(self.subnet.network_address + 10 + rank)

    def veth(self, rank: int) -> str:
        """The root-side end of rank ``rank``'s link (what :meth:`cut` takes down)."""
        return f"{self.tag}h{rank}"

    def create(self) -> Hosts:
        """Make the bridge and one namespace per rank; on any failure undo what was made."""
        atexit.register(self.close)
        _chain_sigterm(self.close)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(lambda: _ip("link", "del", self.bridge))
            _ip("addr", "add", f"{self.host}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for rank in range(self.ranks):
                self._add_rank(rank)
        except BaseException:
            self.close()
            raise
        return self

    def _add_rank(self, rank: int) -> None:
        ns, veth = self.namespaces[rank], self.veth(rank)
        _ip("netns", "add", ns)
        self._made.append(lambda: _ip("netns", "del", ns))  # takes both veth ends with it
        _ip("link", "add", veth, "type", "veth", "peer", "name", INNER_IF, "netns", ns)
        # Deleting the namespace only frees its end once nothing holds the namespace: delete
        # the pair from this side first, so no veth outlives the run.
        self._made.append(lambda: _ip("link", "del", veth))
        _ip("link", "set", veth, "master", self.bridge)
        _ip("link", "set", veth, "up")
        _ip("-n", ns, "addr", "add", f"{self.address(rank)}/24", "dev", INNER_IF)
        _ip("-n", ns, "link", "set", INNER_IF, "up")
        _ip("-n", ns, "link", "set", "lo", "up")

    def cut(self, rank: int) -> None:
        """Take rank ``rank``'s link down: it and its peers can no longer reach each other."""
        _ip("link", "set", self.veth(rank), "down")

    def heal(self, rank: int) -> None:
        """Bring rank ``rank``'s link back up; return once its host answers from the root
        namespace (right after ``ip link set up`` it may still look silent)."""
        _ip("link", "set", self.veth(rank), "up")
        wait_reachable(self.address(rank), HEAL_TIMEOUT_S)

    def close(self) -> None:
        """Remove everything :meth:`create` made, newest first (idempotent, never raises)."""
        if not self._closed.acquire(blocking=False):
            return
        while self._made:
            undo = self._made.pop()
            try:
                undo()
            except ConfigError as exc:
                logger.warning("netns teardown: %s", exc)

    def __enter__(self) -> Hosts:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _chain_sigterm(cleanup: Callable[[], None]) -> None:
    """On SIGTERM run ``cleanup`` first, then whatever handled SIGTERM before (main thread
    only: Python installs handlers nowhere else)."""
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: FrameType | None) -> None:
        cleanup()
        if callable(previous):
            previous(signum, frame)
        else:
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def enter(namespace: str) -> None:
    """Move this process (its calling thread, before it starts any other) into
    ``namespace`` and make gloo use its link; raises ConfigError if the kernel refuses."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise ConfigError(f"setns({namespace}) failed: {os.strerror(errno)}")
    finally:
        os.close(fd)
    os.environ["GLOO_SOCKET_IFNAME"] = INNER_IF


def network_beat(host: str, port: int, rank: int, timeout_s: float) -> Callable[[], bool]:
    """A check run before each heartbeat: count one on the store at ``host:port`` (a round
    trip over the network); False when it did not get through within ``timeout_s``."""
    holder: list[TCPStore] = []

    def beat() -> bool:
        with contextlib.suppress(RuntimeError):
            if not holder:
                holder.append(
                    TCPStore(
                        host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
                    )
                )
            holder[0].add(f"{BEAT_KEY}/{rank}", 1)
            return True
        return False

    return beat


HEAL_TIMEOUT_S = 10.0
PROBE_PORT = 9  # discard: nothing listens there in a host, so an answer is a refusal


def wait_reachable(address: str, timeout_s: float) -> None:
    """Until ``address`` answers from this namespace (a TCP connect refused: the host is
    there); right after a link comes back up the first packets may go unanswered (neighbour
    resolution, the bridge port) and a loaded machine makes that visible. ConfigError after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as probe:
            probe.settimeout(0.2)
            try:
                probe.connect((address, PROBE_PORT))
                return  # something listens: reachable all the same
            except ConnectionRefusedError:
                return
            except OSError:
                pass
        if time.monotonic() >= deadline:
            raise ConfigError(f"{address} still silent {timeout_s:.0f} s after its link came up")
        time.sleep(0.05)
