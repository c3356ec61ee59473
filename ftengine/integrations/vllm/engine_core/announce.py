"""A restarted rank, once ready, tells the survivors so, and joins when they admit it
(issue 28: under a policy that admits ready ranks, ``auto``, no ``scale_up`` is needed).

DP rank 0's rejoin responder handed the returning engine core rank 0's API server URL
(``rejoin_flag.RANK0_URL_KEY``). From start-up on, :class:`Announcer` (a thread of the
returning engine core) reads the survivors' current DP store from that server's
``/fault_tolerance/status`` (``dp_store``), writes this rank's join key there (again on each
new store: a survivor's recovery moves it), and watches for the lowest survivor's admission
key. The survivors' agents see the join key at their next peer read and ask their policy
(``admission.offer``); once every member votes for the rank at a DP sync, they admit it and
publish the admission key, and the announcer hands the busy loop the join
(``admission.join``) as a ``scale_up`` command would. Under a policy that does not admit on
its own (``orchestrator``), the join key only waits for the operator's ``scale_up``.

What it cannot do: rank 0's server must be up and its engine a healthy member (the status
names the store of its group); otherwise the rank waits for a ``scale_up`` with ``dp_store``.
DP rank 0 itself, relaunched in place (``relaunch.py``), reads the survivors' servers instead
(their URLs as its DP board last read them).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import httpx

from ftengine.integrations.vllm.engine_core.admission import (
    ADMISSION_ATTR,
    DP_STORE_KEY,
    Admission,
    admit_key,
    join_key,
    parse_store,
    policy_request_id,
    survivors_store,
    wake,
)
from ftengine.integrations.vllm.messages import deployment_api_key
from ftengine.integrations.vllm.rejoin_flag import rank0_url, rejoining

logger = logging.getLogger(__name__)

STATUS_PATH = "/fault_tolerance/status"
ANNOUNCE_S = 0.25  # how often the store is checked (and rank 0's status read)
STORE_TIMEOUT_S = 5.0
JOIN_WAIT_S = 120.0  # the busy loop's join is bounded by the DP group's timeout before this


def survivors_dp_store(
    http: httpx.Client, urls: Sequence[str], headers: dict[str, str]
) -> str | None:
    """The ``dp_store`` of the first healthy engine the servers at ``urls`` report (asked in
    turn; one that fails is skipped, the last failure raised when none answered), or None."""
    failure: Exception | None = None
    for url in urls:
        try:
            engines = http.get(f"{url}{STATUS_PATH}", headers=headers).json().get("engines", [])
        except (httpx.HTTPError, ValueError) as exc:
            failure = exc
            continue
        failure = None
        for engine in engines:
            store = engine.get(DP_STORE_KEY) if isinstance(engine, dict) else None
            if engine.get("status") == "healthy" and isinstance(store, str) and store:
                return store
    if failure is not None:
        raise failure
    return None


class Announcer:
    """The returning rank's announcement loop (a daemon thread; :meth:`stop`)."""

    def __init__(
        self,
        sentinel: Any,
        urls: Sequence[str],
        http: httpx.Client | None = None,
        connect: Callable[[str, int, timedelta], Any] = survivors_store,
    ) -> None:
        self.sentinel = sentinel
        self.urls = tuple(urls)  # rank 0's server; the survivors' for rank 0 itself
        self.rank = int(sentinel.engine.vllm_config.parallel_config.data_parallel_rank)
        self.http = http or httpx.Client(timeout=STORE_TIMEOUT_S)
        self.connect = connect
        key = deployment_api_key()
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.store: Any = None
        self.at: str | None = None  # the store this rank's join key is on
        self.problem: str | None = None  # the last failure, logged once
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ftengine-announce", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    @property
    def waiting(self) -> bool:
        parallel = self.sentinel.engine.vllm_config.parallel_config
        return not self._stop.is_set() and rejoining(parallel)

    def _run(self) -> None:
        while self.waiting:
            try:
                self.step()
                self.problem = None
            except Exception as exc:  # rank 0 restarting, a store moving: try again
                problem = f"{type(exc).__name__}: {exc}"
                if problem != self.problem:
                    logger.info("[FT] engine %d: not announced yet (%s)", self.rank, problem)
                self.problem = problem
                self.at = None
            self._stop.wait(ANNOUNCE_S)
        self.http.close()

    def step(self) -> None:
        """Once: announce on the survivors' current store; join if they admitted this rank."""
        found = survivors_dp_store(self.http, self.urls, self.headers)
        if found is None:
            where = ", ".join(f"{url}{STATUS_PATH}" for url in self.urls) or "no server known"
            raise LookupError(f"{where}: no healthy engine's {DP_STORE_KEY!r}")
        if found != self.at:
            host, port = parse_store(found)
            self.store = self.connect(host, port, timedelta(seconds=STORE_TIMEOUT_S))
            self.store.set(join_key(self.rank), b"1")
            self.at = found
            logger.info(
                "[FT] engine %d is ready: announced on the survivors' DP store %s (their "
                "policy admits it, or a scale_up does)", self.rank, found,
            )  # fmt: skip
        if self.store.check([admit_key(self.rank)]):
            self._join(found)

    def _join(self, store: str) -> None:
        """Hand the busy loop the join (unless a ``scale_up``'s is under way) and wait."""
        admission = getattr(self.sentinel, ADMISSION_ATTR, None)
        mine = admission is None
        if admission is None:
            admission = Admission(frozenset({self.rank}), policy_request_id(), parse_store(store))
            setattr(self.sentinel, ADMISSION_ATTR, admission)
        wake(self.sentinel)
        try:
            admission.done.result(timeout=JOIN_WAIT_S)
        except Exception as exc:  # the join says why (NotAdmitted: still ready)
            logger.warning("[FT] engine %d: the admission failed: %s", self.rank, exc)
        finally:
            if mine and getattr(self.sentinel, ADMISSION_ATTR, None) is admission:
                setattr(self.sentinel, ADMISSION_ATTR, None)


def start_announcing(sentinel: Any, urls: Sequence[str] = ()) -> Announcer | None:
    """A returning rank's :class:`Announcer`, started: it reads the survivors' store from
    ``urls`` (DP rank 0's relaunched engine core: the survivors' servers) or else from rank
    0's server (a restarted rank whose handshake named it); None without either."""
    parallel = sentinel.engine.vllm_config.parallel_config
    url = rank0_url(parallel)
    if not urls and url is not None:
        urls = (url,)
    if not rejoining(parallel) or not urls:
        return None
    announcer = Announcer(sentinel, urls)
    announcer.start()
    return announcer
