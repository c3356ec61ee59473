"""Reading status dicts: the engine's real ``Timeline.to_dict()`` parses into episodes, the
breakdown and throughput helpers compute what they claim, and bad shapes are named."""

from __future__ import annotations

import pytest

from ftengine.backends.base import RepairReport
from ftengine.faults import Fault, FaultKind, HealthStatus, Phase
from ftengine.testbed.bench.breakdown import breakdown, interruption_s
from ftengine.testbed.bench.traffic import Sample, tokens_per_second
from ftengine.testbed.bench.trials import summary
from ftengine.testbed.control.snapshot import ClusterView, EngineView, Episode, StatusShapeError
from ftengine.timeline import TimelineBuilder


def _episode(offset: float = 0.0, repair: RepairReport | None = None) -> Episode:
    """A real engine timeline: fault at 10.0, quarantine, scale-down steps, healthy at 10.9."""
    log = TimelineBuilder(1, Fault(FaultKind.DEAD_PEER, rank=3, at=10.0 + offset), 10.0 + offset)
    log.add_phase(Phase.QUARANTINED, 10.0 + offset, "dead_peer fault")
    for name, start, end in (
        ("quarantine", 10.0, 10.1),
        ("mask", 10.3, 10.35),
        ("comm_rebuild", 10.35, 10.5),
        ("expert_repair", 10.5, 10.8),
        ("validate", 10.8, 10.9),
    ):
        log.end_step(log.begin_step(name, 1, start + offset), end + offset)
        if name == "quarantine":
            log.add_phase(Phase.SCALING_DOWN, 10.3 + offset, "command sd-1")
    if repair is not None:
        log.set_repair(repair)
    log.add_phase(Phase.HEALTHY, 10.9 + offset, "scaling_down succeeded")
    return Episode.from_dict(log.snapshot().to_dict())


def test_the_engines_timeline_dict_parses() -> None:
    episode = _episode(repair=RepairReport(reloads=8, reload_lower_bound=4, bytes_reloaded=99))
    assert episode.number == 1 and episode.fault_kinds == ("dead_peer",)
    assert episode.started == 10.0 and episode.ended == 10.9
    assert [m.dest for m in episode.phases] == ["quarantined", "scaling_down", "healthy"]
    assert [m.source for m in episode.phases] == ["running", "quarantined", "scaling_down"]
    assert episode.recovery_kind == "scale_down" and episode.outcome == "healthy"
    repair = episode.repair
    assert repair is not None and (repair.reloads, repair.bytes_reloaded) == (8, 99)
    step = episode.step("expert_repair")
    assert step is not None and step.seconds == pytest.approx(0.3)
    assert episode.steps[0].name == "detect"


def test_breakdown_spans_the_survivors_and_measures_from_the_fault() -> None:
    episodes = [_episode(0.0), _episode(0.02)]
    rows = {row.name: row for row in breakdown(episodes, fault_at=9.95, first_correct_at=11.0)}
    assert list(rows) == [
        "detect",
        "quarantine",
        "decide / command",
        "mask dead ranks",
        "comm rebuild",
        "expert repair",
        "validate",
        "first correct token",
    ]
    assert rows["detect"].seconds == pytest.approx(0.05)
    assert rows["quarantine"].start_s == pytest.approx(0.05)
    assert rows["quarantine"].seconds == pytest.approx(0.12)
    assert rows["decide / command"].seconds == pytest.approx(0.2)
    assert rows["expert repair"].seconds == pytest.approx(0.32)
    assert rows["first correct token"].start_s == pytest.approx(10.92 - 9.95)
    assert rows["first correct token"].seconds == pytest.approx(11.0 - 10.92)
    assert interruption_s(9.95, 11.0) == pytest.approx(1.05)
    assert interruption_s(9.95, None) is None
    assert breakdown([], fault_at=0.0, first_correct_at=None) == []


def test_status_views() -> None:
    status = {
        "schema_version": 1,
        "total_engines": 3,
        "engines": [
            {"id": 0, "status": 0, "phase": "healthy", "removed_ranks": [2], "timeline": None},
            {"id": 1, "status": 2, "phase": "quarantined", "removed_ranks": [2]},
            {"id": 2, "status": 1, "phase": "dead"},
        ],
    }
    view = ClusterView.from_status(status)
    assert [e.id for e in view.live] == [0, 1]
    assert view.removed_ranks == frozenset({2}) and not view.healthy
    assert view.engine(1).status is HealthStatus.UNHEALTHY
    with pytest.raises(KeyError, match="no engine 7"):
        view.engine(7)
    assert ClusterView(1, (EngineView(0, HealthStatus.HEALTHY, "running"),)).healthy
    assert not ClusterView(0, ()).healthy


@pytest.mark.parametrize(
    ("engine", "needle"),
    [
        ({"status": 0}, "integer 'id'"),
        ({"id": 0, "status": 7}, "vLLM 'status'"),
        ({"id": 0, "status": 0, "timeline": {"episode": 1}}, "not a Timeline.to_dict()"),
        ({"id": 0, "status": 0, "timeline": 5}, "timeline must be null"),
    ],
)
def test_bad_status_shapes_are_named(engine: dict[str, object], needle: str) -> None:
    with pytest.raises(StatusShapeError, match=None) as info:
        ClusterView.from_status({"engines": [engine]})
    assert needle in str(info.value)


def test_tokens_per_second_bins_correct_answers_by_arrival() -> None:
    samples = [
        Sample(0.0, 0.1, 0, 4, True),
        Sample(0.1, 0.4, 1, 4, True),
        Sample(0.4, 0.6, 0, 0, False, "RequestAborted"),
        Sample(0.6, 0.9, 1, 4, True),
        Sample(0.9, 1.2, 0, 4, True),  # arrives after the window
    ]
    assert tokens_per_second(samples, start=0.0, end=1.0, bin_s=0.5) == [(0.0, 16.0), (0.5, 8.0)]
    with pytest.raises(ValueError, match="bin_s > 0"):
        tokens_per_second(samples, start=1.0, end=1.0)


def test_summary_statistics() -> None:
    stats = summary([0.5, 0.1, 0.2, 0.4, 0.3])
    assert stats == {"median": 0.3, "p90": pytest.approx(0.46), "max": 0.5, "n": 5}
    assert summary([]) == {"median": None, "p90": None, "max": None, "n": 0}
