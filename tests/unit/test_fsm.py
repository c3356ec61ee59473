"""The FSM table, its machine and its two renderings."""

from __future__ import annotations

import pytest
from transitions import MachineError

from ftengine.cli import main
from ftengine.errors import TransitionError
from ftengine.faults import HealthStatus, Phase
from ftengine.fsm import (
    GUARDS,
    TABLE,
    RecoveryFSM,
    Row,
    Trigger,
    mermaid_rows,
    render_mermaid,
    render_table,
    successors,
    triggers_from,
)


def test_every_guard_in_the_table_is_a_known_callable() -> None:
    for row in TABLE:
        assert row.guard is None or callable(GUARDS[row.guard])


def test_health_follows_vllm_values() -> None:
    assert {p: p.health for p in Phase} == {
        Phase.RUNNING: HealthStatus.HEALTHY,
        Phase.HEALTHY: HealthStatus.HEALTHY,
        Phase.QUARANTINED: HealthStatus.UNHEALTHY,
        Phase.RETRYING: HealthStatus.UNHEALTHY,
        Phase.SCALING_DOWN: HealthStatus.UNHEALTHY,
        Phase.DEAD: HealthStatus.DEAD,
        Phase.SCALING_UP: HealthStatus.HEALTHY,  # the survivors serve around the admission
        Phase.LOADING: HealthStatus.UNHEALTHY,
        Phase.READY: HealthStatus.UNHEALTHY,
        Phase.JOINING: HealthStatus.UNHEALTHY,
    }
    assert (HealthStatus.HEALTHY, HealthStatus.DEAD, HealthStatus.UNHEALTHY) == (0, 1, 2)


def test_serving_and_recovering_phases() -> None:
    assert {p for p in Phase if p.serving} == {Phase.RUNNING, Phase.HEALTHY}
    assert {p for p in Phase if p.recovering} == {Phase.RETRYING, Phase.SCALING_DOWN}
    # Each recovery phase is entered by its own trigger from quarantined, and left by
    # ``recovered`` to healthy.
    for phase in Phase:
        if phase.recovering:
            assert Phase.HEALTHY in successors(phase) and Trigger.RECOVERED in triggers_from(phase)


def test_dead_has_no_way_out() -> None:
    assert successors(Phase.DEAD) == frozenset()
    assert triggers_from(Phase.DEAD) == frozenset()


def test_a_fault_while_serving_quarantines() -> None:
    fsm = RecoveryFSM()
    assert fsm.phase is Phase.RUNNING
    assert fsm.fire(Trigger.FAULT) is Phase.QUARANTINED


@pytest.mark.parametrize("source", [Phase.QUARANTINED, Phase.RETRYING, Phase.SCALING_DOWN])
@pytest.mark.parametrize(("continues", "dest"), [(True, Phase.QUARANTINED), (False, Phase.DEAD)])
def test_a_fault_while_unhealthy_follows_the_policy_verdict(
    source: Phase, continues: bool, dest: Phase
) -> None:
    assert RecoveryFSM(source).fire(Trigger.FAULT, continues=continues) is dest


def test_a_full_scale_down_path() -> None:
    fsm = RecoveryFSM()
    path = [fsm.fire(t) for t in (Trigger.FAULT, Trigger.SCALE_DOWN, Trigger.RECOVERED)]
    assert path == [Phase.QUARANTINED, Phase.SCALING_DOWN, Phase.HEALTHY]


@pytest.mark.parametrize("trigger", list(Trigger))
def test_every_trigger_from_dead_is_refused_and_keeps_the_cause(trigger: Trigger) -> None:
    fsm = RecoveryFSM(Phase.DEAD)
    with pytest.raises(TransitionError, match=f"{trigger.value!r} is not allowed") as caught:
        fsm.fire(trigger, continues=True)
    assert isinstance(caught.value.__cause__, MachineError)
    assert fsm.phase is Phase.DEAD


def test_commands_cannot_start_while_serving() -> None:
    fsm = RecoveryFSM()
    for trigger in (Trigger.RETRY, Trigger.SCALE_DOWN, Trigger.RECOVERED, Trigger.GIVE_UP):
        with pytest.raises(TransitionError, match="allowed: \\['fault'\\]"):
            fsm.fire(trigger)
    assert fsm.phase is Phase.RUNNING


def test_there_are_no_auto_transitions() -> None:
    fsm = RecoveryFSM()
    assert not any(name.startswith("to_") for name in dir(fsm._model))


def test_the_table_text_lists_every_row_and_the_health_map() -> None:
    text = render_table()
    for row in TABLE:
        assert f"{row.trigger.value} " in text and row.dest.value in text
    assert len(text.splitlines()) == len(TABLE) + 4
    assert "scaling_down=UNHEALTHY" in text and "dead=DEAD" in text


def test_the_mermaid_diagram_shows_six_phases_and_reads_back_as_the_table() -> None:
    text = render_mermaid()
    assert text.splitlines()[3] == "stateDiagram-v2"
    for phase in Phase:
        assert f'state "{phase.name}" as {phase.name}' in text
    assert "[*] --> RUNNING" in text
    assert mermaid_rows(text) == frozenset(TABLE)


def test_mermaid_rows_notices_a_missing_or_extra_edge() -> None:
    text = render_mermaid()
    without_give_up = text.replace(" | give_up", "")
    assert Row(Trigger.GIVE_UP, Phase.QUARANTINED, Phase.DEAD) not in mermaid_rows(without_give_up)
    with pytest.raises(ValueError, match="cannot read edge label"):
        mermaid_rows(text + "\n  RUNNING --> DEAD: ???")


def test_cli_prints_the_table_and_the_diagram(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fsm"]) == 0
    assert capsys.readouterr().out.strip() == render_table()
    assert main(["fsm", "--mermaid"]) == 0
    assert capsys.readouterr().out.strip() == render_mermaid()
