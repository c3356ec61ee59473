"""The demo's scenario over the stand-in cluster: the checks it makes, the verdict, and the
``--json`` object; a cluster that does not recover must fail the verdict."""

from __future__ import annotations

import io
import signal
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import pytest

from ftengine.testbed.bench.live import NullReporter, PlainReporter, Watcher
from ftengine.testbed.bench.prompts import fixed_prompts
from ftengine.testbed.bench.scenario import SCENARIO, ScenarioSettings, run_scenario
from tests.unit.control_standin import Generated, Outcome, StandInCluster, continuation

PROMPTS = [[1, 2, 3], [4, 5], [6]]
SETTINGS = ScenarioSettings(
    warmup_s=0.0, detect_timeout_s=1.0, recover_timeout_s=1.0, first_token_timeout_s=5.0
)


@attrs.frozen
class Compared:
    match: bool

    def to_dict(self) -> dict[str, object]:
        return {"match": self.match}


def compare(got: Sequence[Generated], want: Sequence[Generated]) -> Compared:
    return Compared([g.token_ids for g in got] == [w.token_ids for w in want])


def reference(max_tokens: int = SETTINGS.max_tokens) -> list[Generated]:
    return [Generated(tuple(continuation(p, max_tokens))) for p in PROMPTS]


class NoScaleDown(StandInCluster):
    """Refuses scale_down, so the survivors never recover."""

    def apply(self, instruction: str, params: Mapping[str, object], request_id: str) -> Outcome:
        if instruction == "scale_down":
            self.calls.append((instruction, dict(params), request_id))
            return Outcome(request_id, False, "refused for the test")
        return super().apply(instruction, params, request_id)


def _run(cluster: StandInCluster, **changes: Any) -> Any:
    settings = attrs.evolve(SETTINGS, **changes)
    return run_scenario(
        cluster,
        PROMPTS,
        reference(),
        settings=settings,
        reporter=NullReporter(),
        compare=compare,
        t0=0.0,
    )


def test_the_scenario_passes_on_a_cluster_that_recovers() -> None:
    cluster = StandInCluster()
    result = _run(cluster)
    assert [(c.name, c.ok) for c in result.checks] == [
        ("outputs match before the fault", True),
        ("survivors UNHEALTHY, victim DEAD", True),
        ("retry rejected by the dead engine", True),
        ("scale_down succeeded", True),
        ("survivors healthy", True),
        ("correct answers resume", True),
        ("outputs match after recovery", True),
    ]
    assert result.ok and result.recovered and result.outputs_match
    assert cluster.killed == [(3, signal.SIGKILL)]
    assert [call[0] for call in cluster.calls] == ["retry", "scale_down"]
    assert cluster.calls[1][1] == {"removed_dp_ranks": [3]}
    report = result.to_dict()
    assert report["scenario"] == SCENARIO and report["removed_ranks"] == [3]
    assert report["recovered"] is True and report["outputs_match"] is True
    phases = report["phases"]
    assert [c["dest"] for c in phases["0"]] == ["quarantined", "scaling_down", "healthy"]
    assert [c["dest"] for c in phases["3"]] == ["dead"]
    names = [row["name"] for row in report["breakdown"]]
    assert names[:2] == ["detect", "quarantine"]
    for step in ("mask dead ranks", "comm rebuild", "expert repair", "validate"):
        assert step in names
    assert "first correct token" in names


def test_the_scenario_fails_when_survivors_do_not_recover() -> None:
    cluster = NoScaleDown()
    result = _run(cluster)
    failed = [c.name for c in result.checks if not c.ok]
    assert failed == [
        "scale_down succeeded",
        "survivors healthy",
        "correct answers resume",
        "outputs match after recovery",
    ]
    after = result.checks[-1].detail
    assert after.startswith("generation failed: BackendError")
    assert not result.ok and not result.recovered
    assert result.to_dict()["removed_ranks"] == []


def test_auto_policy_sends_no_commands() -> None:
    cluster = StandInCluster()

    def heal() -> None:  # the engines' own policy, acting on the kill
        cluster.apply("scale_down", {"removed_dp_ranks": [2]}, "auto")

    original_kill = cluster.kill

    def kill_and_heal(rank: int, sig: int = 9) -> None:
        original_kill(rank, sig)
        heal()

    cluster.kill = kill_and_heal  # type: ignore[method-assign]
    result = _run(cluster, policy="auto", victim=2)
    assert result.ok, result.checks
    assert [call[2] for call in cluster.calls] == ["auto"]


def test_plain_reporter_prints_phase_changes_in_time_order() -> None:
    cluster = StandInCluster()
    out = io.StringIO()
    watcher = Watcher(cluster, PlainReporter(out, t0=100.0))
    cluster.kill(3)
    watcher.poll()
    watcher.poll()
    lines = out.getvalue().splitlines()
    assert lines[0] == "[   +0.000s] supervisor: rank 3 exit: killed by signal 9"
    assert lines[1] == "[   +2.000s] engine 0: running -> quarantined  (dead_peer fault on rank 3)"
    assert len(lines) == 4


@pytest.mark.parametrize(("count", "vocab"), [(4, 256), (7, 16)])
def test_fixed_prompts_are_reproducible_and_in_range(count: int, vocab: int) -> None:
    prompts = fixed_prompts(count, vocab)
    assert prompts == fixed_prompts(count, vocab)
    assert len(prompts) == count
    assert all(3 <= len(p) <= 8 and all(0 <= t < vocab for t in p) for p in prompts)
