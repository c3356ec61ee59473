"""Fault-injection specs: parsing FTENGINE_INJECT_FAULT and firing exactly once."""

from __future__ import annotations

import pytest

from ftengine.errors import ConfigError
from ftengine.testbed.cluster.faults_inject import ENV_VAR, FaultInjector, FaultSpec, InjectKind


def test_parse_full_spec_and_round_trip() -> None:
    spec = FaultSpec.parse("rank=3, step=50, kind=raise")
    assert spec == FaultSpec(rank=3, kind=InjectKind.RAISE, step=50)
    assert FaultSpec.parse(str(spec)) == spec


def test_step_defaults_to_zero() -> None:
    assert FaultSpec.parse("rank=1,kind=reload_error").step == 0


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("rank=3", "expected keys"),
        ("rank=3,kind=explode", "kind must be one of"),
        ("rank=x,kind=kill", "integers"),
        ("rank=-1,kind=kill", "rank"),
        ("rank=1,kind=kill,colour=red", "expected keys"),
        ("rank 1", "key=value"),
    ],
)
def test_bad_specs_say_what_was_expected(text: str, needle: str) -> None:
    with pytest.raises((ConfigError, ValueError), match=needle):
        FaultSpec.parse(text)


def test_from_env() -> None:
    assert FaultSpec.from_env({}) is None
    assert FaultSpec.from_env({ENV_VAR: "  "}) is None
    assert FaultSpec.from_env({ENV_VAR: "rank=2,step=5,kind=hang"}) == FaultSpec(
        2, InjectKind.HANG, 5
    )


def test_step_fault_fires_once_at_or_after_its_step_on_its_rank_only() -> None:
    spec = FaultSpec(rank=1, kind=InjectKind.KILL, step=3)
    other = FaultInjector(spec, rank=0)
    mine = FaultInjector(spec, rank=1)
    assert [other.due(s) for s in range(6)] == [None] * 6
    assert [mine.due(s) for s in range(6)] == [None, None, None, InjectKind.KILL, None, None]
    assert mine.fired and not other.fired


def test_reload_error_fires_on_the_first_reload_only() -> None:
    injector = FaultInjector(FaultSpec(rank=0, kind=InjectKind.RELOAD_ERROR), rank=0)
    assert injector.due(0) is None
    assert [injector.reload_due(), injector.reload_due()] == [True, False]


def test_no_spec_never_fires() -> None:
    injector = FaultInjector(None, rank=0)
    assert injector.due(100) is None and not injector.reload_due()
