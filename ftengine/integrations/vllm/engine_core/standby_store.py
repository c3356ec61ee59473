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

Every store call of the agent thread goes through :class:`BoundedStore`: a TCPStore client
whose server stops answering (its host cut off) waits in the call for good, whatever its
timeout says (torch 2.13, measured with a SIGSTOPped server: a ``check`` still waiting
after 60 s with a 2 s timeout), and the agent thread must go on to move the board.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable, Mapping
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
        self._client: tuple[tuple[str, int], BoundedStore] | None = None

    def client(self, address: tuple[str, int]) -> BoundedStore:
        """A client of the standby store at ``address`` for the board (bounded calls; the
        last one reused)."""
        if self._client is None or self._client[0] != address:
            if self._client is not None:
                self._client[1].close()
            self._client = (address, BoundedStore(connect(address, BOARD_TIMEOUT_S)))
        return self._client[1]


class StoreStuck(TimeoutError):
    """A store call did not return within its bound (its server's host cut off, or hung)."""


class BoundedStore:
    """``store``'s ``set``, ``check``, ``get`` and ``multi_get``, each run on this wrapper's
    own daemon thread and waited for at most ``timeout_s``. A call that overruns leaves that
    thread waiting in it and marks the store stuck: every later call raises
    :class:`StoreStuck` at once (a daemon thread: a stuck one never holds up the process's
    exit)."""

    def __init__(self, store: Any, timeout_s: float = BOARD_TIMEOUT_S) -> None:
        self.store = store
        self.timeout_s = timeout_s
        self.stuck: str | None = None
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], _Answer] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._serve, name="ftengine-store", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """No more calls: the thread ends once it is done with any it is in."""
        self._calls.put(None)

    def _serve(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            call, answer = item
            try:
                answer.value = call()
            except BaseException as exc:  # handed to the caller, who raises it
                answer.error = exc
            answer.done.set()

    def _call(self, name: str, call: Callable[[], Any]) -> Any:
        if self.stuck is not None:
            raise StoreStuck(self.stuck)
        answer = _Answer()
        self._calls.put((call, answer))
        if not answer.done.wait(self.timeout_s):
            self.stuck = f"the store's {name} did not return within {self.timeout_s:g} s"
            raise StoreStuck(self.stuck)
        if answer.error is not None:
            raise answer.error
        return answer.value

    def set(self, key: str, value: str | bytes) -> None:
        self._call("set", lambda: self.store.set(key, value))

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", lambda: self.store.check(keys)))

    def get(self, key: str) -> bytes:
        value: bytes = self._call("get", lambda: self.store.get(key))
        return value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values: list[bytes] = self._call("multi_get", lambda: self.store.multi_get(keys))
        return values


class _Answer:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


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
