"""``FakeBackend``: a Backend that records every call and can be told to fail or hang on the
Nth call of any action — the tool for engine, property and conformance tests.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Callable

import attrs

from ftengine.backends.base import RepairReport
from ftengine.errors import BackendError, CollectiveTimeout, ConfigError, PreconditionFailed
from ftengine.faults import Fault
from ftengine.recovery import STEPS

# Every Backend method: the engine's steps (from the step table) and the two the host calls.
ACTIONS = ("set_op_timeout", *(step.action for step in STEPS), "synchronize")


@attrs.frozen
class Call:
    """One recorded backend call: the action's name and its positional arguments."""

    name: str
    args: tuple[object, ...] = ()


class Hang:
    """A hang armed on one call. ``entered`` is set once the call blocks; ``release()`` lets
    it return normally. If never released it raises ``CollectiveTimeout`` after ``timeout`` s.
    """

    def __init__(self, action: str, nth: int, timeout: float) -> None:
        self.action = action
        self.nth = nth
        self.timeout = timeout
        self.entered = threading.Event()
        self._released = threading.Event()

    def release(self) -> None:
        """Let the hung call (or the call still to come) return normally."""
        self._released.set()

    def block(self) -> None:
        self.entered.set()
        if not self._released.wait(self.timeout):
            raise CollectiveTimeout(
                f"fake {self.action} call #{self.nth} hung for {self.timeout:g}s and was never "
                "released; call Hang.release() in the test"
            )


def _check_action(action: str) -> None:
    if action not in ACTIONS:
        raise ConfigError(f"unknown backend action {action!r}: expected one of {ACTIONS}")


class FakeBackend:
    """An in-memory Backend for one rank.

    ``on_call`` (if given) sees every ``Call`` before the action runs, e.g. to check the
    engine's phase at that instant. ``reloads_per_rank`` sets how many (layer, expert)
    reloads ``repair_experts`` reports per newly dead rank. Thread-safe.
    """

    name = "fake"

    def __init__(
        self,
        *,
        rank: int = 0,
        reloads_per_rank: int = 2,
        hang_timeout: float = 5.0,
        on_call: Callable[[Call], None] | None = None,
    ) -> None:
        self.rank = rank
        self.reloads_per_rank = reloads_per_rank
        self.hang_timeout = hang_timeout
        self.on_call = on_call
        self.op_timeout: float = 0.0
        self.epoch = 0
        self.alive: frozenset[int] | None = None
        self.masked: frozenset[int] = frozenset()
        self.repaired: frozenset[int] = frozenset()
        self.admitted: frozenset[int] = frozenset()
        self.quarantined = False
        self._lock = threading.Lock()
        self._calls: list[Call] = []
        self._counts: Counter[str] = Counter()
        self._failures: dict[tuple[str, int], BaseException] = {}
        self._hangs: dict[tuple[str, int], Hang] = {}

    # -- arming ---------------------------------------------------------------------------

    def fail_on(
        self, action: str, exc: BaseException | None = None, *, nth: int | None = None
    ) -> None:
        """Make call number ``nth`` (1-based, counted per action; default: the next one) of
        ``action`` raise ``exc`` (default: a ``BackendError`` naming the call)."""
        _check_action(action)
        with self._lock:
            nth = self._counts[action] + 1 if nth is None else nth
            self._failures[(action, nth)] = exc or BackendError(
                f"fake {action} call #{nth} failed (armed by FakeBackend.fail_on)"
            )

    def hang_on(self, action: str, *, nth: int | None = None, timeout: float | None = None) -> Hang:
        """Make call ``nth`` (default: the next) of ``action`` block until released."""
        _check_action(action)
        with self._lock:
            nth = self._counts[action] + 1 if nth is None else nth
            hang = Hang(action, nth, self.hang_timeout if timeout is None else timeout)
            self._hangs[(action, nth)] = hang
            return hang

    def disarm(self) -> None:
        """Drop every armed failure and release every armed hang."""
        with self._lock:
            self._failures.clear()
            hangs, self._hangs = list(self._hangs.values()), {}
        for hang in hangs:
            hang.release()

    # -- inspection -----------------------------------------------------------------------

    @property
    def calls(self) -> tuple[Call, ...]:
        """Every call so far, in order (failed and hung ones included)."""
        with self._lock:
            return tuple(self._calls)

    def names(self) -> list[str]:
        """The names of every call so far, in order."""
        return [call.name for call in self.calls]

    def count(self, action: str) -> int:
        """How many times ``action`` has been called."""
        with self._lock:
            return self._counts[action]

    # -- the Backend protocol -------------------------------------------------------------

    def _enter(self, name: str, *args: object) -> None:
        call = Call(name, args)
        with self._lock:
            self._calls.append(call)
            self._counts[name] += 1
            nth = self._counts[name]
            failure = self._failures.pop((name, nth), None)
            hang = self._hangs.pop((name, nth), None)
        if self.on_call is not None:
            self.on_call(call)
        if hang is not None:
            hang.block()
        if failure is not None:
            raise failure

    def set_op_timeout(self, seconds: float) -> None:
        self._enter("set_op_timeout", seconds)
        if not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
            raise ConfigError(f"op timeout must be finite seconds >= 0 (0 = off), got {seconds!r}")
        self.op_timeout = float(seconds)

    def quarantine(self, fault: Fault) -> None:
        self._enter("quarantine", fault)
        self.quarantined = True

    def reset_device(self) -> None:
        self._enter("reset_device")

    def rebuild_groups(self, alive_ranks: frozenset[int], epoch: int) -> None:
        self._enter("rebuild_groups", alive_ranks, epoch)
        if not alive_ranks:
            raise PreconditionFailed("rebuild_groups needs at least one alive rank, got none")
        if epoch <= self.epoch:
            raise PreconditionFailed(
                f"rebuild_groups epoch must grow: got {epoch} after {self.epoch}"
            )
        self.alive, self.epoch, self.quarantined = frozenset(alive_ranks), epoch, False

    def mask_ranks(self, dead_ranks: frozenset[int]) -> None:
        self._enter("mask_ranks", dead_ranks)
        self.masked = frozenset(dead_ranks)

    def repair_experts(self, dead_ranks: frozenset[int]) -> RepairReport:
        self._enter("repair_experts", dead_ranks)
        new = frozenset(dead_ranks) - self.repaired
        self.repaired |= new
        reloads = len(new) * self.reloads_per_rank
        reloaded = tuple(
            (layer, rank) for rank in sorted(new) for layer in range(self.reloads_per_rank)
        )
        return RepairReport(
            reloads=reloads,
            reload_lower_bound=reloads,
            bytes_reloaded=reloads * 1024,
            reloaded=reloaded,
        )

    def admit_ranks(self, added: frozenset[int], removed: frozenset[int]) -> RepairReport:
        self._enter("admit_ranks", added, removed)
        added, removed = frozenset(added), frozenset(removed)
        if not added or added & removed:
            raise PreconditionFailed(
                f"admit_ranks needs ranks to add outside the removed set, got added "
                f"{sorted(added)}, removed {sorted(removed)}"
            )
        if self.alive is not None and not added <= self.alive:
            raise PreconditionFailed(
                f"admit_ranks runs after rebuild_groups spanned the added ranks "
                f"{sorted(added)}; the groups span {sorted(self.alive)}"
            )
        if self.rank not in added and not added <= self.masked:
            raise PreconditionFailed(
                f"only masked ranks can be admitted: {sorted(added - self.masked)} are not "
                f"masked (masked: {sorted(self.masked)})"
            )
        self.masked = removed
        self.repaired -= added
        self.admitted |= added
        return RepairReport()

    def run_dummy_batch(self) -> None:
        self._enter("run_dummy_batch")

    def synchronize(self) -> None:
        self._enter("synchronize")
