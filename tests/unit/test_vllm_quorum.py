"""The majority rule (``engine_core/quorum.py``): never two sides serving, exactly one side
of a clean two-way split, the even split's tie-break; and the UDP reachability probes
against real sockets (an answering peer, a closed port, a silent peer)."""

from __future__ import annotations

import socket
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ftengine.errors import ConfigError
from ftengine.integrations.vllm.engine_core import quorum
from ftengine.integrations.vllm.engine_core.quorum import (
    PROBE_S,
    Reachability,
    Sight,
    explain,
    keeps_serving,
    sight,
)


def test_strict_majority_serves_minority_stops() -> None:
    members = frozenset(range(4))
    assert keeps_serving(Sight(1, members, {0, 1, 2}))
    assert not keeps_serving(Sight(3, members, {3}))


def test_even_split_goes_to_the_side_of_the_lowest_live_rank() -> None:
    members = frozenset(range(4))
    assert keeps_serving(Sight(1, members, {0, 1}))
    assert not keeps_serving(Sight(2, members, {2, 3}))
    # ranks 0 and 3 proven dead: live {1, 2}, split evenly, the lowest live rank is 1
    assert keeps_serving(Sight(1, members, {1}, dead={0, 3}))
    assert not keeps_serving(Sight(2, members, {2}, dead={0, 3}))
    assert not keeps_serving(Sight(1, members, {1}, dead={0}))  # 1 of the live {1, 2, 3}


def test_proven_dead_ranks_do_not_count_a_lost_host_leaves_a_majority() -> None:
    # host 1 (ranks 1, 2) killed: its ports closed, so rank 0 alone is all that lives
    assert keeps_serving(Sight(0, {0, 1, 2}, {0}, dead={1, 2}))
    # the same silence without proof is a cut: one of three is no majority
    assert not keeps_serving(Sight(0, {0, 1, 2}, {0}))


def test_a_dead_or_removed_engine_never_serves() -> None:
    assert not keeps_serving(Sight(2, {0, 1, 2}, {0, 1, 2}, dead={2}))
    assert not keeps_serving(Sight(2, {0, 1}, {0, 1, 2}))


def test_explain_names_the_partition_and_the_sides() -> None:
    text = explain(Sight(3, range(4), {3}))
    assert "network partition" in text and "[3] of [0, 1, 2, 3]" in text
    assert "rank 0" in text


def test_sight_checks_its_ranks() -> None:
    with pytest.raises(ConfigError):
        Sight(0, {0, -1}, {0})


@st.composite
def splits(draw: st.DrawFn) -> tuple[frozenset[int], list[frozenset[int]], frozenset[int]]:
    """Members, their split into disjoint sides (every member on one), and the dead."""
    world = draw(st.integers(1, 9))
    removed = draw(st.frozensets(st.integers(0, world - 1), max_size=world - 1))
    members = frozenset(range(world)) - removed
    side_of = {r: draw(st.integers(0, 3)) for r in sorted(members)}
    sides = [frozenset(r for r, s in side_of.items() if s == i) for i in range(4)]
    dead = draw(st.frozensets(st.sampled_from(sorted(members)))) if members else frozenset()
    return members, [s for s in sides if s], dead


def serving(
    members: frozenset[int], sides: list[frozenset[int]], dead: frozenset[int]
) -> list[int]:
    """The sides (indices) with a rank that keeps serving: each rank reaches its own side
    and proves dead only the dead on its side (it cannot see across the cut)."""
    found = []
    for i, side in enumerate(sides):
        votes = [keeps_serving(Sight(r, members, side - dead, dead & side)) for r in side - dead]
        assert len(set(votes)) <= 1  # every live rank of a side decides the same
        if any(votes):
            found.append(i)
    return found


@given(splits())
def test_never_two_sides_serve(
    split: tuple[frozenset[int], list[frozenset[int]], frozenset[int]],
) -> None:
    members, sides, dead = split
    assert len(serving(members, sides, dead)) <= 1


@given(splits())
def test_a_two_way_split_with_no_deaths_has_exactly_one_serving_side(
    split: tuple[frozenset[int], list[frozenset[int]], frozenset[int]],
) -> None:
    members, sides, _ = split
    if len(sides) <= 2:
        assert len(serving(members, sides, frozenset())) == 1


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _until(check: object, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_probes_hear_an_answering_peer_and_see_a_closed_port_as_dead() -> None:
    clock = Clock()
    mine = Reachability(0, "127.0.0.1", clock).start()
    peer = Reachability(1, "127.0.0.1").start()
    closed = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    closed.bind(("127.0.0.1", 0))
    closed_address = ("127.0.0.1", int(closed.getsockname()[1]))
    closed.close()  # nobody listens there now: the kernel answers "port unreachable"
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))  # open, never answers: what a cut looks like
    try:
        mine.know({1: peer.address, 2: closed_address, 3: ("127.0.0.1", silent.getsockname()[1])})
        _until(lambda: 2 in mine.refused())
        clock.now = quorum.SILENT_S + 0.5  # nothing heard from 3 since; 1 answers on
        _until(lambda: mine.reaches() == {1})
        seen = sight(0, 4, (), mine)
        assert seen.dead == {2} and seen.side == {0, 1} and seen.live == {0, 1, 3}
        assert keeps_serving(seen)  # 2 of the 3 live
    finally:
        mine.stop()
        peer.stop()
        silent.close()


def test_stepped_probes_answer_and_hear_what_waited_in_the_sockets() -> None:
    """Driven by the caller's beat (the agent's watch thread), not a thread of their own:
    nothing is answered between steps, everything is at the next one."""
    mine, peer = Reachability(0, "127.0.0.1"), Reachability(1, "127.0.0.1")
    try:
        mine.know({1: peer.address})
        mine.step()  # probe sent; the peer has not stepped, so no answer yet
        assert mine._missed[1] == 1
        time.sleep(0.05)
        peer.step()  # answers the ping that waited in its socket
        time.sleep(0.05)
        mine._next_probe = time.monotonic() + 60  # hear only, no new probe
        mine.step()
        assert mine._missed[1] == 0 and mine.reaches() == {1}
    finally:
        mine.close()
        peer.close()


def test_a_peer_with_no_address_yet_counts_as_reached() -> None:
    reach = Reachability(0, "127.0.0.1")
    try:
        assert sight(0, 3, (), reach).side == {0, 1, 2}
        assert sight(0, 3, {2}, reach).members == {0, 1}
    finally:
        reach.sock.close()


def test_a_forgotten_peer_is_no_longer_refused_and_counts_as_reached_until_known_again() -> None:
    """A rank admitted back (scale_up) runs a new process: its old probe port is closed,
    which must not make it dead; until its new address is read it counts as reached."""
    reach = Reachability(0, "127.0.0.1")
    closed = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    closed.bind(("127.0.0.1", 0))
    address = closed.getsockname()
    closed.close()  # the old process's port
    reach.know({2: address})
    deadline = time.monotonic() + 10
    while 2 not in reach.refused() and time.monotonic() < deadline:
        reach.step()
        time.sleep(PROBE_S)
    assert reach.refused() == {2}
    reach.forget({2})
    assert reach.refused() == frozenset() and reach.known == frozenset()
    seen = sight(0, 3, (), reach)
    assert seen.dead == frozenset() and 2 in seen.reaches
    reach.close()
