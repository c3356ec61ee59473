"""Random sequences of what the supervisor files about one worker (Ready, fence, retire,
exit, removal), legal or not, run against a WorkerHandle beside a tiny reference model."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, TypeVar

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ftengine.errors import TransitionError
from ftengine.testbed.cluster.handles import WorkerHandle
from ftengine.testbed.cluster.lifecycle import TABLE, Row, WorkerEvent, WorkerState

E = WorkerEvent
PAIRS = frozenset((row.source, row.event) for row in TABLE)
reasons = st.sampled_from(["hung: no heartbeat", "hung: no reply to step 3", "removed by s1"])
T = TypeVar("T")


class WorkerLifecycleMachine(RuleBasedStateMachine):
    """The model counts kills and exit news; the handle must agree at every step."""

    def __init__(self) -> None:
        super().__init__()
        process: Any = SimpleNamespace(pid=None)
        self.worker = WorkerHandle(1, process, conn=None)  # type: ignore[arg-type]
        self.kills: list[str] = []  # reasons of the kills the handle asked for
        self.news = 0  # exits filed while the worker was alive
        self.was_gone = False
        self.was_removed = False

    def _fire(self, event: WorkerEvent, act: Callable[[], T]) -> T | None:
        """Run ``act``; it must either move along a row of the table or raise and not move."""
        before = self.worker.state
        try:
            result = act()
        except TransitionError:
            assert (before, event) not in PAIRS
            assert self.worker.state is before
            return None
        assert Row(event, before, self.worker.state) in TABLE
        return result

    @rule(pid=st.integers(min_value=1, max_value=99999))
    def ready(self, pid: int) -> None:
        self._fire(E.READY, lambda: self.worker.mark_ready(pid))

    @rule(reason=reasons)
    def fence(self, reason: str) -> None:
        if self._fire(E.FENCE, lambda: self.worker.fence(reason)):
            self.kills.append(reason)

    @rule(reason=reasons)
    def retire(self, reason: str) -> None:
        if self._fire(E.RETIRE, lambda: self.worker.retire(reason)):
            self.kills.append(reason)

    @rule(info=st.sampled_from(["killed by SIGKILL", "exited with code 1"]))
    def exit(self, info: str) -> None:
        before = self._fire(E.EXIT, lambda: self.worker.exited(info))
        if before is not None and before.alive:
            self.news += 1
            assert self.worker.exit_info == info

    @rule()
    def remove(self) -> None:
        self._fire(E.REMOVE, self.worker.remove)

    @invariant()
    def the_kill_goes_out_at_most_once_with_its_reason_kept(self) -> None:
        assert len(self.kills) <= 1
        assert self.worker.fenced_for == (self.kills[0] if self.kills else None)
        if self.kills:
            assert self.worker.state in (WorkerState.FENCED, WorkerState.RETIRING) or (
                not self.worker.alive
            )

    @invariant()
    def an_exit_is_news_exactly_once_and_gone_stays_gone(self) -> None:
        assert self.news == (0 if self.worker.alive else 1)
        if self.was_gone:
            assert not self.worker.alive
        self.was_gone = not self.worker.alive

    @invariant()
    def removed_means_gone_and_is_terminal(self) -> None:
        assert self.worker.removed <= (not self.worker.alive)
        if self.was_removed:
            assert self.worker.removed
        self.was_removed = self.worker.removed


WorkerLifecycleMachine.TestCase.settings = settings(stateful_step_count=30)
TestWorkerLifecycle = WorkerLifecycleMachine.TestCase
