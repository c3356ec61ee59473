"""The control plane's logic, free of HTTP: validate and submit commands, build status,
health and metrics answers from one cluster. ``ftengine.testbed.control.app`` maps it onto routes.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from ftengine.errors import FTEngineError
from ftengine.faults import HealthStatus
from ftengine.testbed.control.ledger import CommandLedger, Spawn, Submission, spawn_thread
from ftengine.testbed.control.messages import (
    REQUESTS_PATH,
    ApplyAccepted,
    Command,
    CommandRecord,
    FaultToleranceResult,
    HealthBody,
    StatusBody,
    decode_request,
    engine_wire,
    validate_request,
)
from ftengine.testbed.control.metrics import ControlMetrics
from ftengine.testbed.control.protocol import ClusterHandle
from ftengine.testbed.control.snapshot import ClusterView, StatusShapeError

logger = logging.getLogger(__name__)


class ControlPlane:
    """Commands, status, health and metrics over one ``ClusterHandle``.

    ``spawn`` starts a background job (a thread by default; tests pass one they drive).
    """

    def __init__(
        self,
        cluster: ClusterHandle,
        *,
        metrics: ControlMetrics | None = None,
        spawn: Spawn = spawn_thread,
    ) -> None:
        self.cluster = cluster
        self.metrics = metrics if metrics is not None else ControlMetrics()
        self.ledger = CommandLedger(self._execute, spawn=spawn, on_done=self._command_done)

    def view(self) -> ClusterView:
        """A typed snapshot of the cluster's status."""
        return ClusterView.from_status(self.cluster.status())

    def submit(self, body: bytes) -> tuple[int, msgspec.Struct]:
        """Validate an apply body and start it; returns (HTTP status, answer body).

        202 with ``ApplyAccepted`` for a new or still-running command, 200 with the recorded
        ``FaultToleranceResult`` for a replay of a finished one. Raises ``InvalidCommand``
        (bad input) or ``CommandConflict``; in both cases nothing was started.
        """
        request = decode_request(body)
        # vLLM makes every request id; a client's own id (ftengine's extension) allows replay.
        request_id = request.request_id or str(uuid.uuid4())
        view = self.view()
        known = self.ledger.lookup(request_id) is not None
        # A replay is compared with what was recorded, not re-judged against today's state.
        removed = frozenset() if known else view.removed_ranks
        ready = None if known else _ready_ranks(view)
        command = validate_request(
            request, request_id, world_size=view.total_engines, removed=removed, ready=ready
        )
        submission = self.ledger.submit(command)
        if submission.result is not None:
            return 200, submission.result
        return 202, ApplyAccepted(
            request_id=command.request_id,
            state="running" if submission.replayed else "accepted",
            result_url=f"{REQUESTS_PATH}/{command.request_id}",
        )

    def record(self, request_id: str) -> CommandRecord | None:
        """The recorded command for ``request_id`` (None if unknown)."""
        submission = self.ledger.lookup(request_id)
        return None if submission is None else _record(submission)

    def status(self) -> dict[str, Any]:
        """vLLM's status object (``engine_wire``) plus the running command, checked against
        ``StatusBody`` so that what is sent is what the schema documents."""
        raw = dict(self.cluster.status())
        last = self.ledger.last
        try:
            status = {**raw, "engines": [engine_wire(e, last) for e in raw.get("engines") or ()]}
            status["running_request_id"] = self.ledger.running
            msgspec.convert(status, StatusBody)
        except (msgspec.ValidationError, KeyError, TypeError, ValueError) as exc:
            raise StatusShapeError(f"cluster status does not match StatusBody: {exc!r}") from exc
        return status

    def health(self) -> HealthBody:
        """Healthy only when every live engine is HEALTHY and no command is running."""
        running = self.ledger.running
        try:
            view = self.view()
        except FTEngineError as exc:
            detail = f"cluster status unavailable: {type(exc).__name__}: {exc}"
            return HealthBody(healthy=False, live_engines=[], unhealthy_engines=[],
                              running_request_id=running, detail=detail)  # fmt: skip
        unhealthy = [engine.id for engine in view.live if engine.status is not HealthStatus.HEALTHY]
        return HealthBody(
            healthy=view.healthy and running is None,
            live_engines=[engine.id for engine in view.live],
            unhealthy_engines=unhealthy,
            running_request_id=running,
        )

    def scrape(self) -> bytes:
        """Prometheus text, brought up to date with the cluster's status first."""
        self.metrics.observe(self.view())
        return self.metrics.render()

    def observe_every(self, interval_s: float) -> Callable[[], None]:
        """Feed metrics from a status poll every ``interval_s`` on a daemon thread, so that no
        fault episode goes unseen between scrapes; returns the function that stops it."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(interval_s):
                try:
                    self.metrics.observe(self.view())
                except FTEngineError:
                    logger.exception("metrics poll failed; retrying in %.2fs", interval_s)

        thread = threading.Thread(target=loop, name="ftengine-metrics", daemon=True)
        thread.start()

        def halt() -> None:
            stop.set()
            thread.join(timeout=5.0)

        return halt

    def _execute(self, command: Command) -> FaultToleranceResult:
        logger.info("running %s %s (request %s)", command.instruction, command.params(),
                    command.request_id)  # fmt: skip
        outcome = self.cluster.apply(command.instruction, command.params(), command.request_id)
        return FaultToleranceResult(
            request_id=command.request_id, success=bool(outcome.success), reason=outcome.reason
        )

    def _command_done(self, command: Command, result: FaultToleranceResult) -> None:
        self.metrics.record_command(command.instruction, result.success)
        logger.info("command %s finished: success=%s reason=%s", command.request_id,
                    result.success, result.reason)  # fmt: skip


def _ready_ranks(view: ClusterView) -> frozenset[int]:
    """Removed ranks some member reports ready to be admitted (``ready_ranks``)."""
    ready: set[int] = set()
    for engine in view.engines:
        ready.update(int(rank) for rank in engine.raw.get("ready_ranks") or ())
    return frozenset(ready)


def _record(submission: Submission) -> CommandRecord:
    command = submission.command
    return CommandRecord(
        request_id=command.request_id,
        instruction=command.instruction,
        params=command.params(),
        state="done" if submission.done else "running",
        result=submission.result,
    )
