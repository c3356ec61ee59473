"""In-memory stand-ins for ``ftengine.testbed.cluster.Cluster`` and its serving loop, for the
control-plane unit tests.

The cluster keeps vLLM's rules that the HTTP layer relies on (a DEAD engine rejects retry
with "status is DEAD", commands only while UNHEALTHY, scale-down must name a newly dead
rank); the service generates a fixed continuation while the cluster serves. Both record
every call so tests can prove that bad input changed nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from ftengine.clock import ManualClock
from ftengine.errors import BackendError
from ftengine.faults import Phase
from ftengine.recovery import sequence
from ftengine.testbed.control.served_model import ServedModel
from ftengine.testbed.model_limits import ModelLimits
from ftengine.testbed.serving_api import FinishReason, GenerationRequest, Listener, TokenEvent


@attrs.frozen
class Change:
    """Same fields as ``ftengine.testbed.cluster.protocol.PhaseEvent``."""

    source: str
    dest: str
    at: float
    reason: str


@attrs.frozen
class Event:
    """Same fields as ``ftengine.testbed.cluster.ClusterEvent``."""

    at: float
    kind: str
    rank: int | None
    detail: str


@attrs.frozen
class Generated:
    """Same fields as ``ftengine.testbed.cluster.Generation``."""

    token_ids: tuple[int, ...]
    final_logits: tuple[float, ...] = ()


def continuation(prompt: list[int], max_tokens: int) -> list[int]:
    """What the stand-in generates for ``prompt``."""
    return [(prompt[-1] + i + 1) % VOCAB for i in range(max_tokens)]


VOCAB = 1000
POISON = 666  # a prompt holding this id "cannot be computed": it fails alone (error)


@attrs.frozen
class Outcome:
    """Same fields as ``ftengine.engine.CommandResult``."""

    request_id: str
    success: bool
    reason: str | None = None


class Jobs:
    """A ``Spawn`` (see ``ftengine.testbed.control.ledger``) that queues jobs until the test
    runs them."""

    def __init__(self) -> None:
        self.queue: list[tuple[str, Callable[[], None]]] = []

    def __call__(self, job: Callable[[], None], name: str) -> None:
        self.queue.append((name, job))

    def run_all(self) -> None:
        while self.queue:
            _, job = self.queue.pop(0)
            job()


RETRY_STEPS = tuple(step.timeline for step in sequence(Phase.RETRYING))
SCALE_DOWN_STEPS = tuple(step.timeline for step in sequence(Phase.SCALING_DOWN))


class StandInCluster:
    """``world_size`` engines reporting ``Timeline.to_dict()``-shaped episodes; the manual
    clock advances one second per phase change and per recovery step."""

    def __init__(self, world_size: int = 4) -> None:
        self.world_size = world_size
        self.clock = ManualClock(100.0)
        self.phases = {rank: Phase.RUNNING for rank in range(world_size)}
        self.episodes: dict[int, dict[str, Any] | None] = dict.fromkeys(range(world_size))
        self.episode_count = dict.fromkeys(range(world_size), 0)
        self.fault_info: dict[int, str | None] = dict.fromkeys(range(world_size))
        self.removed: frozenset[int] = frozenset()
        self.epoch = 0
        self.calls: list[tuple[str, dict[str, object], str]] = []
        self.generated: list[list[int]] = []
        self.last_request: str | None = None
        self.ft_error: str | None = None
        self.during_recovery: Callable[[], None] = lambda: None
        self.changes: dict[int, list[Change]] = {rank: [] for rank in range(world_size)}
        self.exits: list[Event] = []
        self.killed: list[tuple[int, int]] = []

    # -- faults ---------------------------------------------------------------------------

    def inject(self, rank: int, kind: str = "transient") -> None:
        """A fault of ``kind`` on ``rank``: every live engine quarantines."""
        self.fault_info[rank] = "RuntimeError"
        for engine in self._live():
            self._fault(engine, kind, rank)

    def kill(self, rank: int, sig: int = 9) -> None:
        """``rank`` dies: it is DEAD, every other live engine quarantines (dead peer)."""
        self.killed.append((rank, sig))
        self.phases[rank] = Phase.DEAD
        self.fault_info[rank] = f"killed by signal {sig}"
        self.exits.append(Event(self.clock.now(), "exit", rank, f"killed by signal {sig}"))
        for engine in self._live():
            self._fault(engine, "dead_peer", rank)

    # -- the Cluster API ------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {
            "schema_version": 1,
            "total_engines": self.world_size,
            "engines": [self._engine(rank) for rank in range(self.world_size)],
        }

    def apply(self, instruction: str, params: Mapping[str, object], request_id: str) -> Outcome:
        self.calls.append((instruction, dict(params), request_id))
        self.last_request = request_id
        reason = self._reject_reason(instruction, params)
        if reason is not None:
            self.ft_error = reason
            return Outcome(request_id, False, reason)
        retry = instruction == "retry"
        for engine in self._live():
            self._phase(engine, Phase.RETRYING if retry else Phase.SCALING_DOWN, request_id)
        self.during_recovery()
        newly = frozenset() if retry else frozenset(_ranks(params)) - self.removed
        self.removed |= newly
        self.epoch += 1
        for engine in self._live():
            for step in RETRY_STEPS if retry else SCALE_DOWN_STEPS:
                self._step(engine, step, 1)
            if not retry:
                episode = self._episode(engine)
                episode["repair"] = {
                    "reloads": 8 * len(newly),
                    "reload_lower_bound": 4 * len(newly),
                    "bytes_reloaded": 8000 * len(newly),
                    "reloaded": [],
                }
            self._phase(engine, Phase.HEALTHY, "recovered")
            self._episode(engine)["ended"] = self.clock.now()
            self.fault_info[engine] = None
        self.ft_error = None
        return Outcome(request_id, True, None)

    def generate(self, prompt_token_ids: list[int], max_tokens: int) -> list[int]:
        live = self._live()
        if not live or any(not self.phases[r].serving for r in live):
            raise BackendError("cluster is recovering; no healthy DP rank to serve")
        self.generated.append(list(prompt_token_ids))
        return continuation(prompt_token_ids, max_tokens)

    def generate_batch(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[Generated]:
        return [Generated(tuple(self.generate(list(p), max_tokens))) for p in prompts]

    def phase_changes(self) -> dict[int, list[Change]]:
        return {rank: list(changes) for rank, changes in self.changes.items()}

    def events(self) -> list[Event]:
        return list(self.exits)

    def live_ranks(self) -> frozenset[int]:
        return frozenset(r for r in self._live() if r not in self.removed)

    # -- helpers --------------------------------------------------------------------------

    def _live(self) -> list[int]:
        return [rank for rank, phase in self.phases.items() if phase is not Phase.DEAD]

    def _reject_reason(self, instruction: str, params: Mapping[str, object]) -> str | None:
        dead = {r for r, p in self.phases.items() if p is Phase.DEAD} - self.removed
        if instruction == "retry" and dead:
            return f"engine {min(dead)} cannot retry: status is DEAD"
        if any(self.phases[r] is not Phase.QUARANTINED for r in self._live()):
            return "engines are not UNHEALTHY: status is HEALTHY"
        if instruction == "scale_down" and not set(_ranks(params)) - self.removed & dead:
            return f"removed_dp_ranks {_ranks(params)} names no newly dead rank"
        return None

    def _fault(self, rank: int, kind: str, culprit: int) -> None:
        self.clock.advance(1.0)
        fault = {"kind": kind, "rank": culprit, "step": None, "info": kind, "at": self.clock.now()}
        if self.phases[rank].serving:
            self.episode_count[rank] += 1
            self.episodes[rank] = {
                "episode": self.episode_count[rank],
                "fault": fault,
                "faults": [fault],
                "started": fault["at"],
                "ended": None,
                "phases": [],
                "decisions": [],
                "steps": [],
                "repair": None,
            }
            self._step(rank, "detect", 0)
            self._phase(rank, Phase.QUARANTINED, f"{kind} fault on rank {culprit}")
            self._step(rank, "quarantine", 1)
        else:
            self._episode(rank)["faults"].append(fault)

    def _episode(self, rank: int) -> dict[str, Any]:
        episode = self.episodes[rank]
        assert episode is not None
        return episode

    def _phase(self, rank: int, dest: Phase, reason: str) -> None:
        self.clock.advance(1.0)
        self.changes[rank].append(
            Change(self.phases[rank].value, dest.value, self.clock.now(), reason)
        )
        self.phases[rank] = dest
        entry = {"phase": dest.value, "at": self.clock.now(), "reason": reason}
        self._episode(rank)["phases"].append(entry)

    def _step(self, rank: int, name: str, seconds: float) -> None:
        start = self.clock.now()
        self.clock.advance(seconds)
        step = {"name": name, "attempt": 0, "start": start, "end": self.clock.now()}
        self._episode(rank)["steps"].append({**step, "seconds": seconds, "ok": True, "error": None})

    def _engine(self, rank: int) -> dict[str, Any]:
        phase = self.phases[rank]
        return {
            "id": rank,
            "status": int(phase.health),
            "fault_info": self.fault_info[rank],
            "last_ft_request_id": self.last_request,
            "ft_error": self.ft_error,
            "phase": phase.value,
            "removed_ranks": sorted(self.removed),
            "epoch": self.epoch,
            "attempts": 0,
            "timeline": self.episodes[rank],
        }


def _ranks(params: Mapping[str, object]) -> list[int]:
    ranks = params["removed_dp_ranks"]
    assert isinstance(ranks, list)
    return ranks


class StandInTicket:
    def __init__(self, service: StandInService, request: GenerationRequest) -> None:
        self._service = service
        self._request = request

    def cancel(self) -> None:
        self._service.cancelled.append(self._request)


class StandInService:
    """A ``GenerationService`` over a ``StandInCluster``: serves while the cluster does,
    emitting ``continuation`` token by token (synchronously, inside ``submit``).

    ``abort_after`` aborts every request after that many tokens (a fault mid-generation).
    """

    def __init__(self, cluster: StandInCluster) -> None:
        self.cluster = cluster
        self.requests: list[GenerationRequest] = []
        self.cancelled: list[GenerationRequest] = []
        self.abort_after: int | None = None

    def submit(self, request: GenerationRequest, listener: Listener) -> StandInTicket:
        live = self.cluster._live()
        if not live or any(
            self.cluster.phases[r] not in (Phase.RUNNING, Phase.HEALTHY) for r in live
        ):
            raise BackendError("cluster is recovering; no healthy DP rank to serve")
        self.requests.append(request)
        if POISON in request.prompt_token_ids:
            listener(TokenEvent(finish_reason=FinishReason.ERROR, detail="rank 0: poisoned"))
            return StandInTicket(self, request)
        tokens = continuation(list(request.prompt_token_ids), request.max_tokens)
        for count, token in enumerate(tokens, start=1):
            if self.abort_after is not None and count > self.abort_after:
                listener(TokenEvent(finish_reason=FinishReason.ABORT, detail="step failed"))
                break
            if token in request.stop_token_ids:
                listener(TokenEvent((token,), FinishReason.STOP, stop_reason=token))
                break
            last = count == len(tokens)
            listener(TokenEvent((token,), FinishReason.LENGTH if last else None))
        return StandInTicket(self, request)


def standin_model(vocab: int = VOCAB, max_model_len: int = 64) -> ServedModel:
    """The model the stand-in service "serves" (token ids only: no tokenizer)."""
    return ServedModel(
        name="standin",
        root="/checkpoints/standin",
        limits=ModelLimits(vocab_size=vocab, max_model_len=max_model_len),
    )
