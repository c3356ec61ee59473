"""Orchestrator commands on the cluster: checked against what the supervisor knows (a dead,
unremoved rank makes ``retry`` pointless), relayed to every live worker's sentinel, and
answered with one CommandResult once every worker has answered.

``scale_up`` goes to every member and to the returning ranks it names, each of those with
the members' removed set and epoch added to its params (what it must adopt); the news that
returning ranks are ready (:meth:`CommandRelay.announce_ready`) goes to every member, and
when their policy admits them at once (``auto``) the returning ranks are sent their part.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from ftengine.commands import ADDED_KEY, EPOCH_KEY, REMOVED_KEY, CommandResult
from ftengine.faults import Phase
from ftengine.testbed.cluster.config import ClusterConfig
from ftengine.testbed.cluster.handles import WorkerHandle
from ftengine.testbed.cluster.protocol import FtCommand, FtReply, RankReady
from ftengine.testbed.cluster.roster import Roster


class CommandRelay:
    """Relays ``retry`` / ``scale_down`` to a roster's live workers and merges their results."""

    def __init__(self, roster: Roster, config: ClusterConfig) -> None:
        self._roster = roster
        self._config = config
        self._replies: dict[str, dict[int, FtReply]] = {}

    def file_reply(self, reply: FtReply) -> None:
        """Called by a reader thread (roster lock held) for each FtReply."""
        waiting = self._replies.get(reply.request_id)
        if waiting is not None:
            waiting[reply.rank] = reply

    def apply(
        self, instruction: str, params: Mapping[str, object], request_id: str
    ) -> CommandResult:
        """Run the command on every live engine; success only if every one succeeded.

        ``scale_down`` first fences (SIGKILL) removed ranks that are still running, so a
        hung rank can never come back into a group the survivors rebuilt without it.
        """
        roster = self._roster
        if instruction == "scale_up":
            return self._scale_up(params, request_id)
        with roster.lock:
            dead = [w for w in roster.workers() if not w.alive and not w.removed]
        if instruction == "retry" and dead:
            ranks = [w.rank for w in dead]
            return CommandResult(
                request_id,
                False,
                f"engine {ranks[0]} status is DEAD ({dead[0].exit_info}): retry cannot revive it;"
                f" send scale_down with removed_dp_ranks {ranks}",
            )
        removed = _removed_ranks(params) if instruction == "scale_down" else frozenset()
        for rank in sorted(removed):
            if 0 <= rank < self._config.dp_size:
                roster.retire(rank, f"removed by scale_down {request_id}")
        with roster.lock:
            targets = [w for w in roster.workers() if w.member and w.rank not in removed]
            self._replies[request_id] = {}
        for worker in targets:
            worker.send(FtCommand(instruction, dict(params), request_id))
        answers = self._collect(request_id, targets)
        failures = [f"engine {r}: {why}" for r, why in sorted(answers.items()) if why is not None]
        if not failures and instruction == "scale_down":
            with roster.lock:
                for worker in roster.workers():
                    if worker.rank in removed:
                        worker.remove()  # retired above, so its exit is filed
        return CommandResult(request_id, not failures, "; ".join(failures) or None)

    def _scale_up(self, params: Mapping[str, object], request_id: str) -> CommandResult:
        """Every member validates and runs the admission; each returning rank named in
        ``added_dp_ranks`` joins with the members' removed set and epoch."""
        added = _ranks(params, ADDED_KEY)
        with self._roster.lock:
            members = [w for w in self._roster.workers() if w.member]
            joiners = [w for w in self._roster.workers() if w.joining and w.alive]
            joiners = [w for w in joiners if w.rank in added]
            state = _deployment_state(members)
            self._replies[request_id] = {}
        for worker in members:
            worker.send(FtCommand("scale_up", dict(params), request_id))
        for worker in joiners:
            worker.send(FtCommand("scale_up", {**params, **state}, request_id))
        return self._result(request_id, self._collect(request_id, members + joiners))

    def announce_ready(self, request_id: str) -> CommandResult:
        """Tell every member which removed ranks wait, ready (at a step boundary: the caller
        holds the steps); when the members' policy admits them at once, send the returning
        ranks their part of the scale-up and wait for everyone. ``success`` is whether every
        member took the news (and every admission that started succeeded)."""
        roster = self._roster
        with roster.lock:
            members = [w for w in roster.workers() if w.member]
            ready = [w for w in roster.workers() if w.joining and w.engine_phase() is Phase.READY]
            state = _deployment_state(members)
            seen = {w.rank: len(w.phases) for w in members}
            self._replies[request_id] = {}
        ranks = tuple(sorted(w.rank for w in ready))
        for worker in members:
            worker.send(RankReady(ranks, request_id))
        if not ready:
            return self._result(request_id, self._collect(request_id, members))
        # A member whose policy admits them enters scaling_up (and blocks in the new group's
        # rendezvous until the returning ranks come); one that does not answers at once.
        deadline = time.monotonic() + self._config.command_timeout_s
        with roster.lock:
            got = self._replies[request_id]

            def admitting(w: WorkerHandle) -> bool:
                return any(e.dest == Phase.SCALING_UP.value for e in w.phases[seen[w.rank] :])

            while time.monotonic() < deadline:
                if all(w.rank in got or admitting(w) or not w.alive for w in members):
                    break
                roster.lock.wait(0.05)
            started = any(admitting(w) for w in members)
        if not started:  # the policy waits for a scale_up command
            return self._result(request_id, self._collect(request_id, members))
        join = {ADDED_KEY: list(ranks), **state}
        for worker in ready:
            worker.send(FtCommand("scale_up", join, request_id))
        return self._result(request_id, self._collect(request_id, members + ready))

    def _result(self, request_id: str, answers: Mapping[int, str | None]) -> CommandResult:
        failures = [f"engine {r}: {why}" for r, why in sorted(answers.items()) if why is not None]
        return CommandResult(request_id, not failures, "; ".join(failures) or None)

    def _collect(self, request_id: str, targets: list[WorkerHandle]) -> dict[int, str | None]:
        """Each target's failure reason (None: it succeeded), waiting up to the command timeout."""
        timeout = self._config.command_timeout_s
        deadline = time.monotonic() + timeout
        with self._roster.lock:
            got = self._replies[request_id]
            while time.monotonic() < deadline:
                if not [w for w in targets if w.rank not in got and w.alive]:
                    break
                self._roster.lock.wait(0.05)
            del self._replies[request_id]
            out: dict[int, str | None] = {}
            for w in targets:
                reply = got.get(w.rank)
                if reply is not None:
                    out[w.rank] = None if reply.success else (reply.reason or "failed")
                elif not w.alive:
                    out[w.rank] = f"worker process {w.exit_info} during the command"
                else:
                    out[w.rank] = f"no answer within {timeout:.0f}s"
        return out


def _removed_ranks(params: Mapping[str, object]) -> frozenset[int]:
    """The ints in ``params["removed_dp_ranks"]`` (the engines validate the rest)."""
    return _ranks(params, REMOVED_KEY)


def _ranks(params: Mapping[str, object], key: str) -> frozenset[int]:
    """The ints in ``params[key]`` (the engines validate the rest)."""
    ranks = params.get(key)
    if not isinstance(ranks, list | tuple):
        return frozenset()
    return frozenset(r for r in ranks if isinstance(r, int) and not isinstance(r, bool))


def _deployment_state(members: list[WorkerHandle]) -> dict[str, object]:
    """The members' removed set and epoch, as the lowest member last reported them (what a
    returning rank adopts; every member checks the same values against its own)."""
    status = next((w.status for w in members if w.status is not None), None)
    if status is None:
        return {}
    return {REMOVED_KEY: list(status["removed_ranks"]), EPOCH_KEY: int(status["epoch"])}
