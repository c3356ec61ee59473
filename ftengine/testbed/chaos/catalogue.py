"""The fault catalogue and the seeded plan: which faults a campaign injects, in which phase,
on which ranks. The same seed always gives the same plan (``plan``), so a campaign replays.
``Injected`` is a planned fault as either campaign injected it."""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Sequence

import attrs


class ChaosKind(str, enum.Enum):
    """One kind of fault a campaign injects."""

    SIGKILL = "sigkill"
    SIGSTOP = "sigstop"
    STEP_RAISE = "step_raise"
    RELOAD_ERROR = "reload_error"
    SHARD_TRUNCATED = "shard_truncated"
    SHARD_REMOVED = "shard_removed"
    TWO_RANKS = "two_ranks"
    RANK0 = "rank0"
    NET_CUT = "net_cut"
    ENGINE_CORE = "engine_core"
    HOST = "host"  # every process of every rank on one host, at once (real vLLM on hosts)
    POISON = "poison"  # a request whose every step after its first token raises (real vLLM)


class When(str, enum.Enum):
    """The phase a fault lands in: steady serving, or while the previous fault's recovery
    command is running."""

    STEADY = "steady"
    RECOVERY = "recovery"


# Ranks each kind takes away (a reload fault also kills one rank: a reload only happens in
# the scale-down past a lost rank, and the fault must land inside that reload).
RANKS_LOST: dict[ChaosKind, int] = {
    ChaosKind.SIGKILL: 1,
    ChaosKind.SIGSTOP: 1,
    ChaosKind.STEP_RAISE: 0,
    ChaosKind.RELOAD_ERROR: 1,
    ChaosKind.SHARD_TRUNCATED: 1,
    ChaosKind.SHARD_REMOVED: 1,
    ChaosKind.TWO_RANKS: 2,
    ChaosKind.RANK0: 1,
    ChaosKind.NET_CUT: 1,
    ChaosKind.ENGINE_CORE: 1,
    ChaosKind.HOST: 2,  # the layout's ranks on the host (the campaign's victims say which)
    ChaosKind.POISON: 0,  # its rank faults, is retried; the request alone is aborted
}

# Kinds whose detection waits for a timeout (the op timeout or the heartbeat silence) rather
# than a closed socket or a raised error.
SILENT_KINDS = frozenset({ChaosKind.SIGSTOP, ChaosKind.NET_CUT})


@attrs.frozen
class PlannedFault:
    """Fault number ``index`` of a campaign: ``kind`` after ``delay_steps`` steps of traffic,
    in phase ``when``; ``pick`` chooses the victims among the ranks live at that moment
    (so the plan does not depend on timing)."""

    index: int
    kind: ChaosKind
    when: When
    delay_steps: int
    pick: int

    @property
    def ranks_lost(self) -> int:
        """How many ranks this fault takes away."""
        return RANKS_LOST[self.kind]

    def victims(self, live: Sequence[int]) -> tuple[int, ...]:
        """The ranks this fault hits among ``live`` (sorted): rank 0 for ``rank0`` when it
        is live, else ``ranks_lost`` (at least one) ranks chosen by ``pick``."""
        ranks = sorted(live)
        if self.kind is ChaosKind.RANK0 and 0 in ranks:
            return (0,)
        count = max(1, self.ranks_lost)
        start = self.pick % len(ranks)
        return tuple(sorted(ranks[(start + i) % len(ranks)] for i in range(count)))

    def describe(self) -> str:
        """``#3 sigkill steady +4 steps pick 17``."""
        return f"#{self.index} {self.kind.value} {self.when.value} +{self.delay_steps} steps"


def plan(
    seed: int,
    count: int,
    kinds: Sequence[ChaosKind],
    *,
    recovery_share: float = 0.2,
    max_delay_steps: int = 12,
) -> list[PlannedFault]:
    """``count`` faults drawn from ``kinds`` with ``random.Random(seed)``: every kind once
    first (in a seeded order) when ``count`` allows, then uniformly; about
    ``recovery_share`` of them land during the previous fault's recovery (never the first)."""
    if not kinds:
        raise ValueError("a campaign plan needs at least one fault kind, found none")
    rng = random.Random(seed)
    first = list(kinds)
    rng.shuffle(first)
    chosen = first[:count] + [rng.choice(list(kinds)) for _ in range(count - len(first))]
    faults = []
    for index, kind in enumerate(chosen):
        during = index > 0 and rng.random() < recovery_share
        faults.append(
            PlannedFault(
                index=index,
                kind=kind,
                when=When.RECOVERY if during else When.STEADY,
                delay_steps=rng.randint(1, max_delay_steps),
                pick=rng.randrange(1 << 16),
            )
        )
    return faults


def parse_only(text: str) -> tuple[int, ...]:
    """Fault numbers from ``29,30,36`` or ``24-40`` (ranges inclusive, mixable): the
    sub-plan ``--only`` replays."""
    chosen: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        low, dash, high = part.partition("-")
        try:
            first, last = int(low), int(high) if dash else int(low)
        except ValueError as exc:
            raise ValueError(
                f"expected fault numbers like 29,30,36 or 24-40, found {part!r}"
            ) from exc
        if first < 0 or last < first:
            raise ValueError(f"expected a range low-high with 0 <= low <= high, found {part!r}")
        chosen.update(range(first, last + 1))
    if not chosen:
        raise ValueError(f"expected at least one fault number, found {text!r}")
    return tuple(sorted(chosen))


def sub_plan(faults: Sequence[PlannedFault], only: Sequence[int] | None) -> list[PlannedFault]:
    """The faults of ``faults`` numbered in ``only`` (all when None), each keeping its number,
    kind, phase, delay and pick: the same faults as in the whole plan, on whatever ranks are
    live when they run."""
    if only is None:
        return list(faults)
    missing = sorted(set(only) - {f.index for f in faults})
    if missing:
        raise ValueError(f"faults {missing} are not in a plan of {len(faults)} faults")
    wanted = set(only)
    return [f for f in faults if f.index in wanted]


@attrs.define
class Injected:
    """A fault as injected: when (monotonic), on whom, the cluster step it landed at, and
    what puts the storage back (shard faults) once the reload it aimed at has run."""

    fault: PlannedFault
    at: float
    victims: tuple[int, ...]
    detectors: tuple[int, ...]  # the live ranks that must see it
    step: int
    repairs: list[Callable[[], None]] = attrs.field(factory=list)
    episodes: dict[int, int] = attrs.field(factory=dict)
    """Each detector's ``fault_episodes`` in the status just before: a step exception has
    shown in the status once every live detector's count went past it."""

    def repair(self) -> None:
        """Undo what the fault broke on disk (idempotent)."""
        while self.repairs:
            self.repairs.pop()()
