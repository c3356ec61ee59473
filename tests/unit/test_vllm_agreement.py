"""The pieces behind the engine-core agent's decisions: the survivors' agreement on a
proposal, the agent's fault books (the same ``Episode`` and context as a worker's engine)
and the redundancy facts a worker writes to its status file."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftengine.context import RedundancyFacts
from ftengine.errors import ConfigError
from ftengine.faults import Fault, FaultKind, Phase
from ftengine.integrations.vllm.engine_core.agreement import (
    PeerView,
    Proposal,
    agreed,
    holds_majority,
)
from ftengine.integrations.vllm.engine_core.fault_books import FaultBooks
from ftengine.integrations.vllm.status_file import StatusFile, file_fields, redundancy_facts
from ftengine.policies import Retry, ScaleDown

SCALE_2 = Proposal("scale_down", frozenset({2}), epoch=1)


def test_a_proposal_is_what_the_decision_runs_with_the_ranks_removed_so_far() -> None:
    assert Proposal.of(Retry(1.0), frozenset({3}), 2) == Proposal("retry", frozenset({3}), 2)
    assert Proposal.of(ScaleDown({2}), frozenset({3}), 0) == Proposal("scale_down", {2, 3})
    assert SCALE_2.members(4) == {0, 1, 3}
    assert Proposal.from_json(SCALE_2.to_json()) == SCALE_2


@pytest.mark.parametrize(
    "raw",
    [None, "retry", ["retry"], ["reboot", [], 0], ["scale_down", "2", 0], ["scale_down", [-1], 0],
     ["scale_down", [True], 0], ["retry", [1.5], 0], ["retry", []], ["retry", [], -1],
     ["retry", [], "1"]],
)  # fmt: skip
def test_a_proposal_this_version_cannot_read_is_none(raw: object) -> None:
    assert Proposal.from_json(raw) is None


def test_every_other_member_must_be_unhealthy_and_propose_the_same_in_the_same_round() -> None:
    same = PeerView("unhealthy", SCALE_2)
    assert agreed(SCALE_2, 0, 3, {1: same})
    assert agreed(SCALE_2, 0, 3, {1: same, 2: PeerView("dead")})  # 2 is no member
    assert not agreed(SCALE_2, 0, 3, {})
    assert not agreed(SCALE_2, 0, 3, {1: PeerView("healthy", SCALE_2)})
    earlier = Proposal("scale_down", frozenset({2}), epoch=0)
    assert not agreed(SCALE_2, 0, 3, {1: PeerView("unhealthy", earlier)})
    assert not agreed(SCALE_2, 0, 3, {1: PeerView("unhealthy", Proposal("retry", epoch=1))})
    retry = Proposal("retry")
    assert not agreed(retry, 0, 3, {1: PeerView("unhealthy", retry)})  # 2 must too


def test_the_books_count_one_death_once_and_name_a_fault_in_its_place() -> None:
    books = FaultBooks(rank=0, world_size=3)
    books.open(Fault(FaultKind.TRANSIENT, rank=1, at=1.0))
    books.open(Fault(FaultKind.HUNG_PEER, at=5.0))  # a later episode, its rank unknown yet
    books.settle(Fault(FaultKind.DEAD_PEER, rank=2, at=5.0))
    books.dead(2, 5.5)  # the same death the settled fault names: no second entry
    books.dead(2, 6.0)
    books.start_attempt()
    ctx = books.context(7.0, frozenset(), epoch=2, redundancy=None)
    assert ctx is not None
    assert [(f.kind, f.rank) for f in ctx.faults] == [
        (FaultKind.TRANSIENT, 1),
        (FaultKind.DEAD_PEER, 2),
    ]
    assert (ctx.dead_ranks, ctx.attempts, ctx.elapsed, ctx.epoch) == (frozenset({2}), 1, 2.0, 2)
    assert ctx.phase is Phase.QUARANTINED and ctx.fault.rank == 2
    removed = books.context(7.0, frozenset({2}), epoch=2, redundancy=None)
    assert removed is not None and removed.dead_ranks == frozenset()


def test_a_second_dead_peer_is_its_own_entry() -> None:
    books = FaultBooks(rank=0, world_size=4)
    books.open(Fault(FaultKind.DEAD_PEER, rank=2, at=1.0))
    books.dead(2, 1.0)
    books.dead(3, 1.5)
    ctx = books.context(2.0, frozenset(), epoch=0, redundancy=None)
    assert ctx is not None and ctx.dead_ranks == {2, 3}
    assert [f.rank for f in ctx.faults] == [2, 3]


def test_no_episode_no_context() -> None:
    assert FaultBooks(0, 2).context(1.0, frozenset(), epoch=0, redundancy=None) is None


def test_the_worker_writes_its_redundancy_facts_for_the_engine_core(tmp_path: Path) -> None:
    facts = RedundancyFacts(ep_size=4, local_slots=3, num_logical=8, tp_size=2)
    status = StatusFile(tmp_path / "status.json")
    status.write(file_fields({"phase": "healthy", "epoch": 1}, facts))
    assert redundancy_facts(status.read()) == facts
    status.write(file_fields({"phase": "healthy"}))
    assert redundancy_facts(status.read()) is None  # unknown (EPLB off)
    for bad in ([4, 3, 8], {"ep_size": 4}, {"ep_size": 1, "local_slots": 1, "num_logical": 9}):
        with pytest.raises(ConfigError):
            redundancy_facts({"redundancy": bad})


@pytest.mark.parametrize(
    ("proposal", "rank", "world", "removed", "dead", "holds"),
    [
        (Proposal("retry"), 1, 2, set(), set(), True),  # everyone rebuilds together
        (Proposal("scale_down", {1}), 0, 2, set(), set(), True),  # half, the lowest rank
        (Proposal("scale_down", {0}), 1, 2, set(), set(), False),  # half, not the lowest
        (Proposal("scale_down", {0}), 1, 2, set(), {0}, True),  # 0 proven dead
        (Proposal("scale_down", {2}), 0, 3, set(), set(), True),  # 2 of 3
        (Proposal("scale_down", {0, 1}), 2, 3, set(), set(), False),  # 1 of 3
        (Proposal("scale_down", {0, 1}), 2, 3, set(), {0, 1}, True),
        (Proposal("scale_down", {1, 3}), 0, 4, {3}, set(), True),  # 3 was removed before
        (Proposal("scale_down", {0, 2, 3}), 1, 4, {3}, set(), False),  # 1 of 3 live: cut off
        (Proposal("scale_down", {0, 3}), 1, 4, {3}, set(), True),  # 2 of 3 live
    ],
)  # fmt: skip
def test_a_scale_down_needs_its_survivors_to_hold_the_majority_of_the_live_ranks(
    proposal: Proposal, rank: int, world: int, removed: set[int], dead: set[int], holds: bool
) -> None:
    assert holds_majority(proposal, rank, world, frozenset(removed), frozenset(dead)) is holds
