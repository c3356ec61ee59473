"""Where a DEAD engine core finds its survivors' API servers: vLLM's DP store, which every
engine core of the deployment already shares.

Each engine core writes its own server's URL (``API_URL_ENV``, exported by that server:
``api_server/advertised_url.py``) under ``ftengine/api_url/{rank}`` once per store: at
start-up and after each ``retry`` or ``scale_down``, which build a new store. A DEAD one
reads the others' when it hands off its held requests, in ring order from the next rank
on, so several DEAD ranks' requests spread over the survivors. A peer that is itself DEAD
refuses with 503 (``api_server/dead_rank.py``) and the handoff asks the next one.
``ftengine.handoff_urls`` replaces the discovery (:class:`FixedSurvivors`).

The store a DEAD engine core knows can be gone by the time it hands off: vLLM's monitor
may take seconds to see its worker's death, while the survivors' agents see it at once
and their ``scale_down`` replaces the store (the old one's host closes it: "Broken pipe").
The URLs its agent last read on the DP board (``dp_board.StatusBoard.api_urls``, read
every 0.25 s with the peers' statuses) are then used instead: a server's URL does not
change, and one that is DEAD refuses, so the next is asked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import attrs

logger = logging.getLogger(__name__)

KEY = "ftengine/api_url/{rank}"


@attrs.frozen
class FixedSurvivors:
    """The survivors an operator named (``ftengine.handoff_urls``)."""

    urls: tuple[str, ...]

    def __call__(self) -> tuple[str, ...]:
        return self.urls


@attrs.define
class SurvivorDirectory:
    """Engine ``rank`` (of ``world``, original DP ranks) of ``engine`` (vLLM's engine core,
    whose ``dp_store`` is read): its own server's ``own_url`` (None: it publishes none)."""

    engine: Any
    rank: int
    world: int
    own_url: str | None
    published_on: Any = None  # the store own_url was last written on
    last_read: Callable[[], Mapping[int, str]] | None = None  # the board's, when the store fails

    def publish(self) -> None:
        """Write ``own_url`` on the engine's current DP store, once per store (the busy
        loop's fault path calls this too: on a store already written it does no I/O)."""
        store = getattr(self.engine, "dp_store", None)
        if self.own_url is None or store is None or store is self.published_on:
            return
        store.set(KEY.format(rank=self.rank), self.own_url)
        self.published_on = store
        logger.debug("[FT] engine %d published its API server %s", self.rank, self.own_url)

    def __call__(self) -> tuple[str, ...]:
        """The other ranks' published URLs, from the next rank on (never this one's own);
        those last read on the DP board when the store does not answer (none: its error)
        or holds none yet (a scale-down's new store, which a peer killed during that
        scale-down reads before any survivor has written on it)."""
        known = {} if self.last_read is None else dict(self.last_read())
        try:
            found = self._read(self.engine.dp_store)
        except (RuntimeError, OSError, ValueError) as exc:  # torch's DistNetworkError too
            if not known:
                raise
            logger.warning(
                "[FT] engine %d: the DP store did not answer (%s: %s); using the API servers "
                "last read on the DP board",
                self.rank, type(exc).__name__, exc,
            )  # fmt: skip
            return self._ring(known)
        if not self._ring(found) and self._ring(known):
            logger.warning(
                "[FT] engine %d: no API server published on the current DP store yet; using "
                "those last read on the DP board", self.rank,
            )  # fmt: skip
            return self._ring(known)
        return self._ring(found)

    def _read(self, store: Any) -> dict[int, str]:
        found: dict[int, str] = {}
        for rank in range(self.world):
            key = KEY.format(rank=rank)
            if rank != self.rank and store.check([key]):  # (a get of a missing key blocks)
                found[rank] = bytes(store.get(key)).decode()
        return found

    def _ring(self, urls: Mapping[int, str]) -> tuple[str, ...]:
        ordered: list[str] = []
        for step in range(1, self.world):
            url = urls.get((self.rank + step) % self.world)
            if url is not None and url != self.own_url and url not in ordered:
                ordered.append(url)
        return tuple(ordered)
