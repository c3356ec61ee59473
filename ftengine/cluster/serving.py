"""Continuous batching over the cluster's lockstep steps: requests join and leave between
steps, and each one's tokens are handed out as they come (for streaming).

Every cycle admits waiting requests (each onto the least loaded live rank, where its KV
cache then stays), runs one step in which every running request advances by one token
(its prompt on its first step), hands each request its token, and finishes those that
reached ``max_tokens`` or generated a stop id, dropping their caches. Every live rank runs
every step whatever the mix, and the model computes each request on its own shapes, so a
request's tokens do not depend on what it shares a step with. A failed step (a fault)
aborts every running request; a request a rank rejects fails alone (``error``).
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Protocol

import attrs

from ftengine.cluster.generation import StepResult
from ftengine.cluster.protocol import StepItem
from ftengine.errors import FTEngineError
from ftengine.serving_api import FinishReason, GenerationRequest, Listener, TokenEvent

logger = logging.getLogger(__name__)

SHUTDOWN_REASON = "the server is shutting down"


class ServingUnavailable(FTEngineError, RuntimeError):
    """The serving loop cannot take a request now (closed, or too many waiting)."""


class StepCluster(Protocol):
    """What the loop needs from a cluster (``ftengine.cluster.Cluster`` has it)."""

    def serving_ranks(self) -> tuple[int, ...]:
        """Live ranks when all serve; raises an FTEngineError (RequestAborted) otherwise."""
        ...

    def run_step(self, items: Mapping[int, Sequence[StepItem]]) -> StepResult:
        """One lockstep step; raises an FTEngineError (RequestAborted) when it failed."""
        ...

    def release(self, rank: int, request_ids: Sequence[str]) -> None:
        """Drop these requests' caches on ``rank`` with its next step."""
        ...


@attrs.define(eq=False)
class _Running:
    """One request inside the loop: where it runs and what it generated so far."""

    request_id: str
    request: GenerationRequest
    listener: Listener
    rank: int | None = None
    generated: list[int] = attrs.field(factory=list)
    cancelled: bool = False

    def item(self) -> StepItem:
        tokens = self.request.prompt_token_ids if not self.generated else (self.generated[-1],)
        return StepItem(self.request_id, tokens)

    def advance(self, token: int) -> TokenEvent:
        """Take one generated token; the event says whether that finished the request."""
        self.generated.append(token)
        if token in self.request.stop_token_ids:
            return TokenEvent((token,), FinishReason.STOP, stop_reason=token)
        if len(self.generated) >= self.request.max_tokens:
            return TokenEvent((token,), FinishReason.LENGTH)
        return TokenEvent((token,))


class Ticket:
    """A submitted request; :meth:`cancel` aborts it (finish ``abort``) before the next step."""

    def __init__(self, loop: ServingLoop, running: _Running) -> None:
        self._loop = loop
        self._running = running

    def cancel(self) -> None:
        """Abort the request (the client went away); no-op once it finished."""
        self._loop.cancel(self._running)


class ServingLoop:
    """A thread that serves submitted requests with continuous batching on ``cluster``.

    At most ``max_running`` requests share a step; up to ``max_waiting`` more queue.
    """

    def __init__(
        self, cluster: StepCluster, *, max_running: int = 256, max_waiting: int = 4096
    ) -> None:
        self._cluster = cluster
        self._max_running = max_running
        self._max_waiting = max_waiting
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Running] = collections.deque()
        self._running: list[_Running] = []  # touched by the loop thread only
        self._ids = itertools.count(1)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ftengine-serving", daemon=True)

    def start(self) -> ServingLoop:
        """Start the loop's thread; returns self."""
        self._thread.start()
        return self

    def close(self, timeout: float = 30.0) -> None:
        """Stop taking requests, abort the ones left (finish ``abort``), join the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, request: GenerationRequest, listener: Listener) -> Ticket:
        """Queue ``request``; ``listener`` then gets its events on the loop's thread.

        Raises RequestAborted when the cluster is not serving now (nothing is queued) and
        ServingUnavailable when the loop is closed or full.
        """
        self._cluster.serving_ranks()  # fail now rather than queue a request bound to abort
        with self._cond:
            if self._closed:
                raise ServingUnavailable("the serving loop is closed (server shutting down)")
            if len(self._waiting) >= self._max_waiting:
                raise ServingUnavailable(
                    f"{len(self._waiting)} requests are already waiting (the limit); retry later"
                )
            running = _Running(f"srv-{next(self._ids)}", request, listener)
            self._waiting.append(running)
            self._cond.notify_all()
        return Ticket(self, running)

    def cancel(self, running: _Running) -> None:
        """Mark ``running`` cancelled; the loop drops it before its next step."""
        with self._cond:
            running.cancelled = True
            self._cond.notify_all()

    # -- the loop thread -------------------------------------------------------------------
    def _run(self) -> None:
        while self._wait_for_work():
            try:
                self._cycle()
            except Exception as exc:
                # A bug must not kill serving: fail what was running, keep the loop alive.
                logger.exception("serving cycle failed")
                self._finish(self._take_all(), FinishReason.ERROR, f"internal error: {exc!r}")
        self._finish(self._take_all(), FinishReason.ABORT, SHUTDOWN_REASON)

    def _wait_for_work(self) -> bool:
        with self._cond:
            while not self._closed and not self._waiting and not self._running:
                self._cond.wait()
            return not self._closed

    def _cycle(self) -> None:
        try:
            ranks = self._cluster.serving_ranks()
        except FTEngineError as exc:
            self._finish(self._take_all(), FinishReason.ABORT, str(exc))
            return
        self._admit(ranks)
        self._drop_cancelled()
        if not self._running:
            return
        items: dict[int, list[StepItem]] = {}
        for running in self._running:
            assert running.rank is not None  # set on admission
            items.setdefault(running.rank, []).append(running.item())
        try:
            result = self._cluster.run_step(items)
        except FTEngineError as exc:
            self._finish(self._take_running(), FinishReason.ABORT, str(exc))
            return
        self._deliver(result)

    def _admit(self, ranks: Sequence[int]) -> None:
        load = collections.Counter({rank: 0 for rank in ranks})
        load.update(r.rank for r in self._running if r.rank is not None and r.rank in load)
        with self._cond:
            while self._waiting and len(self._running) < self._max_running:
                running = self._waiting.popleft()
                running.rank = min(load, key=lambda rank: (load[rank], rank))
                load[running.rank] += 1
                self._running.append(running)

    def _drop_cancelled(self) -> None:
        with self._cond:
            gone = [r for r in (*self._waiting, *self._running) if r.cancelled]
            self._waiting = collections.deque(r for r in self._waiting if not r.cancelled)
            self._running = [r for r in self._running if not r.cancelled]
        self._finish(gone, FinishReason.ABORT, "cancelled (the client went away)")

    def _deliver(self, result: StepResult) -> None:
        still = []
        for running in self._running:
            out = result.outputs.get(running.request_id)
            rejected = result.rejected.get(running.request_id)
            if out is not None:
                event = running.advance(out.next_token)
            else:
                why = rejected or f"rank {running.rank} returned no output for it"
                event = TokenEvent(finish_reason=FinishReason.ERROR, detail=why)
            self._notify(running, event)
            if event.finished:
                self._release(running)
            else:
                still.append(running)
        self._running = still

    def _take_running(self) -> list[_Running]:
        taken, self._running = self._running, []
        return taken

    def _take_all(self) -> list[_Running]:
        with self._cond:
            taken = [*self._running, *self._waiting]
            self._running, self._waiting = [], collections.deque()
        return taken

    def _finish(self, requests: Sequence[_Running], reason: FinishReason, detail: str) -> None:
        for running in requests:
            self._release(running)
            self._notify(running, TokenEvent(finish_reason=reason, detail=detail))

    def _release(self, running: _Running) -> None:
        if running.rank is not None:
            self._cluster.release(running.rank, [running.request_id])

    def _notify(self, running: _Running, event: TokenEvent) -> None:
        try:
            running.listener(event)
        except Exception:
            # A broken listener (its client gone) must not stop the others being served.
            logger.exception("listener of %s failed; cancelling it", running.request_id)
            running.cancelled = True
