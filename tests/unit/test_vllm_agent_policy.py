"""The configured policy, whole, in the engine-core agent (stand-in engine cores, one DP
store): it sees the fault history with the rank each fault points at, the dead peers, the
removed ranks and the worker's redundancy facts; ``ScaleDown`` runs the engine core's own
``scale_down`` once every survivor proposes the same set, and waits for the orchestrator
while they disagree; ``GiveUp`` makes the engine DEAD."""

from __future__ import annotations

import json
import time

import pytest

from ftengine.context import RecoveryContext, RedundancyFacts
from ftengine.faults import FaultKind
from ftengine.integrations.vllm.engine_core.agent import UTILS_MODULE, EngineCoreAgent
from ftengine.integrations.vllm.engine_core.dp_board import KEY
from ftengine.integrations.vllm.status_file import file_fields
from ftengine.policies import AutoRecovery, FlapGuard, OrchestratorDriven, ScaleDown
from tests.unit.test_vllm_engine_agent import (
    Sentinel,
    Status,
    agent_for,
    on_fault,
    tick,
    wait_until,
)

pytest.importorskip(UTILS_MODULE, reason="vllm is not installed")

TIMEOUT = RuntimeError("Timed out waiting 5000ms for recv operation to complete")


def published(sentinel: Sentinel, rank: int) -> dict[str, object]:
    value: dict[str, object] = json.loads(sentinel.engine.dp_store.data[KEY.format(rank=rank)])
    return value


def survivor(
    world: int = 3, rank: int = 0, policy: str = "auto"
) -> tuple[Sentinel, EngineCoreAgent]:
    """Engine ``rank``, just faulted by a peer's collective error (vLLM's on_fault ran)."""
    sentinel = Sentinel(rank=rank, world=world)
    agent = agent_for(sentinel, policy)
    on_fault(agent, TIMEOUT)
    sentinel.status_type = Status.UNHEALTHY
    return sentinel, agent


def test_auto_scales_a_dead_peer_down_once_every_survivor_proposes_it() -> None:
    sentinel, agent = survivor()
    store = sentinel.engine.dp_store
    store.peer(1, "unhealthy")
    store.peer(2, "dead")
    tick(agent)
    ctx = agent.context(1e9)
    assert ctx is not None and ctx.dead_ranks == {2} and ctx.fault.kind is FaultKind.DEAD_PEER
    assert published(sentinel, 0)["proposal"] == ["scale_down", [2], 0]
    assert sentinel.scale_downs == []  # rank 1 has not proposed it yet
    store.peer(1, "unhealthy", beat=2, proposal=["scale_down", [2], 0])
    tick(agent)
    wait_until(lambda: bool(sentinel.scale_downs))
    (request,) = sentinel.scale_downs
    assert request.instruction == "scale_down" and request.params == {"removed_dp_ranks": [2]}
    assert sentinel.status_type is Status.HEALTHY and sentinel.retries == []


@pytest.mark.parametrize(
    "theirs",
    [["retry", [], 0], ["scale_down", [1, 2], 0], ["scale_down", [2], 1], None],
    ids=["retry", "more", "another-round", "none"],
)
def test_survivors_that_disagree_wait_for_the_orchestrator(theirs: list[object] | None) -> None:
    sentinel, agent = survivor()
    store = sentinel.engine.dp_store
    store.peer(2, "dead")
    for beat in range(1, 6):
        store.peer(1, "unhealthy", beat=beat, proposal=theirs)
        tick(agent)
    assert sentinel.scale_downs == [] and sentinel.retries == []
    assert sentinel.status_type is Status.UNHEALTHY  # waiting, not given up


def test_a_peer_still_healthy_or_of_another_epoch_is_no_party_to_it() -> None:
    sentinel, agent = survivor()
    store = sentinel.engine.dp_store
    store.peer(2, "dead")
    store.peer(1, "unhealthy", epoch=1, proposal=["scale_down", [2], 1])  # another round
    tick(agent)
    store.peer(1, "healthy", beat=2, proposal=["scale_down", [2], 0])
    tick(agent)
    assert sentinel.scale_downs == []


def test_redundancy_the_worker_wrote_stops_a_scale_down_the_experts_cannot_survive() -> None:
    sentinel, agent = survivor()
    tight = RedundancyFacts(ep_size=3, local_slots=2, num_logical=6)  # no slot to spare
    agent.status_file.write(file_fields({"phase": "quarantined"}, tight))
    store = sentinel.engine.dp_store
    store.peer(2, "dead")
    store.peer(1, "unhealthy", proposal=["scale_down", [2], 0])
    tick(agent)
    ctx = agent.context(1e9)
    assert ctx is not None and ctx.redundancy == tight
    assert published(sentinel, 0)["proposal"] is None
    assert sentinel.scale_downs == []  # AutoRecovery abstains; the orchestrator decides


def test_a_peers_fault_is_counted_against_the_rank_it_began_on() -> None:
    """The survivors name the rank whose own fault began it (published as its ``blame``), so
    a ``FlapGuard`` on each of them counts the same faults."""
    sentinel, agent = survivor(rank=0)
    agent.policy = FlapGuard(k=3, window=600.0) | AutoRecovery()
    store = sentinel.engine.dp_store
    for episode in range(3):
        if episode:  # healthy again, then the same rank's fault again
            sentinel.status_type = Status.HEALTHY
            agent._maybe_recover()
            on_fault(agent, TIMEOUT)
            sentinel.status_type = Status.UNHEALTHY
        store.peer(1, "unhealthy", beat=10 * episode + 1, blame=1)
        store.peer(2, "unhealthy", beat=10 * episode + 1, blame=1)
        tick(agent)
    ctx = agent.context(1e9)
    assert ctx is not None and [f.rank for f in ctx.faults] == [1, 1, 1]
    assert published(sentinel, 0)["proposal"] == ["scale_down", [1], 0]
    assert published(sentinel, 0)["blame"] == 1


def test_a_fault_of_this_engines_own_making_points_at_itself() -> None:
    sentinel = Sentinel(rank=1, world=3)
    agent = agent_for(sentinel, "auto")
    sentinel.engine.dp_store.peer(0, "healthy")
    sentinel.engine.dp_store.peer(2, "healthy")
    agent._watch_peers()
    on_fault(agent, RuntimeError("[FT] fault injected on DP rank 1"))
    assert agent.fault is not None and agent.fault.rank == 1
    sentinel.status_type = Status.UNHEALTHY
    tick(agent)
    assert published(sentinel, 1)["blame"] == 1


def test_flap_guard_on_the_flapping_rank_gives_up_and_the_engine_is_dead() -> None:
    sentinel = Sentinel(rank=1, world=3)
    agent = agent_for(sentinel)
    agent.policy = FlapGuard(k=2, window=600.0) | OrchestratorDriven(60.0)
    for _ in range(2):
        sentinel.status_type = Status.HEALTHY
        agent._maybe_recover()
        on_fault(agent, RuntimeError("[FT] fault injected on DP rank 1"))
        sentinel.status_type = Status.UNHEALTHY
        tick(agent)
    assert sentinel.status_type is Status.DEAD and sentinel.pushes >= 1
    assert "rank 1 faulted 2 times within 600s: this worker flaps" in str(sentinel.fault_info)
    assert published(sentinel, 1)["status"] == "dead"


def test_a_wait_past_the_policys_own_deadline_gives_up_before_vllms() -> None:
    sentinel, agent = survivor(world=2)
    agent.policy = OrchestratorDriven(recovery_timeout=1.0)  # vLLM's: the settings' 120 s
    sentinel.engine.dp_store.peer(1, "unhealthy")
    tick(agent)
    assert sentinel.status_type is Status.UNHEALTHY
    fault = agent.fault
    assert fault is not None
    agent.books.episode.start -= 5.0  # type: ignore[union-attr]
    tick(agent)
    assert sentinel.status_type is Status.DEAD
    assert "no recovery command within" in str(sentinel.fault_info)


def test_the_orchestrator_policys_wait_is_left_to_vllms_own_deadline() -> None:
    sentinel, agent = survivor(world=2, policy="orchestrator")
    sentinel.engine.dp_store.peer(1, "unhealthy")
    agent.books.episode.start -= 119.5  # type: ignore[union-attr]
    tick(agent)
    assert sentinel.status_type is Status.UNHEALTHY  # vLLM's wrapper ends it, not the agent


def test_a_policy_scale_down_that_names_this_engine_gives_up() -> None:
    sentinel, agent = survivor()

    def remove_myself(ctx: RecoveryContext) -> ScaleDown:
        return ScaleDown({ctx.rank})

    agent.policy = remove_myself
    tick(agent)
    assert sentinel.status_type is Status.DEAD
    assert "contains this engine's own rank 0" in str(sentinel.fault_info)


def test_after_a_scale_down_the_removed_rank_is_no_peer() -> None:
    sentinel, agent = survivor()
    store = sentinel.engine.dp_store
    store.peer(2, "dead")
    store.peer(1, "unhealthy", proposal=["scale_down", [2], 0])
    tick(agent)
    tick(agent)
    wait_until(lambda: bool(sentinel.scale_downs))
    store.peer(1, "healthy", beat=5, epoch=1)
    agent._watch_peers()
    assert agent.peers == {1: "healthy"}
    agent.policy = AutoRecovery() | OrchestratorDriven()
    on_fault(agent, TIMEOUT)  # a later fault: a retry among the two survivors
    sentinel.status_type = Status.UNHEALTHY
    store.peer(1, "unhealthy", beat=6, epoch=1, proposal=["retry", [2], 1])
    tick(agent)
    wait_until(lambda: bool(sentinel.retries))


def test_a_member_that_has_begun_the_recovery_still_counts() -> None:
    """vLLM's retry counts the new epoch before its rendezvous: a member already in it shows
    epoch 1 while this engine, faulted later, is still at 0; same round, same proposal."""
    sentinel, agent = survivor(world=2)
    sentinel.engine.dp_store.peer(1, "unhealthy", epoch=1, proposal=["retry", [], 0])
    tick(agent)
    wait_until(lambda: bool(sentinel.retries))


def proposes_a_retry_of_a_peers_fault(
    sentinel: Sentinel, agent: EngineCoreAgent, blamed: int
) -> None:
    """The episode holds a transient fault of rank ``blamed``, no dead rank, and the agent
    publishes a retry."""
    ctx = agent.context(1e9)
    assert ctx is not None and ctx.dead_ranks == frozenset(), ctx
    assert ctx.fault.kind is FaultKind.TRANSIENT and ctx.fault.rank == blamed
    proposal = published(sentinel, agent.rank)["proposal"]
    assert isinstance(proposal, list) and proposal[0] == "retry", proposal


def test_a_peers_closed_socket_is_no_proof_that_it_died() -> None:
    """DP=2: rank 1's step raised and it closed its DP group; rank 0's step fails with
    "Connection closed by peer" (a dead-peer text) while rank 1 publishes ``unhealthy``:
    the episode holds a transient fault of rank 1, no dead rank, and the policy proposes a
    retry (it scaled rank 1 down alone before: its own proposal was the only survivor's)."""
    sentinel = Sentinel(rank=0, world=2)
    agent = agent_for(sentinel, "auto")
    sentinel.engine.dp_store.peer(1, "unhealthy", blame=1)
    agent._watch_peers()
    on_fault(agent, RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:18656"))
    sentinel.status_type = Status.UNHEALTHY
    tick(agent)
    proposes_a_retry_of_a_peers_fault(sentinel, agent, blamed=1)
    assert sentinel.scale_downs == []


def test_the_peer_that_began_it_is_blamed_not_the_first_seen_unhealthy() -> None:
    """DP=3: rank 1's step raised; rank 0 faulted at once on the closed socket and was seen
    ``unhealthy`` first by rank 2, whose own step then failed the same way. Rank 1 says the
    fault is its own (its ``blame``): rank 2 counts it against rank 1 and proposes a retry,
    not a scale-down of rank 0."""
    sentinel = Sentinel(rank=2, world=3)
    agent = agent_for(sentinel, "auto")
    store = sentinel.engine.dp_store
    store.peer(0, "unhealthy", blame=None)
    store.peer(1, "healthy")
    agent._watch_peers()
    on_fault(agent, RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:7044"))
    sentinel.status_type = Status.UNHEALTHY
    store.peer(1, "unhealthy", beat=2, blame=1)
    tick(agent)
    proposes_a_retry_of_a_peers_fault(sentinel, agent, blamed=1)


def test_an_own_error_stays_own_when_a_victim_was_seen_unhealthy_first() -> None:
    """Rank 1's step raised its own error; rank 0, a victim of the closed group, published
    ``unhealthy`` before the error reached rank 1's engine core: still rank 1's fault, so a
    ``FlapGuard`` on rank 1 counts it against itself."""
    sentinel = Sentinel(rank=1, world=3)
    agent = agent_for(sentinel, "auto")
    sentinel.engine.dp_store.peer(0, "unhealthy")
    sentinel.engine.dp_store.peer(2, "healthy")
    agent._watch_peers()  # the marker: rank 0 seen faulted first
    on_fault(agent, RuntimeError("[FT] fault injected on DP rank 1"))
    assert agent.fault is not None and agent.fault.rank == 1


def lone_survivor(rank: int) -> tuple[Sentinel, EngineCoreAgent]:
    """DP=2, engine ``rank`` faulted on a timeout while its peer's beat went stale (a peer
    starved of CPU, or this engine cut off): the policy takes the peer for dead and proposes
    removing it, a proposal no other member has to agree to."""
    sentinel = Sentinel(rank=rank, world=2)
    agent = agent_for(sentinel, "auto")
    peer = 1 - rank
    sentinel.engine.dp_store.peer(peer, "healthy")
    agent._watch_peers()
    agent._seen[peer] = (1, time.monotonic() - 60)  # its beat has not moved for a minute
    on_fault(agent, TIMEOUT)
    sentinel.status_type = Status.UNHEALTHY
    return sentinel, agent


def test_a_lone_survivor_without_the_lowest_rank_never_scales_its_live_peer_down() -> None:
    """Both members of DP=2 each agreed with itself to remove the other before (issue 28's
    finding): now only the side the majority rule keeps (half of the live ranks, holding
    the lowest) may, so never both."""
    sentinel, agent = lone_survivor(rank=1)
    for _ in range(3):
        tick(agent)
    assert published(sentinel, 1)["proposal"] == ["scale_down", [0], 0]
    assert sentinel.scale_downs == [] and sentinel.status_type is Status.UNHEALTHY
    assert agent.outvoted is not None and agent.outvoted.removed == {0}

    sentinel, agent = lone_survivor(rank=0)
    tick(agent)
    wait_until(lambda: bool(sentinel.scale_downs))
    assert sentinel.scale_downs[0].params == {"removed_dp_ranks": [1]}


def test_a_peer_that_published_dead_may_be_removed_by_any_survivor() -> None:
    """Rank 0's worker died (its engine core publishes ``dead``): rank 1, alone, scales it
    down; the rule counts only the live ranks."""
    sentinel = Sentinel(rank=1, world=2)
    agent = agent_for(sentinel, "auto")
    sentinel.engine.dp_store.peer(0, "dead")
    on_fault(agent, TIMEOUT)
    sentinel.status_type = Status.UNHEALTHY
    tick(agent)
    wait_until(lambda: bool(sentinel.scale_downs))
    assert sentinel.scale_downs[0].params == {"removed_dp_ranks": [0]}
