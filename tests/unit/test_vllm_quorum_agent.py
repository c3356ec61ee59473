"""The engine-core agent enforcing the majority rule (``agent._check_quorum``, its guard
thread's step) with a stand-in vLLM sentinel and stand-in probes: a minority engine
faults and, once unhealthy, is DEAD naming the partition; a majority engine takes a silent
peer, or one whose port is closed, for dead and faults to scale it down."""

from __future__ import annotations

import attrs

from ftengine.integrations.vllm.engine_core.agent import EngineCoreAgent
from tests.unit.test_vllm_engine_agent import Sentinel, Status, agent_for, markers


@attrs.define
class Probes:
    """``quorum.Reachability`` as the agent reads it: who is known, reached, refused."""

    known: frozenset[int]
    reached: frozenset[int]
    closed: frozenset[int] = frozenset()

    def know(self, peers: object) -> None:
        pass

    def reaches(self) -> frozenset[int]:
        return self.reached

    def refused(self) -> frozenset[int]:
        return self.closed

    def forget(self, ranks: frozenset[int]) -> None:
        """Stop probing ``ranks`` (a rank admitted back runs a new process)."""
        self.known, self.reached, self.closed = (
            self.known - ranks,
            self.reached - ranks,
            self.closed - ranks,
        )

    def stop(self) -> None:
        pass


def agent_seeing(rank: int, probes: Probes) -> tuple[Sentinel, EngineCoreAgent]:
    sentinel = Sentinel(rank=rank, world=4)
    agent = agent_for(sentinel, "auto")
    agent.reach = probes  # type: ignore[assignment]
    return sentinel, agent


def test_a_minority_engine_faults_then_stops_naming_the_partition() -> None:
    sentinel, agent = agent_seeing(3, Probes(frozenset({0, 1, 2}), frozenset()))
    agent.guard_step()
    assert agent.fenced is not None and "network partition" in agent.fenced
    assert len(markers(sentinel)) == 1  # vLLM's own fault path runs first
    assert sentinel.status_type == Status.HEALTHY
    # reported unhealthy at once, saying it is stopping (an orchestrator must not retry it:
    # seen on hosts, a retry of all three waited 30 s for the cut-off one)
    fields = agent.status_fields()
    assert fields["status"] == "unhealthy" and "network partition" in str(fields["fault_info"])
    sentinel.status_type = Status.UNHEALTHY  # vLLM's on_fault ran
    assert "network partition" in str(agent.status_fields()["fault_info"])
    agent.guard_step()
    assert sentinel.status_type == Status.DEAD
    assert "network partition" in str(sentinel.fault_info)
    assert "[3] of [0, 1, 2, 3]" in str(sentinel.fault_info)
    assert agent._refusing is not None  # requests already queued end with the reason too
    agent.stop()


def test_an_engine_faulted_by_one_silent_peer_then_cut_off_pushes_that_it_is_stopping() -> None:
    """Seen on hosts (60-fault campaign, a cut host's rank): one peer fell silent a probe
    round before the other, so the engine faulted first believing it held a majority
    (``fault_info`` PeerDead), then found itself cut off. Its status is pushed again then,
    naming the partition, so an orchestrator does not retry it with the others."""
    probes = Probes(frozenset({0, 1, 2, 3}), frozenset({0, 1}))  # 2 silent: 3 of 4 reached
    sentinel, agent = agent_seeing(3, probes)
    agent.guard_step()
    assert agent.fenced is None and len(markers(sentinel)) == 1
    assert "network partition" not in str(agent.status_fields().get("fault_info"))
    pushed = sentinel.pushes
    probes.reached = frozenset()  # then the others: cut off
    agent.guard_step()
    assert agent.fenced is not None and sentinel.pushes == pushed + 1
    assert "network partition" in str(agent.status_fields()["fault_info"])
    agent.stop()


def test_a_majority_engine_takes_a_silent_peer_for_dead_and_faults() -> None:
    sentinel, agent = agent_seeing(0, Probes(frozenset({1, 2, 3}), frozenset({1, 2})))
    agent.guard_step()
    assert agent.fenced is None
    assert "network partition" not in str(agent.status_fields().get("fault_info"))
    assert agent.peers == {3: "dead"} and agent.gone == {3}
    assert len(markers(sentinel)) == 1
    sentinel.status_type = Status.UNHEALTHY
    agent.guard_step()
    assert sentinel.status_type == Status.UNHEALTHY  # it serves on: a scale-down comes


def test_a_lost_host_is_proven_dead_so_its_ranks_do_not_count() -> None:
    everyone = frozenset({1, 2, 3})
    # ranks 1 and 2 (one host) killed: their ports closed; rank 3 answers
    _, agent = agent_seeing(0, Probes(everyone, frozenset({3}), frozenset({1, 2})))
    agent.guard_step()
    assert agent.fenced is None and agent.gone == {1, 2}
    assert agent.peers == {1: "dead", 2: "dead"}
    # and rank 3 cut off too: live {0, 3} split evenly, rank 0 holds the lowest: serves
    _, alone = agent_seeing(0, Probes(everyone, frozenset(), frozenset({1, 2})))
    alone.guard_step()
    assert alone.fenced is None and alone.gone == {1, 2, 3}
    # the same silence with no proof: one of four live ranks: it stops
    _, unproven = agent_seeing(0, Probes(everyone, frozenset()))
    unproven.guard_step()
    assert unproven.fenced is not None
