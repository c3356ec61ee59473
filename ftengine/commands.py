"""Orchestrator commands: parsing and validating vLLM's ``retry`` / ``scale_down`` requests and
ftengine's ``scale_up`` (its mirror: admit removed ranks back), ``CommandResult``, and the
request-id log that makes a replayed command return its first result.
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

Instruction = Literal["retry", "scale_down", "scale_up"]
INSTRUCTIONS: tuple[Instruction, ...] = ("retry", "scale_down", "scale_up")
REMOVED_KEY = "removed_dp_ranks"
ADDED_KEY = "added_dp_ranks"
EPOCH_KEY = "epoch"
SCALE_UP_KEYS = (ADDED_KEY, REMOVED_KEY, EPOCH_KEY)


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
    """A parsed command. ``removed`` is the cumulative removed set for ``scale_down``.

    ``scale_up``: ``added`` the ranks to admit, in the order given (duplicates kept, so
    validation can name them); ``removed`` / ``epoch`` the deployment's removed set and
    process-group epoch *before* the admission, when the sender gave them (``None`` if
    not): a survivor checks them against its own, a returning rank adopts them.
    """

    instruction: Instruction
    removed: frozenset[int] = frozenset()
    added: tuple[int, ...] = ()
    known_removed: frozenset[int] | None = None
    epoch: int | None = None


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
    if instruction == "scale_up":
        return _parse_scale_up(params)
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


def _dp_ranks(key: str, ranks: object) -> list[int]:
    if not isinstance(ranks, (list, tuple)):
        raise CommandRejected(f"{key} must be a list of DP ranks (ints >= 0), got {ranks!r}")
    bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or r < 0]
    if bad:
        raise CommandRejected(f"{key} must hold DP ranks (ints >= 0), found {bad!r}")
    return list(ranks)


def _parse_scale_up(params: Mapping[object, object]) -> Command:
    extra = sorted(str(key) for key in params if key not in SCALE_UP_KEYS)
    if extra or ADDED_KEY not in params:
        raise CommandRejected(
            f"scale_up takes params {{{ADDED_KEY!r}: [int, ...]}} (original DP ranks to admit;"
            f" optionally {REMOVED_KEY!r} and {EPOCH_KEY!r}, the deployment's state before "
            f"the admission), got {dict(params)!r}"
        )
    added = _dp_ranks(ADDED_KEY, params[ADDED_KEY])
    known = None
    if REMOVED_KEY in params:
        known = frozenset(_dp_ranks(REMOVED_KEY, params[REMOVED_KEY]))
    epoch = params.get(EPOCH_KEY)
    if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0):
        raise CommandRejected(f"{EPOCH_KEY} must be an int >= 0, got {epoch!r}")
    return Command("scale_up", added=tuple(added), known_removed=known, epoch=epoch)


def scale_up_problems(
    command: Command,
    *,
    rank: int,
    world_size: int,
    removed: frozenset[int],
    ready: frozenset[int],
    epoch: int,
) -> list[str]:
    """Every reason a survivor (``rank``, whose removed set is ``removed`` and epoch
    ``epoch``) refuses to admit ``command.added``: empty, duplicated, out of range, its
    own rank, not removed, not ready (``ready`` as the caller reported it), or a
    ``removed_dp_ranks`` / ``epoch`` the sender gave that is not this engine's."""
    added = command.added
    if not added:
        return [f"{ADDED_KEY} is empty: name at least one removed DP rank to admit"]
    problems = []
    twice = sorted({r for r in added if added.count(r) > 1})
    if twice:
        problems.append(f"{ADDED_KEY} names ranks {twice} more than once")
    ranks = frozenset(added)
    unknown = sorted(ranks - frozenset(range(world_size)))
    if unknown:
        problems.append(f"ranks {unknown} are out of range: not DP ranks 0..{world_size - 1}")
    if rank in ranks:
        problems.append(f"{ADDED_KEY} contains this engine's own rank {rank}, which serves")
    live = sorted(ranks - removed - {rank} - frozenset(unknown))
    if live:
        problems.append(f"ranks {live} were not removed (removed: {sorted(removed)})")
    waiting = sorted((ranks & removed) - ready)
    if waiting:
        problems.append(
            f"ranks {waiting} are not ready: they have not loaded and reported ready "
            f"(ready: {sorted(ready & removed)})"
        )
    if command.known_removed is not None and command.known_removed != removed:
        problems.append(
            f"{REMOVED_KEY} {sorted(command.known_removed)} is not this engine's removed set "
            f"{sorted(removed)}"
        )
    if command.epoch is not None and command.epoch != epoch:
        problems.append(f"{EPOCH_KEY} {command.epoch} is not this engine's epoch {epoch}")
    return problems


def join_problems(command: Command, *, rank: int, world_size: int) -> list[str]:
    """Every reason a returning rank refuses ``command`` (a scale-up naming it): it must be
    among the added ranks, and the deployment's removed set must contain every added rank."""
    problems = []
    added = frozenset(command.added)
    if rank not in added:
        problems.append(
            f"this engine (rank {rank}) is waiting to be admitted; {ADDED_KEY} "
            f"{sorted(added)} does not name it"
        )
    unknown = sorted(added - frozenset(range(world_size)))
    if unknown:
        problems.append(f"ranks {unknown} are out of range: not DP ranks 0..{world_size - 1}")
    if len(added) != len(command.added):
        problems.append(f"{ADDED_KEY} names a rank more than once")
    if command.known_removed is None or command.epoch is None:
        problems.append(
            f"a returning rank needs the deployment's {REMOVED_KEY!r} and {EPOCH_KEY!r} "
            "before the admission (from a survivor's status), in the params or from loaded()"
        )
    elif not added <= command.known_removed:
        problems.append(
            f"ranks {sorted(added - command.known_removed)} are not in the deployment's "
            f"removed set {sorted(command.known_removed)}"
        )
    return problems


def check_scale_up_phase(phase: Phase, engine_id: int, removed: frozenset[int]) -> None:
    """``scale_up`` runs on a healthy survivor with removed ranks, or on a ready returning
    rank; anything else is rejected with the phase."""
    if phase is Phase.HEALTHY or phase is Phase.READY:
        return
    if phase is Phase.RUNNING and not removed:
        raise CommandRejected(
            f"engine {engine_id} has removed no rank (phase running): nothing to scale up"
        )
    raise CommandRejected(
        f"engine {engine_id} status is {phase.health.name} (phase {phase.value}); scale_up is "
        "only accepted while HEALTHY (a survivor) or READY (the returning rank)"
    )


def check_phase(
    phase: Phase, instruction: str, engine_id: int, in_flight: str | None = None
) -> None:
    """Commands run only while UNHEALTHY and not already recovering (vLLM's rule), nor while
    ``in_flight`` (a backend action of an interrupted recovery) has not returned yet."""
    if phase.rejoining:
        raise CommandRejected(
            f"engine {engine_id} is a returning rank (phase {phase.value}), not a member yet; "
            f"{instruction} does not apply to it, only scale_up once it is ready"
        )
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
