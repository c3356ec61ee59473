"""Who keeps serving when the DP ranks cannot all reach each other (docs/design-partitions.md).

**The rule** (:func:`keeps_serving`, a pure function every engine core evaluates alone):
the live ranks are the members (original DP ranks not removed by a scale-down) less those
proven dead (their host answered that the engine core's port is closed, or the rank itself
published ``dead``). An engine keeps serving only while the live ranks it reaches, itself
included, are a strict majority of the live ranks, or exactly half of them holding the
lowest live rank. Two sides of a clean partition can never both pass: each counts the other
side's ranks as live (it cannot prove them dead across the cut), so two strict majorities
would need more ranks than there are, and at an exact half both see the same live set and
only one holds its lowest rank.

**Reachability** (:class:`Reachability`) is measured apart from vLLM's DP store (whose host
may be on the other side): each engine core answers UDP probes on a port of its own and
probes each peer every ``PROBE_S`` through a connected socket. An answer makes the peer
reachable until ``MISSES`` probes sent over at least ``SILENT_S`` go unanswered (so a
probing thread starved of CPU takes no one for cut off); "connection refused" (the peer's
host answered, its port is closed: the process is gone) proves it dead at once; silence is
a cut (or a host gone whole): the peer is unreachable, and whether this side may serve is
the rule's to say.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping

import attrs

from ftengine.validators import rank_set, to_ranks

logger = logging.getLogger(__name__)

PROBE_S = 0.1  # each peer is probed this often
SILENT_S = 3.0  # no answer this long to at least MISSES probes: unreachable
MISSES = 20  # probes this engine actually sent meanwhile: a thread of ours that was starved
# of CPU (seen for ~1 s, and longer, on a loaded 2-core machine) judges no one silent
PING, PONG = b"?", b"="
PARTITION = "network partition"
"""How the minority's reason begins (its status, its 503s, the requests it ended)."""
HEALS = "it rejoins by itself once the link heals"
"""What a minority parked for the link adds to its reason (``minority.py``): its server is
not to be restarted."""


@attrs.frozen
class Sight:
    """What one engine core sees now: the ``members`` (original DP ranks not removed),
    those it ``reaches`` (itself included) and those ``dead`` (proven)."""

    rank: int
    members: frozenset[int] = attrs.field(converter=to_ranks, validator=rank_set())
    reaches: frozenset[int] = attrs.field(converter=to_ranks, validator=rank_set())
    dead: frozenset[int] = attrs.field(
        default=frozenset(), converter=to_ranks, validator=rank_set()
    )

    @property
    def live(self) -> frozenset[int]:
        return self.members - self.dead

    @property
    def side(self) -> frozenset[int]:
        """The live ranks this engine reaches (itself among them)."""
        return (self.reaches | {self.rank}) & self.live


def keeps_serving(sight: Sight) -> bool:
    """The majority rule: a strict majority of the live ranks, or exactly half holding
    the lowest live rank. An engine that is not live itself never serves."""
    live, side = sight.live, sight.side
    if sight.rank not in live:
        return False
    if 2 * len(side) > len(live):
        return True
    return 2 * len(side) == len(live) and min(live) in side


def explain(sight: Sight) -> str:
    """Why this side stops (for the engine's status, its 503s and its ended requests)."""
    return (
        f"{PARTITION}: engine {sight.rank} reaches live DP ranks "
        f"{sorted(sight.side)} of {sorted(sight.live)}, not a majority"
        + (
            f" (an even split goes to the side holding rank {min(sight.live)})"
            if sight.live
            else ""
        )
        + "; the majority side serves"
    )


class Reachability:
    """Engine ``rank``'s probes of its peers (own UDP socket on every interface, advertised
    as ``host``), driven by :meth:`step` (the caller's thread) or a thread of its own
    (:meth:`start`); give it the peers' probe addresses with :meth:`know` as they are
    learnt."""

    def __init__(self, rank: int, host: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.rank = rank
        self.clock = clock
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.setblocking(False)
        self.address = (host, int(self.sock.getsockname()[1]))
        self._probes: dict[int, socket.socket] = {}
        self._heard: dict[int, float] = {}
        self._missed: dict[int, int] = {}  # probes sent since the last answer
        self._refused: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._next_probe = 0.0  # monotonic
        self.thread = threading.Thread(target=self._run, name="ftengine-reach", daemon=True)

    def start(self) -> Reachability:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def know(self, peers: Mapping[int, tuple[str, int]]) -> None:
        """Probe these peers (rank -> address) from now on (a known peer is kept)."""
        with self._lock:
            for rank, address in peers.items():
                if rank == self.rank or rank in self._probes:
                    continue
                probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                probe.setblocking(False)
                probe.connect(address)  # connected: a closed port comes back as ECONNREFUSED
                self._probes[rank] = probe
                self._heard[rank] = self.clock()  # reachable until shown otherwise
                self._missed[rank] = 0

    def forget(self, ranks: Iterable[int]) -> None:
        """Stop probing ``ranks`` and drop what was heard of them (a rank admitted back runs
        a new process on a new port: its old address is closed, not the rank dead)."""
        with self._lock:
            for rank in ranks:
                probe = self._probes.pop(rank, None)
                if probe is not None:
                    probe.close()
                self._heard.pop(rank, None)
                self._missed.pop(rank, None)
                self._refused.discard(rank)

    @property
    def known(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._probes)

    def reaches(self) -> frozenset[int]:
        """The peers not silent (never one proven dead): silent is ``MISSES`` probes
        unanswered over at least ``SILENT_S``."""
        now = self.clock()
        with self._lock:
            return frozenset(
                r
                for r, at in self._heard.items()
                if (now - at <= SILENT_S or self._missed[r] < MISSES) and r not in self._refused
            )

    def refused(self) -> frozenset[int]:
        """The peers proven dead (their port is closed)."""
        with self._lock:
            return frozenset(self._refused)

    def _run(self) -> None:
        """Standalone (:meth:`start`): :meth:`step` every half probe interval. The engine-core
        agent calls :meth:`step` from its watch thread instead (one wake-up for both)."""
        while not self._stop.wait(PROBE_S / 2):
            self.step()
        self.close()

    def close(self) -> None:
        self.sock.close()
        with self._lock:
            for probe in self._probes.values():
                probe.close()

    def step(self) -> None:
        """Take what arrived since the last step (answer pings, hear answers, note closed
        ports), then probe every peer if ``PROBE_S`` has passed. No blocking call, no wait:
        what arrives between steps waits in the sockets (an answer heard a step late is
        well within ``SILENT_S``), so the caller's thread wakes only on its own beat."""
        try:
            self._drain()
            now = time.monotonic()  # pacing; ``clock`` dates what was heard
            if now >= self._next_probe:
                self._send()
                self._next_probe = now + PROBE_S
        except Exception:  # a prober that died would make this engine look cut off
            logger.exception("[FT] engine %d: probe round failed", self.rank)

    def _drain(self) -> None:
        with self._lock:
            probes = dict(self._probes)
        ready = select.select([self.sock, *probes.values()], [], [], 0)[0]
        for sock in ready:
            if sock is self.sock:
                self._answer()
            else:
                rank = next(r for r, s in probes.items() if s is sock)
                self._hear(rank, sock)

    def _send(self) -> None:
        with self._lock:
            probes = [(r, s) for r, s in self._probes.items() if r not in self._refused]
        for rank, probe in probes:
            try:
                probe.send(PING)
                with self._lock:
                    self._missed[rank] += 1
            except OSError as exc:
                self._failed(rank, exc)

    def _answer(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                data, sender = self.sock.recvfrom(16)
                if data == PING:
                    self.sock.sendto(PONG, sender)

    def _hear(self, rank: int, probe: socket.socket) -> None:
        try:
            while probe.recv(16):
                with self._lock:
                    self._heard[rank] = self.clock()
                    self._missed[rank] = 0
        except BlockingIOError:
            return
        except OSError as exc:
            self._failed(rank, exc)

    def _failed(self, rank: int, exc: OSError) -> None:
        if exc.errno == errno.ECONNREFUSED:
            with self._lock:
                if rank not in self._refused:
                    logger.warning(
                        "[FT] engine %d: engine %d's port is closed: dead", self.rank, rank
                    )
                self._refused.add(rank)


def sight(
    rank: int,
    world: int,
    removed: Iterable[int],
    reach: Reachability,
    published_dead: Iterable[int] = (),
) -> Sight:
    """What engine ``rank`` (of ``world``) sees now through ``reach`` and the DP board's
    ``published_dead`` (peers that said ``dead``). Peers it has no address for yet count
    as reached (before the first board read everyone was: the deployment started)."""
    members = frozenset(range(world)) - frozenset(removed)
    unknown = members - reach.known - {rank}
    return Sight(
        rank,
        members,
        reach.reaches() | unknown | {rank},
        (reach.refused() | frozenset(published_dead)) & members,
    )
