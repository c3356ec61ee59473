"""Token-level re-inference bookkeeping: a ledger resumes from its last emitted token, a
lost cache is replayed token by token (checked against what was emitted), re-runs are
bounded, and a lone suspect that faults again on its rank is the poison request."""

from __future__ import annotations

import pytest

from ftengine.reinference import PoisonProbe, Reinference, ReplayMismatch, TokenLedger
from ftengine.testbed.cluster.generation import StepFailed
from ftengine.testbed.cluster.inflight import Held, Resumption


def test_a_ledger_decodes_then_resumes_after_a_fault_from_its_last_token() -> None:
    ledger = TokenLedger((1, 2, 3))
    assert ledger.next_input() == (0, (1, 2, 3))
    assert ledger.accept(7) == 7
    assert ledger.next_input() == (3, (7,))
    ledger.faulted()  # the step's KV is dropped: the same input again
    assert ledger.next_input() == (3, (7,)) and ledger.reruns == 1
    assert ledger.accept(8) == 8 and ledger.emitted == [7, 8]


def test_a_lost_cache_is_replayed_and_only_new_tokens_are_emitted() -> None:
    ledger = TokenLedger((1, 2), emitted=[5, 6], computed=3)
    ledger.cache_lost()
    assert ledger.next_input() == (0, (1, 2))
    assert ledger.accept(5) is None  # replays emitted[0]
    assert ledger.next_input() == (2, (5,))
    assert ledger.accept(6) is None
    assert ledger.next_input() == (3, (6,))
    assert ledger.accept(9) == 9 and ledger.emitted == [5, 6, 9]


def test_a_replay_that_disagrees_with_what_was_emitted_raises() -> None:
    ledger = TokenLedger((1,), emitted=[5])
    ledger.next_input()
    with pytest.raises(ReplayMismatch, match="predicted token 4, but 5 was already emitted"):
        ledger.accept(4)


def test_bounds_say_when_and_why() -> None:
    bounds = Reinference(max_reruns=3, deadline_s=10.0)
    assert bounds.over_limit(3) is None
    assert "may be re-run at most 3 times" in (bounds.over_limit(4) or "")
    assert bounds.expired(10.0) is None
    assert "10s recovery deadline" in (bounds.expired(10.5) or "")
    assert "recovery ended DEAD" in Reinference.dead("engine 1 is DEAD")


def test_the_probe_runs_suspects_one_at_a_time() -> None:
    probe = PoisonProbe()
    probe.suspect(["a", "b", "c"])
    assert probe.probe() == "a" and probe.waits("b") and not probe.waits("a")
    probe.cleared("a")
    assert probe.probe() == "b" and not probe.waits("b") and probe.waits("c")


def test_the_culprit_is_the_probe_only_when_every_mate_ran_clean_without_it() -> None:
    probe = PoisonProbe()
    assert probe.culprit(["a"], set()) is None  # nobody suspected
    probe.suspect(["a", "b"])
    probe.cleared("a")
    assert probe.culprit(["a", "b"], {"a"}) == "b" and probe.culprit(["b"], set()) == "b"
    assert probe.culprit(["a", "b", "new"], {"a"}) is None  # "new" never ran clean
    assert probe.culprit(["a"], {"a"}) is None  # the probe did not run


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def held(max_reruns: int = 3, verdict: str | None = None) -> tuple[Held, Clock]:
    clock = Clock()
    return Held(Resumption(Reinference(max_reruns, 5.0), lambda: verdict, clock)), clock


def failed(*culprits: int) -> StepFailed:
    return StepFailed("step failed", frozenset(culprits), frozenset(culprits))


def test_a_poison_request_is_found_alone_and_its_mates_are_not_charged() -> None:
    state, _ = held()
    ledgers = {rid: TokenLedger((1,)) for rid in "pab"}
    ran = [("p", 0, ledgers["p"]), ("a", 0, ledgers["a"]), ("b", 1, ledgers["b"])]
    assert state.step_failed(failed(0), ran) == []
    assert state.probe.suspects == ["p", "a"]  # rank 0's requests; b was on a healthy rank
    assert [ledger.reruns for ledger in ledgers.values()] == [1, 1, 1]
    # Re-run: the probe p alone on rank 0 (a waits), b on rank 1; rank 0 faults again.
    [ending] = state.step_failed(failed(0), [("p", 0, ledgers["p"]), ("b", 1, ledgers["b"])])
    assert ending.request_id == "p" and ending.poison
    assert "poison request" in ending.detail and "rank 0" in ending.detail
    assert ledgers["b"].reruns == 1 and state.probe.suspects == ["a"]


def test_a_request_over_the_limit_ends_with_the_reason() -> None:
    state, _ = held(max_reruns=1)
    ledger = TokenLedger((1,))
    ran = [("x", 0, ledger), ("y", 0, TokenLedger((2,)))]
    assert state.step_failed(failed(), ran) == []  # nobody to blame: no suspects
    [first, second] = state.step_failed(failed(), ran)
    assert {first.request_id, second.request_id} == {"x", "y"} and not first.poison
    assert "re-inference limit reached" in first.detail


def test_held_requests_give_up_past_the_deadline_or_on_a_dead_verdict() -> None:
    state, clock = held()
    assert state.give_up() is None
    state.hold()
    clock.now = 5.0
    assert state.give_up() is None
    clock.now = 5.5
    assert "recovery deadline" in (state.give_up() or "")
    state.resumed()
    assert state.give_up() is None
    dead, _ = held(verdict="engine 2 is DEAD: gave up")
    assert "recovery ended DEAD" in (dead.give_up() or "")
