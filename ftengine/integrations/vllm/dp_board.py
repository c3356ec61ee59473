"""The engine cores' statuses on vLLM's DP store (a TCPStore hosted by DP rank 0), kept
cheap: the agent ticks every ``BEAT_S`` and reads its peers every ``PEER_READ_S`` (one round
trip; at once when it has news of its own), and writes only when its status changes or
every ``PUBLISH_S`` (the beat count that tells peers it lives)."""

from __future__ import annotations

import json
import os
from typing import Any

BEAT_S = 0.02  # the agent's tick: its worker's exit and its own status checked
PEER_READ_S = 0.1  # the peers' statuses are read this often, this engine's news at once:
# a read every tick was most of the agent's CPU, ~2 % of the deployment's at DP=2 (the
# DP store's round trip and its server's wake-up; docs/vllm-dev-notes.md)
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


PeerStatus = tuple[str, int, int]
"""A peer's ``(status, beat, epoch)``."""


class StatusBoard:
    """Engine ``rank``'s (of ``world``) entry on the DP store, and its reads of the others'."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank = rank
        self.world = world
        self.published: tuple[str, int] | None = None  # (status, epoch) last written
        self.published_at = 0.0
        self.published_on: Any = None  # the DP store it was written on
        self.complete_store: Any = None  # the DP store on which every peer has published
        self.decoded: dict[int, tuple[bytes, PeerStatus]] = {}

    def publish(self, store: Any, mine: tuple[str, int], beat: int, now: float) -> None:
        """Write this engine's status when it changes, else every ``PUBLISH_S`` (the beat
        count that tells peers it lives), and at once on a new store (a retry's)."""
        fresh = store is self.published_on and now - self.published_at < PUBLISH_S
        if fresh and mine == self.published:
            return
        status, epoch = mine
        value = json.dumps({"status": status, "beat": beat, "epoch": epoch})
        store.set(KEY.format(rank=self.rank), value)
        self.published, self.published_at, self.published_on = mine, now, store

    def read(self, store: Any) -> dict[int, PeerStatus]:
        """Every peer's last status: one ``multi_get`` once all peers have published on
        this store (a missing key would block it), one check and get per peer before."""
        keys = {r: KEY.format(rank=r) for r in range(self.world) if r != self.rank}
        if store is not self.complete_store and store.check(list(keys.values())):
            self.complete_store = store
        if store is self.complete_store:
            raw = dict(zip(keys, store.multi_get(list(keys.values())), strict=True))
        else:
            raw = {r: store.get(k) for r, k in keys.items() if store.check([k])}
        return {rank: self.decode(rank, value) for rank, value in raw.items()}

    def decode(self, rank: int, raw: bytes) -> PeerStatus:
        """A peer's ``(status, beat, epoch)``, decoded again only when its bytes changed."""
        cached = self.decoded.get(rank)
        if cached is not None and cached[0] == raw:
            return cached[1]
        value = json.loads(raw)
        decoded = (str(value["status"]), int(value["beat"]), int(value["epoch"]))
        self.decoded[rank] = (raw, decoded)
        return decoded
