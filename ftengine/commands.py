"""Orchestrator commands: parsing and validating vLLM's ``retry`` / ``scale_down`` requests,
``CommandResult``, and the request-id log that makes a replayed command return its first result.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Literal

import attrs

from ftengine.context import RedundancyFacts
from ftengine.errors import CommandRejected
from ftengine.faults import Phase

Instruction = Literal["retry", "scale_down"]
INSTRUCTIONS: tuple[Instruction, ...] = ("retry", "scale_down")
REMOVED_KEY = "removed_dp_ranks"


@attrs.frozen
class CommandResult:
    """vLLM's ``FaultToleranceResult``: did the command's recovery succeed, and why not."""

    request_id: str
    success: bool
    reason: str | None = None

    def to_dict(self) -> dict[str, object]:
        """JSON-able ``{"request_id", "success", "reason"}``."""
        return {"request_id": self.request_id, "success": self.success, "reason": self.reason}


@attrs.frozen
class Command:
    """A parsed command. ``removed`` is the cumulative removed set for ``scale_down``."""

    instruction: Instruction
    removed: frozenset[int] = frozenset()


def check_instruction(instruction: object) -> Instruction:
    """``instruction`` if it is one ftengine knows, else ``CommandRejected``."""
    for known in INSTRUCTIONS:
        if instruction == known:
            return known
    raise CommandRejected(
        f"unknown instruction {instruction!r}: expected one of {list(INSTRUCTIONS)}"
    )


def parse_command(instruction: object, params: object) -> Command:
    """Check the command's shape; raise ``CommandRejected`` saying what was expected."""
    instruction = check_instruction(instruction)
    if not isinstance(params, Mapping):
        raise CommandRejected(f"params must be a mapping, got {params!r}")
    if instruction == "retry":
        if params:
            raise CommandRejected(f"retry takes no params, got keys {sorted(map(str, params))}")
        return Command("retry")
    ranks = params.get(REMOVED_KEY)
    extra = sorted(str(key) for key in params if key != REMOVED_KEY)
    if extra or not isinstance(ranks, (list, tuple)):
        raise CommandRejected(
            f"scale_down takes params {{{REMOVED_KEY!r}: [int, ...]}} (original DP ranks), "
            f"got {dict(params)!r}"
        )
    bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or r < 0]
    if bad:
        raise CommandRejected(f"{REMOVED_KEY} must hold DP ranks (ints >= 0), found {bad!r}")
    return Command("scale_down", frozenset(ranks))


def check_phase(
    phase: Phase, instruction: str, engine_id: int, in_flight: str | None = None
) -> None:
    """Commands run only while UNHEALTHY and not already recovering (vLLM's rule), nor while
    ``in_flight`` (a backend action of an interrupted recovery) has not returned yet."""
    if phase is Phase.QUARANTINED:
        if in_flight is not None:
            raise CommandRejected(
                f"engine {engine_id} is still finishing {in_flight} of its interrupted "
                f"recovery; send {instruction} again once it returns"
            )
        return
    if phase.recovering:
        raise CommandRejected(
            f"engine {engine_id} is already recovering (phase {phase.value}); "
            f"send {instruction} again once its status is reported"
        )
    raise CommandRejected(
        f"engine {engine_id} status is {phase.health.name} (phase {phase.value}); "
        f"{instruction} is only accepted while UNHEALTHY"
    )


def scale_down_problems(
    removed: frozenset[int],
    *,
    rank: int,
    world_size: int,
    already_removed: frozenset[int],
    redundancy: RedundancyFacts | None,
) -> list[str]:
    """Every scale-down precondition (REFERENCE §2) that ``removed`` (cumulative) breaks."""
    if not removed:
        return [f"{REMOVED_KEY} is empty: name at least one dead DP rank"]
    problems = []
    unknown = sorted(removed - frozenset(range(world_size)))
    if unknown:
        problems.append(f"ranks {unknown} are not initial DP ranks (0..{world_size - 1})")
    if rank in removed:
        problems.append(f"{REMOVED_KEY} contains this engine's own rank {rank}")
    if frozenset(range(world_size)) <= removed:
        problems.append(f"{REMOVED_KEY} removes all {world_size} ranks; one must survive")
    if not already_removed <= removed:
        problems.append(
            f"{REMOVED_KEY} must include the ranks already removed "
            f"{sorted(already_removed)} (the set is cumulative)"
        )
    if removed <= already_removed:
        problems.append(
            f"{REMOVED_KEY} {sorted(removed)} names no newly dead rank "
            f"(already removed: {sorted(already_removed)})"
        )
    if redundancy is not None and not redundancy.survives(removed):
        problems.append(
            f"the survivors cannot host every expert: {redundancy.surviving_slots(removed)} "
            f"slots left < {redundancy.num_logical} logical experts"
        )
    return problems


class CommandLog:
    """Results by request id, so a replayed request returns its recorded result.

    Shares the engine's lock through ``condition``; every method must be called with that
    lock held. A replay of a request still running waits for its result.
    """

    def __init__(self, condition: threading.Condition, capacity: int = 1024) -> None:
        self._condition = condition
        self._capacity = capacity
        self._results: OrderedDict[str, CommandResult] = OrderedDict()
        self._running: set[str] = set()

    def recorded(self, request_id: str) -> CommandResult | None:
        """The recorded result of ``request_id`` (waiting while it runs), else ``None``."""
        self._condition.wait_for(lambda: request_id not in self._running)
        return self._results.get(request_id)

    def start(self, request_id: str) -> None:
        """Mark ``request_id`` as running."""
        self._running.add(request_id)

    def record(self, result: CommandResult) -> CommandResult:
        """Keep ``result`` (the oldest beyond ``capacity`` are forgotten) and wake waiters."""
        self._running.discard(result.request_id)
        self._results[result.request_id] = result
        while len(self._results) > self._capacity:
            self._results.popitem(last=False)
        self._condition.notify_all()
        return result
