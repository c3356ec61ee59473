"""Lockstep generation on the cluster: every live DP rank runs every step (ranks without a
request run an empty one, like vLLM's DP busy loop), requests stay on the rank that
holds their KV cache, and a failed step aborts every in-flight request. With fault
tolerance on, a rank that stays silent after its peers failed is fenced, and a failed step
with every rank alive is announced to the ranks as a transient fault; with it off, neither.

:meth:`StepRunner.step` is the primitive (one step, any items per rank; a request a rank
rejects fails alone); :meth:`StepRunner.run` is one synchronous batch built on it, and
``ftengine.testbed.cluster.serving`` the continuous-batching loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping, Sequence

import attrs

from ftengine.errors import ConfigError, FTEngineError
from ftengine.faults import FaultKind, Phase
from ftengine.testbed.cluster.config import ClusterConfig
from ftengine.testbed.cluster.handles import WorkerHandle
from ftengine.testbed.cluster.protocol import (
    PeerFault,
    StepItem,
    StepOutput,
    StepReply,
    StepRequest,
)
from ftengine.testbed.cluster.roster import Roster

# Step errors that only say a peer misbehaved (the rank itself is not the culprit).
PEER_ERROR_TYPES = frozenset({"PeerDead", "CollectiveTimeout", "NotServing"})
HUNG_GRACE_S = 2.0  # after a peer's op timeout, how much longer a silent rank may take


class RequestAborted(FTEngineError, RuntimeError):
    """The cluster is not serving, or a fault hit the step: the request was aborted."""


class StepFailed(RequestAborted):
    """A fault hit the step. ``failed``: the ranks whose step failed; ``culprits``: those
    that raised an error of their own (not a peer's), the ranks a poison request may be on.
    With re-inference on, the items' caches were kept up to the step before (it is re-run).
    ``refused``: every failed rank only refused the step as not serving (nothing ran)."""

    def __init__(
        self,
        message: str,
        failed: frozenset[int],
        culprits: frozenset[int],
        refused: bool = False,
    ) -> None:
        super().__init__(message)
        self.failed = failed
        self.culprits = culprits
        self.refused = refused


@attrs.frozen
class Generation:
    """One request's output: greedy ``token_ids`` and the ``final_logits`` [vocab] behind
    the last of them (float32 values)."""

    token_ids: tuple[int, ...]
    final_logits: tuple[float, ...]


@attrs.frozen
class StepResult:
    """One lockstep step's outcome: every computed request's output by request id, and the
    requests a rank rejected (request id -> why; each failed alone, the step went on);
    ``lost``: those rejected because their KV cache was not the length the item expected
    (to recompute, not to fail)."""

    outputs: Mapping[str, StepOutput]
    rejected: Mapping[str, str]
    lost: frozenset[str] = frozenset()


@attrs.define
class _Request:
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    rank: int
    generated: list[int] = attrs.field(factory=list)
    logits: tuple[float, ...] = ()

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.max_tokens

    def item(self) -> StepItem:
        tokens = self.prompt if not self.generated else (self.generated[-1],)
        return StepItem(self.request_id, tokens, len(self.generated) + 1 == self.max_tokens)


class StepRunner:
    """Runs lockstep steps on a roster's live workers: single steps, or whole batches."""

    def __init__(self, roster: Roster, config: ClusterConfig) -> None:
        self._roster = roster
        self._config = config
        self._replies: dict[int, dict[int, StepReply]] = {}
        self._next_step = 0
        self._next_request = 0
        self._release: dict[int, list[str]] = {}
        self._release_lock = threading.Lock()  # release() comes from a serving loop's thread

    @property
    def steps_run(self) -> int:
        """Model steps started so far (the step number fault injection counts)."""
        return self._next_step

    def file_reply(self, reply: StepReply) -> None:
        """Called by a reader thread (roster lock held) for each StepReply."""
        waiting = self._replies.get(reply.step)
        if waiting is not None:
            waiting[reply.rank] = reply

    def serving_ranks(self) -> tuple[int, ...]:
        """The live ranks, when every one of them serves; raises RequestAborted otherwise."""
        return tuple(worker.rank for worker in self._serving_workers())

    def step(self, items: Mapping[int, Sequence[StepItem]]) -> StepResult:
        """Run one step on every live rank, rank ``r`` computing ``items[r]`` (a rank without
        items runs an empty step). Raises RequestAborted when the cluster is not serving, an
        item names a rank that does not serve, or the step failed (every item's cache is
        then dropped: the requests are aborted)."""
        workers = self._serving_workers()
        stray = sorted(set(items) - {worker.rank for worker in workers})
        if stray:
            raise RequestAborted(
                f"ranks {stray} hold requests but no longer serve (live ranks "
                f"{[w.rank for w in workers]}); the requests were aborted"
            )
        return self._step(workers, items)

    def release(self, rank: int, request_ids: Iterable[str]) -> None:
        """Drop these requests' caches on ``rank`` with its next step (finished or aborted)."""
        with self._release_lock:
            self._release.setdefault(rank, []).extend(request_ids)

    def run(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[Generation]:
        """Generate ``max_tokens`` tokens for each prompt; raises RequestAborted on a fault
        (or when a rank rejects a prompt: the others are aborted with it)."""
        if max_tokens < 1 or not prompts or any(len(p) == 0 for p in prompts):
            raise ConfigError(
                f"generation needs max_tokens >= 1 and non-empty prompts, found "
                f"max_tokens={max_tokens}, prompt lengths {[len(p) for p in prompts]}"
            )
        workers = self._serving_workers()
        requests = []
        for i, prompt in enumerate(prompts):
            self._next_request += 1
            rank = workers[i % len(workers)].rank
            requests.append(_Request(f"req-{self._next_request}", tuple(prompt), max_tokens, rank))
        try:
            while not all(r.done for r in requests):
                self._advance(workers, requests)
        finally:
            for r in requests:
                self.release(r.rank, [r.request_id])
        return [Generation(tuple(r.generated), r.logits) for r in requests]

    def _advance(self, workers: list[WorkerHandle], requests: list[_Request]) -> None:
        items: dict[int, list[StepItem]] = {}
        for r in requests:
            if not r.done:
                items.setdefault(r.rank, []).append(r.item())
        result = self._step(workers, items)
        if result.rejected:
            why = "; ".join(f"{rid}: {reason}" for rid, reason in sorted(result.rejected.items()))
            raise RequestAborted(f"a rank rejected part of the batch ({why}); batch aborted")
        for request in requests:
            out = result.outputs.get(request.request_id)
            if out is not None:
                request.generated.append(out.next_token)
                if out.logits is not None:
                    request.logits = out.logits

    def _serving_workers(self) -> list[WorkerHandle]:
        with self._roster.lock:
            workers = self._roster.workers()
            down = [w.rank for w in workers if not w.alive and not w.removed]
            if down:
                raise RequestAborted(
                    f"cluster is not serving: engine {down[0]} status is DEAD; "
                    "scale it down (or wait for auto-recovery) first"
                )
            live = [w for w in workers if w.member]  # a returning rank serves once admitted
            unhealthy = [w for w in live if not _serving(w.engine_phase())]
            if unhealthy or not live:
                phases = {w.rank: str(w.status and w.status["phase"]) for w in unhealthy}
                raise RequestAborted(
                    f"cluster is not serving: engines {phases} are not healthy; "
                    "recover them (retry / scale_down) first"
                )
            return live

    def _step(
        self, workers: list[WorkerHandle], items: Mapping[int, Sequence[StepItem]]
    ) -> StepResult:
        step = self._next_step
        self._next_step += 1
        with self._roster.lock:
            self._replies[step] = {}
        for worker in workers:
            with self._release_lock:
                release = tuple(self._release.pop(worker.rank, []))
            worker.send(StepRequest(step, tuple(items.get(worker.rank, ())), release))
        replies = self._collect(step, workers)
        outcomes = {w.rank: _failure(w, replies.get(w.rank)) for w in workers}
        failed = {rank: why for rank, why in outcomes.items() if why is not None}
        if failed:
            self._abort(step, workers, replies, failed, items)
        return StepResult(
            outputs={out.request_id: out for reply in replies.values() for out in reply.outputs},
            rejected={
                item.request_id: f"rank {reply.rank}: {item.reason}"
                for reply in replies.values()
                for item in reply.rejected
            },
            lost=frozenset(
                item.request_id
                for reply in replies.values()
                for item in reply.rejected
                if item.cache_lost
            ),
        )

    def _collect(self, step: int, workers: list[WorkerHandle]) -> dict[int, StepReply]:
        """Wait for every live worker's reply; fence a worker that stays silent once its
        peers have failed (a hung main thread) or past a generous step budget."""
        cfg = self._config
        watch_hung = cfg.fault_tolerance
        budget = 60.0 + 10 * cfg.op_timeout_s
        start = time.monotonic()
        trouble_at: float | None = None
        with self._roster.lock:
            while True:
                got = self._replies[step]
                pending = [w for w in workers if w.rank not in got and w.alive]
                if not pending:
                    break
                now = time.monotonic()
                if trouble_at is None and (
                    any(r.error for r in got.values()) or any(not w.alive for w in workers)
                ):
                    trouble_at = now
                late = trouble_at is not None and now > trouble_at + cfg.op_timeout_s + HUNG_GRACE_S
                if watch_hung and (late or now > start + budget):
                    for w in pending:
                        self._roster.fence(w.rank, f"hung: no reply to step {step}")
                self._roster.lock.wait(0.05)
            return self._replies.pop(step)

    def _abort(
        self,
        step: int,
        workers: list[WorkerHandle],
        replies: dict[int, StepReply],
        failed: dict[int, str],
        items: Mapping[int, Sequence[StepItem]],
    ) -> None:
        detail = "; ".join(f"rank {rank}: {why}" for rank, why in sorted(failed.items()))
        self._roster.record("step_failed", min(failed), f"step {step}: {detail}")
        if self._config.fault_tolerance and all(w.alive for w in workers):
            self._announce_transient(step, workers, replies, failed)
        culprits = frozenset(_culprits(replies, failed))
        if self._config.reinference_bounds is not None:
            refused = all(
                rank in replies and replies[rank].error_type == "NotServing" for rank in failed
            )
            raise StepFailed(
                f"step {step} failed ({detail}); its requests are held for re-inference",
                frozenset(failed),
                culprits,
                refused,
            )
        for rank, mine in items.items():
            self.release(rank, [item.request_id for item in mine])
        raise StepFailed(
            f"step {step} failed ({detail}); all in-flight requests were aborted",
            frozenset(failed),
            culprits,
        )

    def _announce_transient(
        self,
        step: int,
        workers: list[WorkerHandle],
        replies: dict[int, StepReply],
        failed: dict[int, str],
    ) -> None:
        """Every rank is alive after a failed step: tell the others it was a transient fault.

        A peer only saw a closed connection or a timeout (which reads like a dead or hung
        peer); the supervisor knows nobody died, so the survivors recover together by retry.
        A step that lost a process is announced by the exit watch instead.
        """
        local = _culprits(replies, failed)
        culprit = local[0] if local else None
        notice = PeerFault(
            FaultKind.TRANSIENT,
            culprit,
            f"step {step} failed on ranks {sorted(failed)} and every rank is alive",
        )
        for worker in workers:
            if worker.rank not in local:
                worker.send(notice)


def _culprits(replies: Mapping[int, StepReply], failed: Mapping[int, str]) -> list[int]:
    """The failed ranks that raised an error of their own (not a dead or hung peer's)."""
    return [
        rank
        for rank in sorted(failed)
        if rank in replies and replies[rank].error_type not in PEER_ERROR_TYPES
    ]


def _failure(worker: WorkerHandle, reply: StepReply | None) -> str | None:
    if reply is None:
        return f"process {worker.exit_info or 'gone'}"
    if reply.error is not None:
        return f"{reply.error_type}: {reply.error}"
    return None


def _serving(phase: Phase | None) -> bool:
    """A worker serves once it has reported a serving phase (no report yet: not serving)."""
    return phase is not None and phase.serving
