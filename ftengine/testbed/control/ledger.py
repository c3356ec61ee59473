"""The command ledger: runs one recovery command at a time in the background and remembers
every result by ``request_id``, so a replayed request gets the recorded answer, not a rerun.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

import attrs

from ftengine.errors import FTEngineError
from ftengine.testbed.control.messages import REQUESTS_PATH, Command, FaultToleranceResult

logger = logging.getLogger(__name__)

Execute = Callable[[Command], FaultToleranceResult]
"""Runs one command to the end (blocking) and returns its result."""

Spawn = Callable[[Callable[[], None], str], None]
"""Starts ``job`` in the background; the string names it (a thread name)."""


class CommandConflict(FTEngineError, RuntimeError):
    """A command cannot be accepted now (another runs, or its request_id was used differently)."""


def spawn_thread(job: Callable[[], None], name: str) -> None:
    """The default ``Spawn``: a daemon thread, so a hung recovery cannot block interpreter exit."""
    threading.Thread(target=job, name=name, daemon=True).start()


@attrs.frozen
class Submission:
    """What ``submit``/``lookup`` found: ``result`` is None while the command runs.

    ``replayed`` is True when the request_id had been seen before (no new action).
    """

    command: Command
    result: FaultToleranceResult | None
    replayed: bool = False

    @property
    def done(self) -> bool:
        """True once the command finished (successfully or not)."""
        return self.result is not None


class CommandLedger:
    """Accepts commands, runs them one at a time through ``execute``, records results.

    ``capacity`` bounds how many finished request ids are remembered (oldest forgotten).
    ``on_done`` is called with each command and its result after it finishes.
    """

    def __init__(
        self,
        execute: Execute,
        *,
        spawn: Spawn = spawn_thread,
        capacity: int = 1024,
        on_done: Callable[[Command, FaultToleranceResult], None] | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._execute = execute
        self._spawn = spawn
        self._capacity = capacity
        self._on_done = on_done
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, Submission] = OrderedDict()
        self._running: str | None = None
        self._last: FaultToleranceResult | None = None

    @property
    def running(self) -> str | None:
        """The request_id of the command now running, if any."""
        with self._lock:
            return self._running

    @property
    def last(self) -> FaultToleranceResult | None:
        """The result of the command that finished last, if any."""
        with self._lock:
            return self._last

    def entries(self) -> tuple[Submission, ...]:
        """Every remembered submission, oldest first (a consistent copy)."""
        with self._lock:
            return tuple(self._entries.values())

    def lookup(self, request_id: str) -> Submission | None:
        """The recorded submission for ``request_id``, or None if unknown (or forgotten)."""
        with self._lock:
            return self._entries.get(request_id)

    def submit(self, command: Command) -> Submission:
        """Start ``command`` in the background, or return the record of its earlier submission.

        Raises ``CommandConflict`` if the request_id was used for a different command, or if
        another command is still running (nothing is started then).
        """
        with self._lock:
            earlier = self._entries.get(command.request_id)
            if earlier is not None:
                if earlier.command != command:
                    raise CommandConflict(
                        f"request_id {command.request_id!r} was already used for "
                        f"{earlier.command.instruction} {earlier.command.params()}; "
                        "use a new request_id for a different command"
                    )
                return attrs.evolve(earlier, replayed=True)
            if self._running is not None:
                raise CommandConflict(
                    f"command {self._running!r} is still running; wait until "
                    f"GET {REQUESTS_PATH}/{self._running} shows it done"
                )
            submission = Submission(command, None)
            self._entries[command.request_id] = submission
            self._running = command.request_id
        self._spawn(lambda: self._run(command), f"ftengine-apply-{command.request_id}")
        return submission

    def _run(self, command: Command) -> None:
        # Recorded even if execute raises something unexpected (it then propagates to the
        # thread's excepthook), so the ledger never stays "running" forever.
        result = FaultToleranceResult(
            request_id=command.request_id,
            success=False,
            reason="the recovery command raised an unexpected error; see the server log",
        )
        try:
            result = self._execute(command)
        except FTEngineError as exc:
            logger.exception("command %s (%s) failed", command.request_id, command.instruction)
            result = FaultToleranceResult(
                request_id=command.request_id, success=False, reason=f"{type(exc).__name__}: {exc}"
            )
        finally:
            with self._lock:
                self._entries[command.request_id] = Submission(command, result)
                self._running = None
                self._last = result
                self._forget_oldest()
            if self._on_done is not None:
                self._on_done(command, result)

    def _forget_oldest(self) -> None:
        finished = [rid for rid, entry in self._entries.items() if entry.done]
        for request_id in finished[: max(0, len(self._entries) - self._capacity)]:
            del self._entries[request_id]
