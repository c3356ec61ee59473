"""Typed views of a cluster status dict (vLLM's shape plus phase, epoch, timeline), as the
cluster reports it or as ``GET /fault_tolerance/status`` sends it.

The HTTP layer, health, metrics and the demo all read status through these views so a
change in the status dict is absorbed in one place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ftengine.errors import FTEngineError
from ftengine.faults import HealthStatus
from ftengine.timeline import StepRecord

# One recovery step of one attempt, as the engine's timeline records it.
StepMark = StepRecord


class StatusShapeError(FTEngineError, ValueError):
    """A cluster status dict lacks a field the control plane needs (a cluster bug)."""


@attrs.frozen
class PhaseMark:
    """One phase an engine entered: ``at`` is monotonic seconds (``time.monotonic``, the same
    clock in every process of this machine); ``source`` the phase it left."""

    source: str | None
    dest: str
    at: float
    reason: str = ""


@attrs.frozen
class Repair:
    """What expert repair did on one engine (``ftengine.backends.base.RepairReport``)."""

    reloads: int = 0
    reload_lower_bound: int = 0
    bytes_reloaded: int = 0


@attrs.frozen
class Episode:
    """One fault episode of one engine, from its first fault to healthy or dead.

    ``started`` is when the first fault was detected; ``ended`` None while it runs.
    """

    number: int
    fault_kinds: tuple[str, ...]
    started: float
    ended: float | None
    phases: tuple[PhaseMark, ...] = ()
    steps: tuple[StepMark, ...] = ()
    repair: Repair | None = None

    @property
    def recovery_kind(self) -> str | None:
        """``retry`` or ``scale_down``: the last recovery this episode started."""
        kinds = {"retrying": "retry", "scaling_down": "scale_down"}
        actions = [kinds[mark.dest] for mark in self.phases if mark.dest in kinds]
        return actions[-1] if actions else None

    @property
    def outcome(self) -> str | None:
        """The phase the episode ended in (``healthy`` / ``dead``), None while it runs."""
        return self.phases[-1].dest if self.ended is not None and self.phases else None

    def step(self, name: str) -> StepMark | None:
        """The last finished step called ``name``."""
        done = [s for s in self.steps if s.name == name and s.end is not None]
        return done[-1] if done else None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Episode:
        """Read ``ftengine.timeline.Timeline.to_dict()``."""
        try:
            faults = raw.get("faults") or [raw["fault"]]
            phases, source = [], "running"
            for entry in raw.get("phases") or ():
                phases.append(
                    PhaseMark(
                        source, str(entry["phase"]), float(entry["at"]), entry.get("reason") or ""
                    )
                )
                source = str(entry["phase"])
            return cls(
                number=int(raw.get("episode") or 0),
                fault_kinds=tuple(str(f["kind"]) for f in faults),
                started=float(raw["started"]),
                ended=None if raw.get("ended") is None else float(raw["ended"]),
                phases=tuple(phases),
                steps=tuple(StepMark.from_dict(step) for step in raw.get("steps") or ()),
                repair=_repair(raw.get("repair")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise StatusShapeError(
                f"timeline {dict(raw)!r} is not a Timeline.to_dict() (episode, faults, "
                f"started, ended, phases, steps, repair): {exc!r}"
            ) from exc


def _repair(raw: Mapping[str, Any] | None) -> Repair | None:
    if raw is None:
        return None
    return Repair(
        reloads=int(raw.get("reloads") or 0),
        reload_lower_bound=int(raw.get("reload_lower_bound") or 0),
        bytes_reloaded=int(raw.get("bytes_reloaded") or 0),
    )


def _episodes(raw: object) -> tuple[Episode, ...]:
    """An engine's ``timeline``: None, one episode dict, or a list of them."""
    if raw is None:
        return ()
    if isinstance(raw, Mapping):
        return (Episode.from_dict(raw),)
    if isinstance(raw, list | tuple):
        return tuple(Episode.from_dict(entry) for entry in raw)
    raise StatusShapeError(f"timeline must be null, an episode dict or a list, found {raw!r}")


@attrs.frozen
class EngineView:
    """One engine (DP rank) as the status dict reports it."""

    id: int
    status: HealthStatus
    phase: str
    fault_info: str | None = None
    ft_error: str | None = None
    last_ft_request_id: str | None = None
    removed_ranks: frozenset[int] = frozenset()
    epoch: int = 0
    episodes: tuple[Episode, ...] = ()
    fault_episodes: int = 0
    raw: Mapping[str, Any] = attrs.field(factory=dict, eq=False, repr=False)

    @property
    def episode(self) -> Episode | None:
        """The current (or last) fault episode, None if the engine never faulted."""
        return self.episodes[-1] if self.episodes else None

    @property
    def live(self) -> bool:
        """False once the engine is DEAD (a killed rank, or a terminal recovery failure)."""
        return self.status is not HealthStatus.DEAD

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> EngineView:
        """Read one entry of ``status()["engines"]``.

        ``episodes`` come from the entry's episode history (``"episodes"``, every recent
        episode as last reported) when it has one, else from its current ``"timeline"``;
        ``fault_episodes`` (cumulative) from ``"fault_episodes"``, else the last episode's
        number."""
        try:
            engine_id = int(raw["id"])
            status = _health(raw["status"])
        except (KeyError, TypeError, ValueError) as exc:
            raise StatusShapeError(
                f"engine entry {dict(raw)!r} needs an integer 'id' and a vLLM 'status' (0, 1, 2, "
                "or on the wire 'healthy', 'dead', 'unhealthy')"
            ) from exc
        episodes = _episodes(raw.get("episodes") or raw.get("timeline"))
        return cls(
            id=engine_id,
            status=status,
            phase=str(raw.get("phase") or status.name.lower()),
            fault_info=_opt_str(raw.get("fault_info")),
            ft_error=_opt_str(raw.get("ft_error")),
            last_ft_request_id=_opt_str(raw.get("last_ft_request_id")),
            removed_ranks=frozenset(int(rank) for rank in raw.get("removed_ranks") or ()),
            epoch=int(raw.get("epoch") or 0),
            episodes=episodes,
            fault_episodes=int(raw.get("fault_episodes") or max(_numbers(episodes), default=0)),
            raw=raw,
        )


@attrs.frozen
class ClusterView:
    """The whole cluster: ``total_engines`` is the original DP world size."""

    total_engines: int
    engines: tuple[EngineView, ...]

    @classmethod
    def from_status(cls, status: Mapping[str, Any]) -> ClusterView:
        """Read a ``Cluster.status()`` dict."""
        engines: Sequence[Mapping[str, Any]] = status.get("engines") or ()
        total = status.get("total_engines", len(engines))
        return cls(total_engines=int(total), engines=tuple(map(EngineView.from_dict, engines)))

    @property
    def live(self) -> tuple[EngineView, ...]:
        """Engines not DEAD."""
        return tuple(engine for engine in self.engines if engine.live)

    @property
    def removed_ranks(self) -> frozenset[int]:
        """Union of every engine's cumulative removed ranks."""
        return frozenset().union(*(engine.removed_ranks for engine in self.engines))

    @property
    def healthy(self) -> bool:
        """True when at least one engine is live and every live engine is HEALTHY."""
        live = self.live
        return bool(live) and all(engine.status is HealthStatus.HEALTHY for engine in live)

    def engine(self, engine_id: int) -> EngineView:
        """The engine with this id (original DP rank)."""
        for engine in self.engines:
            if engine.id == engine_id:
                return engine
        raise KeyError(f"no engine {engine_id}; engines are {[e.id for e in self.engines]}")


def _health(value: object) -> HealthStatus:
    """A status as the cluster reports it (vLLM's integer) or as vLLM's REST API sends it
    (the lower-case name)."""
    if isinstance(value, str):
        return HealthStatus[value.upper()]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"status must be an int or a name, found {value!r}")
    return HealthStatus(value)


def _numbers(episodes: Sequence[Episode]) -> list[int]:
    return [episode.number for episode in episodes]


def _opt_str(value: object) -> str | None:
    return None if value is None else str(value)
