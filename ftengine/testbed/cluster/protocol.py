"""Messages between the supervisor and its workers (pickled over a multiprocessing Pipe).

Supervisor -> worker: :class:`StepRequest`, :class:`FtCommand`, :class:`PeerFault`,
:class:`Shutdown`, :class:`Inject`, :class:`RankReady`. Worker -> supervisor: :class:`Ready`,
:class:`Heartbeat`, :class:`StatusUpdate`, :class:`PhaseEvent`, :class:`StepReply` (with
:class:`ItemRejected`), :class:`FtReply`, :class:`WorkerFailed`. All are frozen attrs
values; tensors travel as lists of floats.
:class:`Link` is the worker's end of the pipe.
"""

from __future__ import annotations

import threading
from multiprocessing.connection import Connection
from typing import Any

import attrs

from ftengine.faults import FaultKind
from ftengine.testbed.cluster.faults_inject import FaultSpec


@attrs.frozen
class StepItem:
    """One request's input for a step on its DP rank.

    ``token_ids`` are the new tokens (the whole prompt on the first step, then the
    previous output); ``want_logits`` asks for this step's last-token logits back.
    ``start``, when set, is how many tokens the request's KV cache must already hold (a
    resumed request's check): a rank whose cache holds another count rejects the item
    with ``cache_lost`` instead of computing on the wrong cache.
    """

    request_id: str
    token_ids: tuple[int, ...]
    want_logits: bool = False
    start: int | None = None


@attrs.frozen
class StepRequest:
    """Run model step ``step`` (the same on every rank) for ``items`` (may be empty)."""

    step: int
    items: tuple[StepItem, ...] = ()
    release: tuple[str, ...] = ()  # finished or aborted request ids whose caches to drop


@attrs.frozen
class StepOutput:
    """One request's greedy next token and, if asked, the logits it came from."""

    request_id: str
    next_token: int
    logits: tuple[float, ...] | None = None


@attrs.frozen
class ItemRejected:
    """A request this rank could not compute in a step (its own content is at fault): it
    alone fails, while the step runs for the rest of the batch."""

    request_id: str
    reason: str
    cache_lost: bool = False  # not the request's fault: its KV cache is gone, recompute it


@attrs.frozen
class StepReply:
    """A worker's answer to a step: outputs (and requests it rejected), or the error that
    stopped it."""

    rank: int
    step: int
    outputs: tuple[StepOutput, ...] = ()
    error: str | None = None
    error_type: str | None = None
    rejected: tuple[ItemRejected, ...] = ()


@attrs.frozen
class FtCommand:
    """An orchestrator command relayed to a worker's sentinel."""

    instruction: str
    params: dict[str, Any]
    request_id: str


@attrs.frozen
class FtReply:
    """A worker's CommandResult for one :class:`FtCommand`."""

    rank: int
    request_id: str
    success: bool
    reason: str | None


@attrs.frozen
class RankReady:
    """Removed ``ranks`` whose returning worker loaded and waits (the whole set); sent to
    every member at a step boundary. The member notes them, lets its policy admit them at
    once (its ``poll``), and answers with an :class:`FtReply` for ``request_id``."""

    ranks: tuple[int, ...]
    request_id: str


@attrs.frozen
class PeerFault:
    """The supervisor's verdict on a fault: peer ``rank`` died (its process exited or was
    fenced), or a step failed while every rank stayed alive (``TRANSIENT``; ``rank`` is the
    rank that raised, None if none did)."""

    kind: FaultKind
    rank: int | None
    info: str


@attrs.frozen
class Inject:
    """Arm this fault on the worker now (a chaos campaign's runtime injection; the launch-time
    ``ClusterConfig.inject_fault`` arms one at start)."""

    spec: FaultSpec


@attrs.frozen
class Shutdown:
    """Leave the main loop and exit."""


@attrs.frozen
class Ready:
    """The worker loaded its weights and joined the epoch-0 group."""

    rank: int
    pid: int


@attrs.frozen
class Heartbeat:
    """Sent every ``heartbeat_s`` by a worker thread; ``at`` is the worker's monotonic time."""

    rank: int
    at: float


@attrs.frozen
class StatusUpdate:
    """The worker engine's ``EngineStatus.to_dict()``, sent whenever it changes."""

    rank: int
    status: dict[str, Any]


@attrs.frozen
class PhaseEvent:
    """One phase change of the worker's engine (monotonic ``at``, comparable across processes)."""

    rank: int
    source: str
    dest: str
    at: float
    reason: str


@attrs.frozen
class WorkerFailed:
    """The worker could not start or its main loop crashed; ``error`` says why."""

    rank: int
    error: str


class Link:
    """The worker's end of the supervisor pipe; ``send`` is safe from several threads."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, message: object) -> None:
        with self._lock:
            self.conn.send(message)
