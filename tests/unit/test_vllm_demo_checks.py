"""The vLLM demo's timeline and verdict without a deployment: the status watcher reports each
change once (and survives a server that does not answer), and each check fails on the
outcome it is there to catch."""

from __future__ import annotations

import io

import attrs
import httpx
import pytest

from ftengine.testbed.bench.live import PlainReporter
from ftengine.testbed.bench.traffic import Sample
from ftengine.testbed.vllm.demo_checks import Change, Outcome, StatusWatcher, checks, tally


def _good() -> Outcome:
    changes = (
        Change(0.0, 0, "-", "healthy"),
        Change(0.0, 1, "-", "healthy"),
        Change(10.5, 1, "healthy", "dead"),
        Change(11.0, 0, "healthy", "unhealthy"),
        Change(13.0, 0, "unhealthy", "healthy"),
    )
    traffic = {side: {"correct": 9, "wrong": 0, "failed": 0} for side in SIDES}
    return Outcome(1, (0,), 10.0, changes, {0: 202}, {0: " w5 w6"}, {0: " w5 w6"}, traffic)


SIDES = ("before_kill", "after_kill")


def test_the_scenario_that_held_passes_every_check() -> None:
    found = checks(_good())
    assert [c.ok for c in found] == [True] * 6
    assert found[0].detail == "rank 0: +1.00 s" and found[3].detail == "rank 0: +3.00 s"


@pytest.mark.parametrize(
    ("change", "failed"),
    [
        ({"changes": _good().changes[:3]}, [0, 3]),  # never unhealthy, hence never re-healthy
        ({"changes": tuple(c for c in _good().changes if c.dest != "dead")}, [1]),
        ({"changes": _good().changes[:4]}, [3]),  # stayed unhealthy
        ({"applied": {0: 400}}, [2]),  # vLLM answers 202 Accepted; a refusal is 4xx
        ({"applied": {}}, [2]),  # a survivor never got the command
        ({"after": {0: " w7"}}, [4]),
        ({"after": {}}, [4]),
        ({"traffic": {**_good().traffic, "before_kill": {"correct": 9, "failed": 1}}}, [5]),
        ({"traffic": {**_good().traffic, "after_kill": {"correct": 9, "wrong": 1}}}, [5]),
        ({"traffic": {"before_kill": {"correct": 9, "wrong": 0, "failed": 0}}}, [5]),  # no after
        ({"traffic": {}}, [5]),
    ],
)
def test_each_check_fails_on_what_it_guards(change: dict[str, object], failed: list[int]) -> None:
    found = checks(attrs.evolve(_good(), **change))  # type: ignore[arg-type]
    assert [i for i, c in enumerate(found) if not c.ok] == failed


def test_changes_before_the_kill_do_not_count() -> None:
    early = (Change(5.0, 0, "healthy", "unhealthy"), Change(6.0, 1, "healthy", "dead"))
    found = checks(attrs.evolve(_good(), changes=early))
    assert not found[0].ok and not found[1].ok


def test_the_watcher_reports_each_change_once_and_skips_a_silent_server() -> None:
    replies: list[dict[int, str] | Exception] = [
        {0: "healthy", 1: "healthy"},
        {0: "healthy", 1: "healthy"},
        httpx.ConnectError("refused"),
        {0: "unhealthy", 1: "dead"},
    ]

    def statuses() -> dict[int, str]:
        reply = replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply

    out = io.StringIO()
    watcher = StatusWatcher(statuses, PlainReporter(out, 0.0))
    for _ in range(4):
        watcher.poll()
    assert [(c.engine, c.source, c.dest) for c in watcher.changes] == [
        (0, "-", "healthy"), (1, "-", "healthy"), (0, "healthy", "unhealthy"),
        (1, "healthy", "dead"),
    ]  # fmt: skip
    assert out.getvalue().count("engine 1: healthy -> dead") == 1


def test_a_state_the_scenario_saw_between_two_polls_is_recorded() -> None:
    """CI: the survivor was unhealthy only while the watcher's poll waited on the dying
    rank's server; the scenario's own wait had seen it."""
    states = iter([{0: "healthy", 1: "healthy"}, {0: "healthy", 1: "dead"}])
    watcher = StatusWatcher(lambda: next(states), PlainReporter(io.StringIO(), 0.0))
    watcher.poll()
    watcher.saw({0: "unhealthy", 1: "dead"})  # what the scenario's wait read
    watcher.poll()  # the survivor is healthy again by now
    assert [(c.engine, c.dest) for c in watcher.changes] == [
        (0, "healthy"), (1, "healthy"), (0, "unhealthy"), (1, "dead"), (0, "healthy"),
    ]  # fmt: skip


def test_the_tally_splits_at_the_kill_and_tells_wrong_from_failed() -> None:
    samples = [
        Sample(1.0, 2.0, 0, 1, True),
        Sample(9.0, 11.0, 0, 1, False, "ReadTimeout"),  # started before, ended after the kill
        Sample(11.0, 12.0, 0, 1, False),
        Sample(12.0, 13.0, 0, 1, True),
    ]
    assert tally(samples, 10.0) == {
        "before_kill": {"correct": 1, "wrong": 0, "failed": 1},
        "after_kill": {"correct": 1, "wrong": 1, "failed": 0},
    }
