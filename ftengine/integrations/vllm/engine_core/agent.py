"""ftengine beside vLLM's engine-core fault-tolerance sentinel (one agent per engine core).

- **Peer watch.** Every ``BEAT_S`` each engine core's watch thread checks its worker's exit
  and its own status (and runs the probes and the quorum below: one wake-up per beat, the
  only one); every ``PEER_READ_S``, at once when either changed or a peer rang (``dp_board``),
  it publishes its status if changed (else every ``PUBLISH_S``) and reads its peers'.
  A peer that is ``dead`` or ``unhealthy`` (or whose beat stops for ``STALE_S``, or a DP
  store that stops answering) makes this engine fault at once through vLLM's own path
  (requests aborted, UNHEALTHY, status pushed), so an idle survivor knows within a beat
  instead of sacrificing the next request to find out.
- **Early word.** An engine whose worker is dying publishes ``dead`` at once, and a
  survivor reports ``unhealthy`` as soon as it has the news, before its own busy loop gets
  to vLLM's ``on_fault`` (a busy one waits in a collective until the dead worker's sockets
  close): see :func:`worker_dying`.
- **Policy.** The configured policy decides here, for the whole deployment's engine core
  (the worker's FSM carries out the engine core's commands). It sees what a worker of the
  test bed sees (``fault_books``): the fault history with the rank each fault points at
  (this engine's own, or the peer whose fault was news first), the dead peers, the removed
  ranks, the worker's redundancy facts, attempts and elapsed time. Every decision acts:
  ``Retry`` and ``ScaleDown`` are proposed on the DP board and run (the engine core's own
  ``retry`` / ftengine's ``scale_down``, exactly what an orchestrator's command runs) once
  every survivor proposes the same (``agreement``) and, for a ``scale_down``, those
  survivors hold the majority of the live ranks (``agreement.holds_majority``: a member
  cut off or starved never removes the others alone), else the orchestrator's command is
  awaited; ``WaitForOrchestrator`` waits (to a deadline earlier than vLLM's own, then gives
  up); ``GiveUp`` makes the engine DEAD, its held requests aborted with the reason.
- **Quorum.** On the watch thread (``guard_step``, no DP-store I/O), each engine core
  applies the majority rule (``quorum``, docs/design-partitions.md) to what its UDP probes
  reach: on the majority side a peer whose port is closed or that fell silent is taken for
  dead at once (one scale-down past a whole host); on the minority side the engine faults
  and, once unhealthy, is DEAD naming the partition, its held and queued requests ended
  with that reason.
- **Status.** ftengine's phase, epoch and removed ranks, written by the worker's FSM to
  :class:`StatusFile`, are added to each status the engine core pushes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
import weakref
from datetime import timedelta
from typing import Any

import attrs

from ftengine.commands import REMOVED_KEY
from ftengine.context import RecoveryContext
from ftengine.errors import PeerDead
from ftengine.faults import Fault, FaultKind, Phase
from ftengine.integrations.vllm.config import VllmFtSettings
from ftengine.integrations.vllm.engine_core.admission import command_ready, offer, wake
from ftengine.integrations.vllm.engine_core.agreement import (
    PeerView,
    Proposal,
    agreed,
    holds_majority,
)
from ftengine.integrations.vllm.engine_core.announce import start_announcing
from ftengine.integrations.vllm.engine_core.dp_board import BEAT_ENV as BEAT_ENV
from ftengine.integrations.vllm.engine_core.dp_board import BEAT_S as BEAT_S
from ftengine.integrations.vllm.engine_core.dp_board import (
    PEER_READ_S,
    Doorbell,
    Entry,
    StatusBoard,
    beat_interval,
)
from ftengine.integrations.vllm.engine_core.dp_group import ClosedDpGroup, close_dp_group
from ftengine.integrations.vllm.engine_core.fault_books import FaultBooks
from ftengine.integrations.vllm.engine_core.poison import own_fault
from ftengine.integrations.vllm.engine_core.quorum import (
    HEALS,
    SILENT_S,
    Reachability,
    Sight,
    explain,
    keeps_serving,
    sight,
)
from ftengine.integrations.vllm.engine_core.rejoin import rejoin_status
from ftengine.integrations.vllm.engine_core.scale_down import REMOVED_ATTR, STORE_ATTR, problems
from ftengine.integrations.vllm.engine_core.standby_store import (
    BoundedStore,
    StandbyStore,
    StandbyUnknown,
    stand_in,
    store_rank,
)
from ftengine.integrations.vllm.engine_core.wave_bell import COORDINATOR_RANK, WaveBell
from ftengine.integrations.vllm.engine_core.worker_exit import worker_dying
from ftengine.integrations.vllm.messages import API_URL_ENV, import_vllm
from ftengine.integrations.vllm.status_file import (
    StatusFile,
    redundancy_facts,
    remove_dead_status_files,
    worker_fields,
)
from ftengine.integrations.vllm.worker.adapter import adopt_fault
from ftengine.policies import (
    GiveUp,
    Retry,
    ScaleDown,
    WaitForOrchestrator,
    decide,
    describe,
)
from ftengine.policies.algebra import Policy

logger = logging.getLogger(__name__)

STALE_S = 5.0  # an engine core whose beat stops this long is taken for dead (GIL-starved
# threads on a loaded 2-core machine were seen to pause ~1 s; a status change is instant)
SETTLE_S = 2.0  # after a recovery, peers finish theirs: their "unhealthy" is stale this long
STORE_FAILURES = 5
HOLD_S = 5.0  # a command waits at most this (plus the op timeout) for on_fault to catch up
FAULT_MARK = "ftengine-peer-fault"
"""Request type of the agent's input-queue marker (no vLLM request type has this value)."""
EPOCH_ATTR = "_dp_reinit_epoch"  # EngineCoreSentinel's count of DP-group rebuilds (retries)
UTILS_MODULE = "vllm.v1.fault_tolerance.utils"
ENGINE_MODULE = "vllm.v1.engine"
DEADLINE_MARGIN_S = 1.0  # a policy's deadline this close to vLLM's is left to vLLM's wrapper


class EngineCoreAgent:
    """The agent of one ``EngineCoreSentinel`` (``sentinel.engine`` is vLLM's engine core)."""

    def __init__(self, sentinel: Any, settings: VllmFtSettings) -> None:
        self.sentinel = sentinel
        self.engine = sentinel.engine
        self.settings = settings
        parallel = self.engine.vllm_config.parallel_config
        self.rank = int(parallel.data_parallel_rank)
        self.world = int(parallel.data_parallel_size)
        self.status_file = StatusFile.for_engine_core(self.rank)
        self.policy: Policy = settings.build_policy()
        self.pending: PeerDead | None = None
        self.blamed: int | None = None  # the peer whose fault was news first, while healthy
        self.generation = 0  # faults handled so far; a marker names the one it was made in
        self.books = FaultBooks(self.rank, self.world)
        self.proposal: Proposal | None = None  # what this engine's policy proposes now
        self.admissible: frozenset[int] = frozenset()  # ready removed ranks the policy admits
        self._woken_for: object = None  # the scale_up whose joined ranks woke the busy loop
        self.decided: str | None = None  # the last decision, logged when it changes
        self.outvoted: Proposal | None = None  # a scale-down the majority rule held back
        self._beat = 0
        self.beat_s = beat_interval()
        self._read_at = -PEER_READ_S  # when the peers were last read (monotonic)
        self._seen: dict[int, tuple[int, float]] = {}
        self._store_failures = 0
        self.board, self.doorbell = StatusBoard(self.rank, self.world), Doorbell()
        self.board.doorbell = self.doorbell.address
        self.reach = Reachability(self.rank, self.doorbell.address[0])
        self.board.probe = self.reach.address
        self.board.api_url = os.environ.get(API_URL_ENV) or None  # for a DEAD peer's handoff
        self.standby: StandbyStore | None = None  # the DP store in reserve (standby_store)
        self.wave_bell: WaveBell | None = None  # waves without the coordinator (wave_bell)
        self._board_on: int | None = None  # the rank whose standby store the board is on
        self._bounded: BoundedStore | None = None  # the board's bound on vLLM's DP store
        self.gone: frozenset[int] = frozenset()  # peers the probes say are dead or cut off
        self.fenced: str | None = None  # why this engine is on a minority side (quorum)
        self._refusing: threading.Event | None = None  # set: stop refusing late arrivals
        self.cut_off: str | None = None  # a minority engine sitting the partition out (minority)
        self._timed_group: weakref.ref[Any] | None = None
        self._healthy_since = 0.0
        self.peers: dict[int, str] = {}  # current-epoch peers' statuses ("dead" if stale)
        self.views: dict[int, PeerView] = {}  # the peers' statuses, epochs, proposals
        self.blames: dict[int, int | None] = {}  # the rank each peer's fault points at
        self._was_healthy = True
        self._dying = False  # this engine's own worker has begun to exit
        self.anticipated: str | None = None  # status reported ahead of vLLM's on_fault
        self._faulted = threading.Event()  # cleared while an early report runs ahead
        self._faulted.set()
        self._stop = threading.Event()
        self._recovering = threading.Event()  # the agent's own retry / scale_down runs
        self._idle = threading.Event()  # the opposite, for commands to wait on
        self._idle.set()
        self._commands = 0  # vLLM's input thread is handling this many FT commands
        self._settled_dead = False  # a worker death while recovering was made DEAD
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="ftengine-agent", daemon=True)
        self.watch = threading.Thread(target=self._watch, name="ftengine-watch", daemon=True)

    def start(self) -> None:
        logger.info("[FT] engine %d: policy %r", self.rank, self.policy)
        removed = remove_dead_status_files()
        if removed:
            logger.info(
                "[FT] removed %d status files of engine cores that no longer run", len(removed)
            )
        if self.world > 1:
            self.open_takeover()
        self.thread.start()
        if self.world > 1:
            self.watch.start()

    def open_takeover(self) -> None:
        """Open what the survivors of a lost DP rank 0 take over with (before the first
        publish, which advertises both): the standby store and the wave bell."""
        host = self.doorbell.address[0]
        self.standby = StandbyStore(host)
        self.board.standby = self.standby.address
        self.wave_bell = WaveBell(host, self.engine.input_queue.put_nowait)
        self.board.wave = self.wave_bell.address
        self.wave_bell.start()

    def stop(self) -> None:
        self._stop.set()
        self.reach.stop()
        if self.wave_bell is not None:
            self.wave_bell.close()
        if self._refusing is not None:
            self._refusing.set()

    # -- called from the patched EngineCoreSentinel ------------------------------------

    def raise_pending(self, generation: int) -> None:
        """In the busy loop (the queued marker of :meth:`_inject`, made in ``generation``):
        raise the peer fault if it is still news, so vLLM's own ``on_fault`` runs; a marker
        from before a fault that was handled meanwhile does nothing."""
        with self._lock:
            if generation != self.generation:
                return
            pending, self.pending = self.pending, None
        if pending is not None and self._own_status() == "healthy" and not self._dying:
            raise pending  # (an engine whose worker is dying is DEAD, not a peer's victim)

    def fault_handled(self) -> None:
        """After vLLM's ``on_fault``: markers queued until now are stale."""
        with self._lock:
            self.generation += 1
            self.pending = None
            self.blamed = None  # note_fault has named the fault's rank already
            self.anticipated = None  # vLLM's own status says it now

    def command_started(self) -> None:
        """vLLM's input thread begins an FT command (the patched ``handle_command``)."""
        with self._lock:
            self._commands += 1

    def command_ended(self) -> None:
        """It ended: a worker that died during it leaves the engine DEAD now."""
        with self._lock:
            self._commands -= 1
        self.settle_late_death()

    def settle_late_death(self) -> bool:
        """This engine's worker died while the engine was recovering (UNHEALTHY, parked or in
        a command that failed): DEAD now, its requests to a survivor (``late_death``), once,
        when neither vLLM's ``on_fault``, a command nor the agent's own recovery runs."""
        if not getattr(self.engine.model_executor, "is_failed", False):
            return False
        if self._own_status() != "unhealthy" or not self._faulted.is_set():
            return False
        with self._lock:
            if self._settled_dead or self._commands or not self._idle.is_set():
                return False
            self._settled_dead = True
        from ftengine.integrations.vllm.engine_core.late_death import went_dead

        went_dead(
            self.sentinel,
            f"engine {self.rank}'s worker process died while the engine was recovering",
        )
        return True

    def release_commands(self) -> None:
        """After the patched ``on_fault`` pushed its last status: a held command may run (its
        result then reaches the API server after that status, which would replace it)."""
        self._faulted.set()

    def note_fault(self, exc: BaseException) -> None:
        """Before vLLM's ``EngineCoreSentinel.on_fault``: remember the fault for the policy
        (no I/O, so vLLM's status goes out at once)."""
        from ftengine.sentinel import classify_exception

        # Until release_commands: the busy loop's on_fault is under way and may still talk
        # to the worker (after_fault's collective_rpc). A command (vLLM's input thread) or
        # the agent's own recovery running its collective_rpc meanwhile would take that
        # call's answer for its own (vLLM's executor answers in the order it reads, not
        # per caller): a retry "done" before the worker ran it, its status stale.
        self._faulted.clear()
        with self._lock:
            self.pending = None  # this fault is the news; a queued marker is now stale
            blamed, self.blamed = self.blamed, None
        kind = FaultKind.DEAD_PEER if isinstance(exc, PeerDead) else classify_exception(exc)
        # The agent's marker: the peer it saw faulted. An error of its own kind (not a
        # collective's timeout or closed socket): this rank's, even if a peer was seen
        # unhealthy first (a victim of this very fault, whose beat can outrun the error's
        # way from the worker). Else the peer's, if known.
        if isinstance(exc, PeerDead):
            rank = blamed
        elif own_fault(exc, self.peers):
            rank = self.rank
        else:
            rank = blamed
        fault = Fault(kind=kind, rank=rank, info=type(exc).__name__, at=time.monotonic())
        with self._lock:
            # As the verdict names it: an error's text ("Connection closed by peer") is no
            # proof that the peer it points at died, only the peers' statuses are; opened
            # as a dead peer, the episode would count that rank dead and the policy could
            # scale a live peer down (alone with DP=2, every survivor agreeing with itself).
            self.books.open(self.verdict(fault))

    @property
    def fault(self) -> Fault | None:
        """The fault of the episode under way, as the agent knows it now."""
        return self.books.fault

    def let_go_of_dp_group(self, exc: BaseException) -> None:
        """On a fault, before vLLM's ``on_fault`` makes the engine UNHEALTHY (busy-loop
        thread; no recovery can have rebuilt the group yet): close the engine cores' DP group
        (``dp_group.close_dp_group``), this agent's reference to it first."""
        self._timed_group = None
        close_dp_group(self.engine, self.rank, exc)

    def readmit(self, ranks: frozenset[int]) -> None:
        """Before ``ranks`` (removed, now admitted back) count as members again: forget what
        was known of their old processes (status, beats, probe and doorbell addresses), so
        the closed port of the process that died is not taken for the new one's death."""
        with self._lock:
            for known in (self.peers, self.views, self.blames, self._seen):
                for rank in ranks:
                    known.pop(rank, None)
            self.gone = self.gone - ranks
        self.board.forget(ranks)
        self.reach.forget(ranks)

    def start_over(self) -> tuple[str, ...]:
        """This engine's worker was relaunched in place (``relaunch.py``): it comes back as a
        returning rank, so what was known of the peers and of the fault goes (a peer's
        closed port from before is no news now); returns the peers' API server URLs as last
        read (where it finds the survivors' DP store)."""
        urls = tuple(url for rank, url in sorted(self.board.api_urls.items()) if rank != self.rank)
        self.readmit(frozenset(range(self.world)) - {self.rank})
        with self._lock:
            self.generation += 1  # markers queued before are stale
            self.pending = self.blamed = self.anticipated = None
            self.books = FaultBooks(self.rank, self.world)
            self.proposal = self.decided = self.outvoted = None
            self.admissible = frozenset()
            self._dying = False
            self._settled_dead = False
            self._store_failures = 0
            self.fenced = self.cut_off = None  # a minority's partition is over
        if self._refusing is not None:
            self._refusing.set()
        self._faulted.set()
        return urls

    def after_fault(self) -> None:
        """After vLLM's ``on_fault`` (busy-loop thread, so the executor is ours): hand the
        fault to a worker still serving (its FSM quarantines), then mark older fault markers
        stale. The caller pushes the status again, now with the worker's phase."""
        executor = self.engine.model_executor
        fault = self.fault
        if fault is not None and not getattr(executor, "is_failed", False):
            try:
                executor.collective_rpc(adopt_fault, timeout=5.0, args=(fault.kind.value,))
            except Exception:  # the worker may be gone or hung: vLLM's own path goes on
                logger.warning("[FT] could not hand the fault to engine %d's worker", self.rank)
        self.fault_handled()

    def status_fields(self) -> dict[str, object]:
        """ftengine's fields for the status vLLM pushes (the worker's last written FSM state)."""
        fields = worker_fields(self.status_file.read())
        failed = bool(getattr(self.engine.model_executor, "is_failed", False))
        if failed:
            fields["phase"] = Phase.DEAD.value  # the worker and its FSM are gone
        anticipated, own = self.anticipated, self._own_status()
        if anticipated is not None and own == "healthy":
            fields["status"] = anticipated
            if anticipated == "unhealthy":
                fields["fault_info"] = PeerDead.__name__
        elif own == "unhealthy" and (failed or self._dying):
            # vLLM says DEAD only from its busy loop's next fault, which a recovering engine
            # (parked, or running a command) never reaches: no retry can include it now
            fields["status"] = "dead"
            fields["fault_info"] = (
                f"engine {self.rank}'s worker process died while the engine was recovering"
            )
        if fields.get("status", own) == "unhealthy" and self.fenced is not None:
            # on a partition's minority side, stopping (dead at the next tick it is idle):
            # an orchestrator must not count it in a retry, which would wait for it in vain
            fields["fault_info"] = self.fenced
        store = getattr(self.sentinel, STORE_ATTR, None)
        if store is not None:  # where a restarted rank joins (engine_core/admission.py)
            fields["dp_store"] = f"{store[0]}:{store[1]}"
        fields.update(rejoin_status(self.engine))  # a restarted rank waiting for admission
        return fields

    def _anticipate(self, status: str) -> None:
        """Report ``status`` now (vLLM's own status follows when its busy loop gets there);
        commands wait for that (:meth:`await_fault`)."""
        self._faulted.clear()
        self.anticipated = status
        self._push()

    def _push(self) -> None:
        """Push this engine's status to its API server now (``status_fields`` included)."""
        push = getattr(self.sentinel, "_push_status", None)
        if callable(push):
            push()  # output_queue.put_nowait: safe from this thread

    # -- the agent thread -------------------------------------------------------------

    def _run(self) -> None:
        # Asleep on the doorbell: a peer's ring, the watch thread's news of this engine, or
        # the next peer read (not Event.wait: a select on the doorbell costs half)
        # With no peers (DP=1) there is no watch thread: the agent ticks every beat itself
        sleep_s = max(PEER_READ_S, self.beat_s) if self.world > 1 else self.beat_s
        while not self._stop.is_set():
            rung = self.doorbell.wait(sleep_s)
            try:
                self._tick(rung)
            except Exception:  # the watch must outlive any one failure
                logger.exception("[FT] engine %d agent step failed", self.rank)
        self.doorbell.sock.close()

    def _tick(self, rung: bool = False) -> None:
        """The worker-exit check; the peer watch (publish, read, policy) when
        ``PEER_READ_S`` has passed, a peer or the watch thread ``rung`` the doorbell, or at
        once when this engine has news of its own (its worker began to exit, its status or
        epoch changed)."""
        self._keep_dp_timeout()
        if self.fenced is not None:
            return  # a minority engine reads no DP store: its host may be across the cut
        self.settle_late_death()
        was_dying = self._dying
        self._dying = was_dying or worker_dying(self.engine.model_executor)
        news = rung or self._dying != was_dying or self._mine() != self.board.published
        if news or time.monotonic() - self._read_at >= PEER_READ_S:
            self._watch_peers(exit_checked=True)
            self._maybe_recover()
            self._offer_admission()

    def _offer_admission(self) -> None:
        """The removed ranks this engine's policy admits now (``admission.offer``), or a
        ``scale_up`` whose ranks all joined: the busy loop votes for them at the next DP
        sync; news wakes it (idle members step to that sync)."""
        store = self._dp_store()
        if store is None:
            return
        offered = offer(self.sentinel, self.policy, self.rank, self.world, store)
        news = bool(offered) and offered != self.admissible
        if news:
            logger.info("[FT] engine %d: policy admits DP ranks %s (ready on the DP store)",
                        self.rank, sorted(offered))  # fmt: skip
        self.admissible = offered
        command = command_ready(self.sentinel, store)
        if command is not None and command is not self._woken_for:
            self._woken_for, news = command, True
        if news:
            wake(self.sentinel)

    def _watch(self) -> None:
        """The one thread that wakes every beat (``BEAT_S``): :meth:`watch_step`. Every
        wake-up of a Python thread takes the engine core's GIL from the busy loop, and on a
        loaded machine handing it back can wait for the OS to run this thread: the probes,
        the quorum and the worker-exit check share this one wake-up, and the agent thread
        sleeps until there is news (measured: docs/results/vllm-bench.md)."""
        while not self._stop.wait(self.beat_s):
            try:
                self.watch_step()
            except Exception:  # the watch must outlive any one failure
                logger.exception("[FT] engine %d watch step failed", self.rank)
        self.reach.close()

    def watch_step(self) -> None:
        """Probes and quorum (:meth:`guard_step`), then this engine's own news (its worker
        began to exit, its status or epoch changed), which wakes the agent thread. No
        DP-store I/O here: the store's host may be across a cut, and the agent thread may
        wait in a store call for the store's timeout."""
        if self.world > 1:
            self.reach.step()
            try:
                self.guard_step()
            except Exception:  # the guard must outlive any one failure
                logger.exception("[FT] engine %d quorum check failed", self.rank)
        if self.fenced is not None:
            return
        was_dying = self._dying
        self._dying = was_dying or worker_dying(self.engine.model_executor)
        if self._dying != was_dying or self._mine() != self.board.published:
            self.doorbell.ring([self.doorbell.address])

    def guard_step(self) -> None:
        """One look at the quorum; a minority engine that vLLM has made unhealthy stops; one
        parked to sit the partition out rejoins once the link heals (``minority.py``)."""
        from ftengine.integrations.vllm.engine_core import minority

        if self.cut_off is None:
            self._check_quorum()
        elif self.cut_off != minority.PARKED:
            minority.await_heal(self)
            return
        fenced, recovering = self.fenced, self._recovering.is_set()
        if fenced is not None and self._own_status() == "unhealthy" and not recovering:
            # parked at its fault, or now: it learnt it was cut off only after its fault
            parked = self.cut_off == minority.PARKED or minority.park_if_cut_off(
                self.sentinel, self
            )
            self.give_up(f"{fenced}; {HEALS}" if parked else fenced)
            # requests already in the input queue end too, with the same reason (a parked
            # engine's busy loop never reads them again: until it rejoins)
            self._refusing = minority.start_refusing(
                self.engine,
                f"engine {self.rank} stopped: {fenced}",
                float("inf") if parked else self.settings.recovery_timeout_s,
            )
            if parked:
                self.cut_off = minority.WAITING

    def sight(self) -> Sight:
        """What this engine's probes and the DP board say now (``quorum.sight``)."""
        self.reach.know(self.board.probes)
        return sight(self.rank, self.world, self._removed(), self.reach, self._published_dead())

    def _check_quorum(self) -> None:
        """The probes' news (no I/O; on the watch thread, so a DP store across a cut cannot
        delay it): a peer whose port is closed is dead; on a side that keeps the majority
        (``quorum.keeps_serving``) a silent peer is cut off, so gone as well; on the other
        side this engine faults and, once unhealthy, stops (:meth:`guard_step`)."""
        if self.world <= 1:
            return
        removed = self._removed()
        seen = self.sight()
        refused = self.reach.refused() - removed
        silent = seen.live - seen.side
        if keeps_serving(seen):
            self.fenced = None
            gone = refused | silent
            for rank in sorted(gone - self.gone):
                why = "closed its port" if rank in refused else f"silent {SILENT_S:.0f} s"
                logger.warning("[FT] engine %d: engine %d %s: taken for dead", self.rank, rank, why)
                self.peers[rank] = "dead"
                self.views[rank] = PeerView("dead", None)
                self._inject(rank, f"engine {rank} {why}: gone (this side holds a majority)",
                             early=True)  # fmt: skip
            self.gone = frozenset(gone)
            return
        self.gone = frozenset(refused)
        if self.fenced is None:
            self.fenced = explain(seen)
            logger.warning("[FT] engine %d: %s", self.rank, self.fenced)
            self._push()  # faulted already (a peer fell silent first): say it is stopping
        self._inject(min(silent, default=self.rank), self.fenced, early=True)

    def _published_dead(self) -> frozenset[int]:
        """The peers whose last entry on the DP board says ``dead``."""
        decoded = list(self.board.decoded.items())  # (the agent thread writes it)
        return frozenset(rank for rank, (_, seen) in decoded if seen.entry.status == "dead")

    def _keep_dp_timeout(self) -> None:
        """A retry replaces the engine's DP group: give the new one the timeout too."""
        group = getattr(self.engine, "dp_group", None)
        if group is None or isinstance(group, ClosedDpGroup):
            return
        if self._timed_group is None or self._timed_group() is not group:
            _time_out_dp_group(self.engine, self.settings.cpu_distributed_timeout_s)
            self._timed_group = weakref.ref(group)  # never what keeps a closed group open

    def _own_status(self) -> str:
        return str(self.sentinel.status_type.name).lower()

    def _mine(self) -> Entry:
        """What this engine publishes: status (``dead`` once its worker exits), epoch and,
        while unhealthy, its policy's proposal and the rank its fault points at."""
        own = self._own_status()
        status = "dead" if own != "dead" and self._dying else own
        if status != "unhealthy":
            return Entry(status, self._epoch())
        fault = self.fault
        return Entry(status, self._epoch(), self.proposal, None if fault is None else fault.rank)

    def _removed(self) -> frozenset[int]:
        """The original DP ranks scale-downs removed so far (cumulative)."""
        return frozenset(getattr(self.sentinel, REMOVED_ATTR, frozenset()))

    def standbys(self) -> dict[int, tuple[str, int]]:
        """Every engine's standby store as last read, this engine's own included."""
        found = dict(self.board.standbys)
        if self.standby is not None:
            found[self.rank] = self.standby.address
        return found

    def ring_wave(self, wave: int, exclude: int) -> None:
        """A wave began here (``wave_bell.started_idle``, the busy loop): with DP rank 0,
        and so perhaps the coordinator, gone, ring the members' wave bells."""
        removed = self._removed()
        if self.wave_bell is None or COORDINATOR_RANK not in removed:
            return
        bells = dict(self.board.waves)
        members = [r for r in range(self.world) if r not in removed and r != self.rank]
        self.wave_bell.ring([bells[r] for r in members if r in bells], wave, exclude)

    def _dp_store(self) -> Any:
        """vLLM's DP store as the agent thread calls it: each call bounded
        (``standby_store.BoundedStore``: a call on a store across a cut would wait for
        good); None while the engine has none (a rank waiting to rejoin)."""
        store = getattr(self.engine, "dp_store", None)
        if store is None:
            return None
        if self._bounded is None or self._bounded.store is not store:
            if self._bounded is not None:
                self._bounded.close()  # a rebuild replaced it
            self._bounded = BoundedStore(store)
        return self._bounded

    def _board_store(self) -> Any:
        """Where the board is: vLLM's DP store, unless the probes took the rank that hosts
        it for gone; then the standby store of the lowest member left (``standby_store``),
        which every survivor picks alike."""
        store = self._dp_store()
        host = store_rank(self.sentinel)
        if store is None or self.standby is None or host not in self.gone:
            self._board_on = None
            return store
        members = [r for r in range(self.world) if r not in self._removed() | self.gone]
        try:
            lowest, address = stand_in(self.rank, members, self.standbys())
        except StandbyUnknown as exc:
            logger.warning("[FT] %s; the board stays on the DP store", exc)
            return store
        if self._board_on != lowest:
            self._board_on = lowest
            logger.warning(
                "[FT] engine %d: DP rank %d, which hosts the DP store, is gone: the DP board "
                "moves to DP rank %d's standby store %s:%d",
                *(self.rank, host, lowest, *address),
            )  # fmt: skip
        return self.standby.client(address)

    def _watch_peers(self, *, exit_checked: bool = False) -> None:
        """Publish this engine's status, read the peers', fault on a peer's fault;
        ``exit_checked``: this tick has checked the worker's exit already."""
        if getattr(self.engine, "dp_store", None) is None or self.world <= 1:
            return
        self._beat += 1
        own = self._own_status()
        now = self._read_at = time.monotonic()
        if own == "healthy" and not self._was_healthy:
            self._healthy_since = now
        self._was_healthy = own == "healthy"
        # Sticky: once vLLM's monitor has seen the exit it shuts the executor down, after
        # which worker_dying says no; a dead worker never comes back.
        if not exit_checked:
            self._dying = self._dying or worker_dying(self.engine.model_executor)
        if own != "dead" and self._dying and self.anticipated != "dead":
            self._anticipate("dead")
        removed = self._removed()
        for rank in removed:  # gone for good: never news, never a member
            for known in (self.peers, self.views, self.blames):
                known.pop(rank, None)
        try:
            store = self._board_store()
            if self.board.publish(store, self._mine(), self._beat, now):
                self.doorbell.ring(self.board.doorbells.values())
            peers = self.board.read(store, skip=removed)
            self._store_failures = 0
        except Exception as exc:
            self._store_failures += 1
            if self._store_failures >= STORE_FAILURES:
                host = store_rank(self.sentinel)
                why = f"the DP store (hosted by DP rank {host}) stopped answering: {exc}"
                self._inject(host, why, early=True)
            return
        for rank, seen in peers.items():
            status, beat, epoch = seen.entry.status, seen.beat, seen.entry.epoch
            last = self._seen.get(rank)
            if last is None or last[0] != beat:
                self._seen[rank] = (beat, now)
            stale = last is not None and now - self._seen[rank][1] > STALE_S
            self.peers[rank] = "dead" if stale or rank in self.gone else status
            self.views[rank] = PeerView(self.peers[rank], seen.entry.proposal)
            self.blames[rank] = seen.entry.blame
            # Only from a beat that began healthy: one that began faulted has not started
            # the settle clock of the recovery that may have finished meanwhile.
            if own == "healthy" and status in ("dead", "unhealthy") and self._current(epoch, now):
                self._inject(rank, f"engine {rank} is {status}", early=status == "dead")
            elif stale:
                self._inject(rank, f"engine {rank}'s beat stopped {STALE_S:.0f} s ago", early=True)

    def _epoch(self) -> int:
        return int(getattr(self.sentinel, EPOCH_ATTR, 0))

    def _current(self, peer_epoch: int, now: float) -> bool:
        """Whether a peer's fault is news: not from before our last recovery, and not the
        state a peer still finishing the same recovery publishes for a moment."""
        mine = self._epoch()
        return peer_epoch > mine or (peer_epoch == mine and now - self._healthy_since > SETTLE_S)

    def _inject(self, rank: int, why: str, *, early: bool = False) -> None:
        """Fault this engine through vLLM's own path, if it is healthy and not faulting yet;
        ``early`` (a dead peer: no retry can include it) reports ``unhealthy`` at once."""
        if self._own_status() != "healthy" or self._dying:
            return  # dying: vLLM's worker monitor makes this engine DEAD, not UNHEALTHY
        with self._lock:
            if self.pending is not None:
                return
            self.pending = PeerDead(f"[FT] engine {self.rank}: {why}")
            self.blamed = rank
            marker = FaultMarker(self, self.generation)
        logger.warning("[FT] engine %d: %s; faulting now", self.rank, why)
        # The busy loop hands the marker to the patched _handle_client_request, which calls
        # raise_pending; vLLM's on_fault then sees a live executor: UNHEALTHY, not DEAD.
        # Queued before the early report, so a command it prompts finds the engine faulted.
        self.engine.input_queue.put_nowait((FAULT_MARK, marker))
        if early:
            self._anticipate("unhealthy")

    def await_fault(self) -> None:
        """Before vLLM handles a command (its input thread): while a fault is handled (from
        :meth:`note_fault`, or an early report, to :meth:`release_commands`), wait, so the
        command is judged on the status the orchestrator saw and its ``collective_rpc``
        does not run beside ``after_fault``'s (bounded: the per-op timeout ends any step)."""
        self._faulted.wait(HOLD_S + (self.settings.cpu_distributed_timeout_s or 0.0))
        # A command while the agent's own recovery runs is judged on the status it leaves
        # (vLLM would otherwise run a second recovery beside it).
        self._idle.wait(self.settings.recovery_timeout_s)

    def verdict(self, fault: Fault) -> Fault:
        """The fault as the policy should see it: a dead peer by name when one is known; a
        peer's fault, the rank whose own fault began it as that peer publishes (the first
        peer seen unhealthy may be another victim of it);
        a peer-side error (timeout, closed socket) while every peer still beats is a peer's
        transient fault (everyone is alive: a retry can rebuild the groups)."""
        dead = sorted(r for r, s in self.peers.items() if s == "dead")
        if dead:
            return attrs.evolve(fault, kind=FaultKind.DEAD_PEER, rank=dead[0])
        if fault.rank != self.rank:  # not this engine's own: the peer that says it began it
            began = sorted(r for r, b in self.blames.items() if b == r and self.peers.get(r))
            if began and fault.rank not in began:
                fault = attrs.evolve(fault, rank=began[0])
        if fault.kind in (FaultKind.HUNG_PEER, FaultKind.DEAD_PEER) and self.peers:
            return attrs.evolve(fault, kind=FaultKind.TRANSIENT)
        return fault

    def context(self, now: float) -> RecoveryContext | None:
        """What the policy sees now: the episode's fault as the verdict names it, the peers
        dead in it, the ranks removed, the worker's redundancy facts (None: no episode)."""
        redundancy = redundancy_facts(self.status_file.read())
        with self._lock:  # the busy loop may open the next episode meanwhile
            fault = self.fault
            if fault is None:
                return None
            self.books.settle(self.verdict(fault))
            for rank, status in list(self.peers.items()):
                if status == "dead":
                    self.books.dead(rank, now)
            return self.books.context(
                now, self._removed(), epoch=self._epoch(), redundancy=redundancy
            )

    def _maybe_recover(self) -> None:
        """Ask the policy about an unhealthy engine's fault and act on its decision."""
        if self._own_status() != "unhealthy":
            self.proposal = self.decided = None
            return
        if self._recovering.is_set():
            return  # the proposal stays published: the other members may still start
        if not self._faulted.is_set():
            return  # on_fault still runs (its collective_rpc): recover after it, not beside
        if self.fenced is not None:
            return  # a minority side proposes nothing: the guard stops it (never both serve)
        ctx = self.context(time.monotonic())
        if ctx is None:
            return
        decision = decide(self.policy, ctx)
        if describe(decision) != self.decided:
            self.decided = describe(decision)
            logger.info("[FT] engine %d: policy decided to %s", self.rank, self.decided)
        if isinstance(decision, GiveUp):
            self.give_up(decision.reason)
        elif isinstance(decision, WaitForOrchestrator):
            self.proposal = None
            if ctx.now >= decision.deadline and decision.deadline < self._vllm_deadline(ctx):
                self.give_up(f"no recovery command within {ctx.elapsed:.1f} s (the policy's wait)")
        else:
            self._propose(decision, ctx)

    def _vllm_deadline(self, ctx: RecoveryContext) -> float:
        """Where vLLM's own wrapper gives up (less a margin): a later deadline is its to keep."""
        return ctx.episode_start + self.settings.recovery_timeout_s - DEADLINE_MARGIN_S

    def _propose(self, decision: Retry | ScaleDown, ctx: RecoveryContext) -> None:
        """Publish the recovery ``decision`` proposes; run it once it is due, the peers have
        seen it, and every other member proposes the same."""
        proposal = Proposal.of(decision, ctx.removed_ranks, ctx.epoch)
        if proposal.instruction == "scale_down":
            _, found = problems(self.sentinel, {REMOVED_KEY: sorted(proposal.removed)})
            if found:  # as a worker's engine does with a policy's impossible scale-down
                self.give_up(f"policy scale-down not possible: {'; '.join(found)}")
                return
        self.proposal = proposal
        if isinstance(decision, Retry) and ctx.now < ctx.fault.at + decision.after:
            return
        published = self.board.published
        if published is None or published.proposal != proposal:
            return  # the peers must see ours before we wait for them in the rendezvous
        if not agreed(proposal, self.rank, self.world, self.views):
            return
        dead = self._published_dead() | self.reach.refused()
        if not holds_majority(proposal, self.rank, self.world, self._removed(), dead):
            if self.outvoted != proposal:
                self.outvoted = proposal
                logger.warning(
                    "[FT] engine %d: not scaling down to remove DP ranks %s on its own: its "
                    "survivors are no majority of the live ranks (dead: %s); waiting for the "
                    "orchestrator",
                    *(self.rank, sorted(proposal.removed - self._removed()), sorted(dead)),
                )  # fmt: skip
            return
        # On its own thread: the beats go on while the DP group rendezvous waits.
        self._recovering.set()
        self._idle.clear()
        threading.Thread(
            target=self._recover, args=(proposal,), name="ftengine-recovery", daemon=True
        ).start()

    def _recover(self, proposal: Proposal) -> None:
        """Run ``proposal`` through the engine core's own command (what vLLM's dispatch of
        an orchestrator's ``retry`` / ``scale_down`` calls)."""
        params: dict[str, object] = {}
        if proposal.instruction == "scale_down":
            params[REMOVED_KEY] = sorted(proposal.removed)
        request = import_vllm(UTILS_MODULE).FaultToleranceRequest(
            instruction=proposal.instruction,
            params=params,
            request_id=f"ftengine-auto-{uuid.uuid4()}",
        )
        with self._lock:
            attempt = self.books.start_attempt()
        if proposal.instruction == "retry":
            logger.info("[FT] engine %d: policy retries (attempt %d)", self.rank, attempt)
        else:
            logger.info(
                "[FT] engine %d: survivors agree: scale down to remove DP ranks %s (attempt %d)",
                *(self.rank, sorted(proposal.removed), attempt),
            )  # fmt: skip
        try:
            result = getattr(self.sentinel, proposal.instruction)(request)
            if not getattr(result, "success", True):
                logger.warning(
                    "[FT] engine %d: automatic %s refused: %s",
                    *(self.rank, proposal.instruction, getattr(result, "reason", None)),
                )  # fmt: skip
        except Exception:
            logger.exception("[FT] engine %d: automatic %s failed", self.rank, proposal.instruction)
            fault = self.fault
            if fault is not None:  # a retry's delay counts from the failure
                with self._lock:
                    self.books.settle(attrs.evolve(fault, at=time.monotonic()))
        finally:
            self._recovering.clear()
            self._idle.set()

    def give_up(self, reason: str) -> None:
        """The policy's ``GiveUp``: this engine is DEAD (vLLM's wrapper ends it at its
        deadline), what it holds aborted with the reason, the status pushed."""
        from ftengine.integrations.vllm.engine_core.reinference import abort_held

        self.proposal = None
        logger.warning("[FT] engine %d: policy gave up: %s", self.rank, reason)
        self.sentinel.status_type = import_vllm(ENGINE_MODULE).EngineStatusType.DEAD
        self.sentinel.fault_info = f"policy gave up: {reason}"
        abort_held(self.sentinel, f"engine {self.rank} gave up: {reason}")
        self.sentinel._push_status()


@attrs.frozen
class FaultMarker:
    """What the agent queues for the busy loop: raise its peer fault if still current."""

    agent: EngineCoreAgent
    generation: int

    def raise_pending(self) -> None:
        self.agent.raise_pending(self.generation)


def start_agent(sentinel: Any, attr: str) -> None:
    """Give vLLM's new ``EngineCoreSentinel`` its agent (as ``attr``) on the platforms
    ftengine supports; elsewhere vLLM's own sentinel runs alone (the worker warns)."""
    from ftengine.integrations.vllm.worker.factory import SUPPORTED_PLATFORMS, current_device_type

    if current_device_type() not in SUPPORTED_PLATFORMS:
        return
    settings = VllmFtSettings.from_vllm_config(sentinel.engine.vllm_config)
    agent = EngineCoreAgent(sentinel, settings)
    setattr(sentinel, attr, agent)
    agent.start()
    sentinel._push_status()  # the first status already carries ftengine's fields
    start_announcing(sentinel)  # a restarted rank: ready, it tells the survivors


def _time_out_dp_group(engine: Any, seconds: float | None) -> None:
    """ftengine's per-op timeout on the engine cores' DP group (vLLM's default: 30 min)."""
    group = getattr(engine, "dp_group", None)
    if group is not None and seconds is not None:
        group.set_timeout(timedelta(seconds=seconds))
