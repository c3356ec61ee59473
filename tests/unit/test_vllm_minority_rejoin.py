"""A partition's minority sits the partition out and rejoins when the link heals
(``engine_core/minority.py``): parked past vLLM's deadline (vLLM's own
``fault_tolerant_wrapper`` waiting on ftengine's ``resumed``, ``parking.py``) at its fault or
later, DEAD saying it rejoins by itself, its probes watched until it reaches a majority
again, then its worker relaunched in place. The relaunch itself (a live
worker shut down first): ``test_vllm_relaunch.py``; the real thing over network-namespace
hosts: ``tests/integration/test_vllm_hosts.py``."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.v1.engine import EngineStatusType
from vllm.v1.fault_tolerance.engine_core_sentinel import fault_tolerant_wrapper

from ftengine.integrations.vllm.engine_core import minority
from ftengine.integrations.vllm.engine_core.parking import ParkableEvent, install
from ftengine.integrations.vllm.engine_core.quorum import HEALS
from ftengine.integrations.vllm.engine_core.relaunch_state import LOADING, RELAUNCH_ATTR
from tests.unit.test_vllm_coordinator_host import DEADLINE_S, Engine, config
from tests.unit.test_vllm_engine_agent import Status, markers
from tests.unit.test_vllm_quorum_agent import Probes, agent_seeing

EVERYONE = frozenset({0, 1, 2})


class CutOffSentinel:
    """vLLM's ``EngineCoreSentinel`` as the wrapper reads it, whose ``on_fault`` runs the
    patched one's step for a cut-off engine (``agent``: what ``park_if_cut_off`` reads)."""

    def __init__(self, agent: Any) -> None:
        self.engine_index = 3
        self.parallel_config = config(4, 3, True)
        self.engine_recovery_timeout_sec: float | None = DEADLINE_S
        self.resumed = threading.Event()
        install(self)
        self.status_type = EngineStatusType.HEALTHY
        self.agent = agent

    def on_fault(self, exc: Exception) -> None:
        self.resumed.clear()
        self.status_type = EngineStatusType.UNHEALTHY
        minority.park_if_cut_off(self, self.agent)


def wrapped(sentinel: CutOffSentinel, resume_after_s: float) -> tuple[Engine, BaseException]:
    engine = Engine(sentinel)  # type: ignore[arg-type]
    threading.Timer(resume_after_s, sentinel.resumed.set).start()
    with pytest.raises((RuntimeError, SystemExit)) as raised:
        fault_tolerant_wrapper(Engine.busy_loop)(engine)
    return engine, raised.value


def test_a_cut_off_engine_waits_past_vllms_deadline_and_any_other_does_not() -> None:
    cut = SimpleNamespace(fenced="network partition: ...", cut_off=None, rank=3)
    engine, raised = wrapped(CutOffSentinel(cut), resume_after_s=3 * DEADLINE_S)
    assert isinstance(raised, SystemExit), raised  # resumed after 3x the deadline: went on
    assert engine.loops == 2 and cut.cut_off == minority.PARKED
    reachable = SimpleNamespace(fenced=None, cut_off=None, rank=3)
    engine, raised = wrapped(CutOffSentinel(reachable), resume_after_s=3 * DEADLINE_S)
    assert isinstance(raised, RuntimeError), raised  # vLLM's deadline: the engine core ends
    assert engine.loops == 1 and reachable.cut_off is None


def test_an_engine_parked_while_vllms_wrapper_already_waits_waits_on() -> None:
    """Cut off found only after the fault: vLLM's wrapper read the deadline already."""
    late = SimpleNamespace(fenced=None, cut_off=None, rank=3)
    sentinel = CutOffSentinel(late)

    def cut_off_now() -> None:
        late.fenced = "network partition: ..."
        assert minority.park_if_cut_off(sentinel, late)

    threading.Timer(DEADLINE_S / 2, cut_off_now).start()
    engine, raised = wrapped(sentinel, resume_after_s=3 * DEADLINE_S)
    assert isinstance(raised, SystemExit), raised
    assert engine.loops == 2 and late.cut_off == minority.PARKED


def cut_off_and_parked(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any, Probes, list[str]]:
    """Rank 3 of 4 reaching nobody, faulted by its guard and parked by the patched
    ``on_fault``; relaunches recorded, not run."""
    started: list[str] = []
    monkeypatch.setattr(minority, "start_thread", lambda s, cause: started.append(cause))
    probes = Probes(EVERYONE, frozenset())
    stand_in, agent = agent_seeing(3, probes)
    sentinel: Any = stand_in  # vLLM's sentinel also has resumed, ftengine's once patched
    sentinel.resumed = ParkableEvent()
    sentinel.engine.ft_sentinel = sentinel  # where the status reads the relaunch
    agent.guard_step()
    assert agent.fenced is not None and len(markers(sentinel)) == 1
    sentinel.status_type = Status.UNHEALTHY  # vLLM's on_fault, then ftengine's park
    assert minority.park_if_cut_off(sentinel, agent)
    assert sentinel.resumed.parked
    assert not minority.park_if_cut_off(sentinel, agent)  # once
    return sentinel, agent, probes, started


def test_a_parked_minority_stops_then_rejoins_once_it_reaches_a_majority_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sentinel, agent, probes, started = cut_off_and_parked(monkeypatch)
    agent.guard_step()
    assert sentinel.status_type == Status.DEAD
    assert "network partition" in str(sentinel.fault_info)
    assert HEALS in str(sentinel.fault_info)  # an operator need not restart it
    assert agent.cut_off == minority.WAITING
    refusing = agent._refusing
    assert refusing is not None and not refusing.is_set()  # until it rejoins, no deadline
    for reached in (frozenset(), frozenset({1})):  # {1, 3}: half, without the lowest rank
        probes.reached = reached
        agent.guard_step()
        assert started == [] and markers(sentinel) == [] and agent.cut_off == minority.WAITING
    probes.reached = frozenset({1, 2})  # the link is back: 3 of 4 live ranks
    agent.guard_step()
    assert started == ["engine 3 was cut off by a network partition"]
    assert agent.cut_off == minority.REJOINING
    fields = agent.status_fields()
    assert (fields["status"], fields["phase"]) == ("dead", LOADING)
    assert "link healed" in str(fields["fault_info"])
    assert getattr(sentinel, RELAUNCH_ATTR).phase == LOADING
    agent.guard_step()
    assert len(started) == 1 and markers(sentinel) == []  # once; no fault of its own
    agent.start_over()  # the relaunch's returning rank: the partition is over
    assert agent.fenced is None and agent.cut_off is None and refusing.is_set()
    agent.stop()


def test_a_link_back_before_the_parked_engine_gave_up_still_ends_in_a_rejoin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The majority removed it at the same silence: it must not serve on as a member."""
    sentinel, agent, probes, started = cut_off_and_parked(monkeypatch)
    probes.reached = EVERYONE
    agent.guard_step()
    assert sentinel.status_type == Status.DEAD and agent.cut_off == minority.WAITING
    assert markers(sentinel) == [] and agent.gone == frozenset()
    agent.guard_step()
    assert started == ["engine 3 was cut off by a network partition"]
    agent.stop()


def late_cut_off(
    monkeypatch: pytest.MonkeyPatch, resumed: threading.Event
) -> tuple[Any, Any, Probes, list[str]]:
    """Rank 3 faulted first by one silent peer (it still held a majority: not parked at
    its fault), then cut off."""
    started: list[str] = []
    monkeypatch.setattr(minority, "start_thread", lambda s, cause: started.append(cause))
    probes = Probes(EVERYONE, frozenset({0, 1}))
    stand_in, agent = agent_seeing(3, probes)
    sentinel: Any = stand_in
    sentinel.resumed = resumed
    agent.guard_step()
    sentinel.status_type = Status.UNHEALTHY
    assert agent.fenced is None and not minority.park_if_cut_off(sentinel, agent)
    probes.reached = frozenset()
    agent.guard_step()
    assert sentinel.status_type == Status.DEAD
    return sentinel, agent, probes, started


def test_an_engine_cut_off_only_after_its_fault_is_parked_as_it_gives_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seen on hosts (seed 24, one partition in seven): vLLM's wrapper already waits with
    the deadline; the agent parks it as it gives up, so it rejoins as well."""
    sentinel, agent, probes, started = late_cut_off(monkeypatch, ParkableEvent())
    assert sentinel.resumed.parked and agent.cut_off == minority.WAITING
    assert HEALS in str(sentinel.fault_info)
    probes.reached = EVERYONE
    agent.guard_step()
    assert started == ["engine 3 was cut off by a network partition"]
    agent.stop()


def test_with_vllms_own_event_a_cut_off_engine_keeps_the_deadline_and_says_nothing_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Parking unavailable (vLLM's plain ``resumed``): it stops as before, exits at vLLM's
    deadline, and its status does not promise a rejoin (an operator restarts it)."""
    sentinel, agent, probes, started = late_cut_off(monkeypatch, threading.Event())
    assert agent.cut_off is None and HEALS not in str(sentinel.fault_info)
    probes.reached = EVERYONE
    agent.guard_step()
    assert started == []
    agent.stop()
