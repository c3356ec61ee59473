"""The engine cores' statuses on vLLM's DP store (a TCPStore hosted by DP rank 0), kept
cheap: the agent ticks every ``BEAT_S``, reads its peers every ``PEER_READ_S`` (one round
trip), and writes only when its status changes or every ``PUBLISH_S`` (the beat count that
tells peers it lives). News does not wait for a read: an engine whose status changes rings
each peer's :class:`Doorbell` (a UDP datagram), which wakes that peer's agent to read now.
An :class:`Entry` carries, beside the status and epoch, the recovery the engine's policy
proposes (``agreement``) and the rank its current fault points at."""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
from collections.abc import Iterable
from typing import Any

import attrs

from ftengine.integrations.vllm.engine_core.agreement import Proposal

BEAT_S = 0.05  # the agent's tick: its worker's exit and its own status checked
PEER_READ_S = 0.25  # the peers are read this often (a ring: at once); a read every 20 ms
# tick was most of the agent's CPU (docs/notebook.md, "Where the FT overhead goes")
BEAT_ENV = "FTENGINE_VLLM_BEAT_S"
"""Debug knob: the beat interval in seconds (the overhead benchmark's "agent inert" side
sets it to hours, leaving vLLM's FT, the worker sentinel and the per-op timeouts)."""
KEY = "ftengine/engine_status/{rank}"
PUBLISH_S = 1.0  # an unchanged status is written again this often (a change: at once);
# well under the agent's STALE_S, so a live peer is never taken for dead


def beat_interval() -> float:
    """``BEAT_S``, or the positive number of seconds ``FTENGINE_VLLM_BEAT_S`` names."""
    raw = os.environ.get(BEAT_ENV)
    if raw is None:
        return BEAT_S
    try:
        value = float(raw)
    except ValueError as exc:
        raise ValueError(f"{BEAT_ENV}: expected seconds (a number), found {raw!r}") from exc
    if not value > 0:
        raise ValueError(f"{BEAT_ENV}: expected seconds > 0, found {raw!r}")
    return value


class Doorbell:
    """This engine's UDP socket, which peers ring when their status changes: the agent
    sleeps on it between ticks. A lost or unroutable ring only delays the news to the
    next read (``PEER_READ_S``)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("0.0.0.0", 0))  # any interface: a ring carries nothing but "read now"
        self.sock.setblocking(False)
        self.address = (_host_ip(), int(self.sock.getsockname()[1]))

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; whether a peer rang meanwhile (every ring is taken)."""
        if not select.select([self.sock], [], [], seconds)[0]:
            return False
        with contextlib.suppress(OSError):
            while self.sock.recv(64):
                pass
        return True

    def ring(self, addresses: Iterable[tuple[str, int]]) -> None:
        for address in addresses:
            with contextlib.suppress(OSError):  # a peer gone or unreachable: it reads later
                self.sock.sendto(b"!", address)


def _host_ip() -> str:
    """This host's address for the peers (vLLM's ``get_ip``; IPv4 only, else loopback)."""
    from ftengine.integrations.vllm.messages import VllmUnavailable, import_vllm

    try:
        host = str(import_vllm("vllm.utils.network_utils").get_ip())
    except VllmUnavailable:  # no vLLM here (tests): the peers are local
        return "127.0.0.1"
    return host if ":" not in host and host != "0.0.0.0" else "127.0.0.1"


@attrs.frozen
class Entry:
    """What one engine core publishes: its ``status`` (``dead`` once its worker exits), its
    ``epoch``, the recovery its policy ``proposal`` (None: none) and the rank its current
    fault points at (``blame``: its own for a fault of its own making; None: unknown)."""

    status: str
    epoch: int
    proposal: Proposal | None = None
    blame: int | None = None


@attrs.frozen
class PeerStatus:
    """A peer's last :class:`Entry` and its beat count (moves on while it lives)."""

    entry: Entry
    beat: int


class StatusBoard:
    """Engine ``rank``'s (of ``world``) entry on the DP store, and its reads of the others'."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank = rank
        self.world = world
        self.published: Entry | None = None  # last written
        self.published_at = 0.0
        self.published_on: Any = None  # the DP store it was written on
        self.complete: tuple[Any, frozenset[int]] | None = None  # a DP store and the peers
        # that have all published on it (a missing key would block a multi_get)
        self.decoded: dict[int, tuple[bytes, PeerStatus]] = {}
        self.doorbell: tuple[str, int] | None = None  # this engine's, published with it
        self.doorbells: dict[int, tuple[str, int]] = {}  # the peers', as last read
        self.probe: tuple[str, int] | None = None  # this engine's quorum.Reachability
        self.probes: dict[int, tuple[str, int]] = {}  # the peers', as last read
        self.api_url: str | None = None  # this engine's API server, published with it
        self.api_urls: dict[int, str] = {}  # the peers', as last read (a DEAD engine's
        # handoff falls back on them once the survivors' scale-down has closed its store)
        self.standby: tuple[str, int] | None = None  # this engine's standby_store.StandbyStore
        self.standbys: dict[int, tuple[str, int]] = {}  # the peers', as last read
        self.wave: tuple[str, int] | None = None  # this engine's wave_bell.WaveBell
        self.waves: dict[int, tuple[str, int]] = {}  # the peers', as last read

    def publish(self, store: Any, mine: Entry, beat: int, now: float) -> bool:
        """Write this engine's entry when it changes, else every ``PUBLISH_S`` (the beat
        count that tells peers it lives), and at once on a new store (a retry's); whether
        it was news (a change: the peers' doorbells should ring)."""
        fresh = store is self.published_on and now - self.published_at < PUBLISH_S
        if fresh and mine == self.published:
            return False
        value = {
            "status": mine.status,
            "beat": beat,
            "epoch": mine.epoch,
            "doorbell": self.doorbell,
            "probe": self.probe,
            "api_url": self.api_url,
            "standby": self.standby,
            "wave": self.wave,
            "proposal": None if mine.proposal is None else mine.proposal.to_json(),
            "blame": mine.blame,
        }
        store.set(KEY.format(rank=self.rank), json.dumps(value))
        news = mine != self.published
        self.published, self.published_at, self.published_on = mine, now, store
        return news

    def forget(self, ranks: Iterable[int]) -> None:
        """Drop what was read of ``ranks`` (admitted back: a new process, new addresses)."""
        for rank in ranks:
            for known in (
                self.decoded,
                self.doorbells,
                self.probes,
                self.api_urls,
                self.standbys,
                self.waves,
            ):
                known.pop(rank, None)

    def read(self, store: Any, skip: frozenset[int] = frozenset()) -> dict[int, PeerStatus]:
        """Every peer's last status but ``skip``'s (ranks removed: they never publish on the
        survivors' store): one ``multi_get`` once all have published on this store (a
        missing key would block it), one check and get per peer before."""
        keys = {
            r: KEY.format(rank=r) for r in range(self.world) if r != self.rank and r not in skip
        }
        wanted = frozenset(keys)
        if (store, wanted) != self.complete and store.check(list(keys.values())):
            self.complete = (store, wanted)
        if (store, wanted) == self.complete:
            raw = dict(zip(keys, store.multi_get(list(keys.values())), strict=True))
        else:
            raw = {r: store.get(k) for r, k in keys.items() if store.check([k])}
        return {rank: self.decode(rank, value) for rank, value in raw.items()}

    def decode(self, rank: int, raw: bytes) -> PeerStatus:
        """A peer's entry and beat, decoded again only when its bytes changed."""
        cached = self.decoded.get(rank)
        if cached is not None and cached[0] == raw:
            return cached[1]
        value = json.loads(raw)
        blame = value.get("blame")
        entry = Entry(
            status=str(value["status"]),
            epoch=int(value["epoch"]),
            proposal=Proposal.from_json(value.get("proposal")),
            blame=blame if type(blame) is int else None,
        )
        decoded = PeerStatus(entry, int(value["beat"]))
        for field, known in (
            ("doorbell", self.doorbells), ("probe", self.probes),
            ("standby", self.standbys), ("wave", self.waves),
        ):  # fmt: skip
            address = value.get(field)
            if isinstance(address, list) and len(address) == 2:
                known[rank] = (str(address[0]), int(address[1]))
        api_url = value.get("api_url")
        if isinstance(api_url, str) and api_url:
            self.api_urls[rank] = api_url
        self.decoded[rank] = (raw, decoded)
        return decoded
