"""A DP store in reserve, for when the engine core that hosts vLLM's is lost.

vLLM's DP store (the DP board's and every DP-group rebuild's) runs inside one engine core:
DP rank 0's at start, then each rebuilt group's lowest member's (``scale_down.reinit_dp_group``
records which: :data:`STORE_RANK_ATTR`). When that engine core dies with its host, the
survivors would have nowhere to agree on a scale-down or to publish their new group's
ports. So every engine core opens a TCPStore of its own at start (:class:`StandbyStore`,
port chosen by the OS, listening on every interface) and advertises it beside its status
on the board, which every peer caches (``dp_board.StatusBoard.standbys``). The lowest
survivor's then takes the lost one's place, by one rule every survivor computes alike from
what it knows (:func:`stand_in`):

- the **board** moves to it once the probes take the store's host rank for gone
  (``agent.gone``: its port closed, or silent on the side that keeps the majority);
- a **rebuild** that leaves the store's host rank out publishes its keys on the lowest
  member's standby store (the group it forms then hosts its own store, as always).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

logger = logging.getLogger(__name__)

STORE_RANK_ATTR = "_ftengine_store_rank"
"""On ``EngineCoreSentinel``: the original DP rank whose engine core hosts ``engine.dp_store``
(0 until a rebuild, then the lowest member of the group last rebuilt)."""
BOARD_TIMEOUT_S = 2.0
"""A board call on a standby store (connect included) fails after this: the agent thread
must not wait in one for the rendezvous timeout."""


SERVER_TIMEOUT_S = 30.0
"""The standby server's own timeout (its constructor connects a client of its own)."""


class StandbyUnknown(RuntimeError):
    """The standby store a rule picked was never advertised on the board (its engine core
    never published, or published before it had one)."""


class StandbyStore:
    """This engine core's store in reserve (the server lives as long as the process) and
    the clients it opened to its peers' (one per address, reused)."""

    def __init__(self, host: str) -> None:
        import torch.distributed

        dist: Any = torch.distributed  # (its stubs do not export TCPStore)
        self.server = dist.TCPStore(  # (its own client's connect waits SERVER_TIMEOUT_S)
            host, 0, is_master=True, wait_for_workers=False, timeout=_seconds(SERVER_TIMEOUT_S)
        )
        self.address = (host, int(self.server.port))
        self._clients: dict[tuple[str, int], Any] = {}

    def client(self, address: tuple[str, int]) -> Any:
        """A client of the standby store at ``address`` for the board (bounded calls)."""
        found = self._clients.get(address)
        if found is None:
            found = connect(address, BOARD_TIMEOUT_S)
            self._clients[address] = found
        return found


def connect(address: tuple[str, int], timeout_s: float) -> Any:
    """A new TCPStore client of ``address`` whose calls fail after ``timeout_s``."""
    import torch.distributed

    dist: Any = torch.distributed
    return dist.TCPStore(
        address[0], address[1], is_master=False, timeout=_seconds(timeout_s),
        wait_for_workers=False,
    )  # fmt: skip


def store_rank(sentinel: Any) -> int:
    """The original DP rank whose engine core hosts ``sentinel.engine.dp_store``."""
    return int(getattr(sentinel, STORE_RANK_ATTR, 0))


def stand_in(
    rank: int,
    members: Iterable[int],
    standbys: Mapping[int, tuple[str, int]],
) -> tuple[int, tuple[str, int]]:
    """The lowest of ``members`` (original DP ranks) and its standby store's address as
    ``standbys`` (this engine's own included) last advertised it; :class:`StandbyUnknown`
    if none of theirs is known (``rank``: this engine, for the message)."""
    lowest = min(members, default=None)
    if lowest is None:
        raise StandbyUnknown(f"engine {rank}: no member left to host the DP store")
    address = standbys.get(lowest)
    if address is None:
        raise StandbyUnknown(
            f"engine {rank}: DP rank {lowest} should host the DP store in place of the one "
            "lost, but its standby store was never read on the DP board"
        )
    return lowest, address


def _seconds(value: float) -> timedelta:
    return timedelta(seconds=value)
