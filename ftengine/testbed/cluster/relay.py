"""Orchestrator commands on the cluster: checked against what the supervisor knows (a dead,
unremoved rank makes ``retry`` pointless), relayed to every live worker's sentinel, and
answered with one CommandResult once every worker has answered.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from ftengine.commands import REMOVED_KEY, CommandResult
from ftengine.testbed.cluster.config import ClusterConfig
from ftengine.testbed.cluster.handles import WorkerHandle
from ftengine.testbed.cluster.protocol import FtCommand, FtReply
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
            targets = [w for w in roster.workers() if w.alive and w.rank not in removed]
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
    ranks = params.get(REMOVED_KEY)
    if not isinstance(ranks, list | tuple):
        return frozenset()
    return frozenset(r for r in ranks if isinstance(r, int) and not isinstance(r, bool))
