"""The real-vLLM chaos campaign's rules and bookkeeping, without vLLM: victims, when to
rebuild, detection bounds, the orchestrator's decisions from engine statuses, and the
per-fault judgement (the cluster campaign's invariants with vLLM's bounds)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from ftengine.testbed.chaos.campaign import rebuild_after
from ftengine.testbed.chaos.catalogue import ChaosKind, PlannedFault, When, plan
from ftengine.testbed.chaos.cluster_options import PROCESS_KINDS
from ftengine.testbed.chaos.history import History
from ftengine.testbed.chaos.invariants import FaultResult, check_request
from ftengine.testbed.chaos.recovery import Decision, Orchestrator
from ftengine.testbed.chaos.traffic import StreamRecord
from ftengine.testbed.chaos.vllm_options import VllmCampaignOptions
from ftengine.testbed.chaos.vllm_plan import (
    HOST_KINDS,
    NOT_COVERED,
    NOT_COVERED_ON_HOSTS,
    VLLM_KINDS,
    as_dead,
    coalesced,
    cut_hosts,
    decide,
    detection_bound,
    detectors,
    follows,
    judge,
    rebuild_first,
    relaunch_failed,
    removed_ranks,
    stopping,
    victims,
)
from ftengine.testbed.chaos.vllm_recover import VllmChannel, VllmRules
from ftengine.testbed.chaos.vllm_target import VllmTarget
from ftengine.testbed.chaos.vllm_watch import StatusWatch
from ftengine.testbed.vllm.hosts import HostLayout


def fault(kind: ChaosKind, pick: int = 0, when: When = When.STEADY, index: int = 0) -> PlannedFault:
    return PlannedFault(index=index, kind=kind, when=when, delay_steps=1, pick=pick)


def engine(rank: int, status: str, removed: tuple[int, ...] = (), **extra: Any) -> dict[str, Any]:
    return {"id": rank, "status": status, "removed_ranks": list(removed), **extra}


def test_the_plan_draws_only_what_vllm_supports_and_replays() -> None:
    first = plan(19, 12, VLLM_KINDS)
    assert {f.kind for f in first} <= set(VLLM_KINDS)
    assert {f.kind for f in first[: len(VLLM_KINDS)]} == set(VLLM_KINDS)  # every kind first
    assert plan(19, 12, VLLM_KINDS) == first
    assert ChaosKind.NET_CUT not in VLLM_KINDS and ChaosKind.RELOAD_ERROR not in VLLM_KINDS


@pytest.mark.parametrize(
    ("kind", "pick", "live", "expected"),
    [
        (ChaosKind.RANK0, 5, [0, 1, 2], (0,)),
        (ChaosKind.RANK0, 5, [1, 2], ()),
        (ChaosKind.SIGKILL, 0, [0, 1, 2], (1,)),  # never rank 0: its loss is its own kind
        (ChaosKind.SIGKILL, 1, [0, 1, 2], (2,)),
        (ChaosKind.SIGSTOP, 7, [0, 2], (2,)),
        (ChaosKind.SIGKILL, 3, [0], ()),
        (ChaosKind.TWO_RANKS, 4, [0, 1, 2], (1, 2)),
        (ChaosKind.TWO_RANKS, 4, [0, 1], ()),
        (ChaosKind.STEP_RAISE, 0, [0, 1, 2], (0,)),  # a step exception may hit rank 0
        (ChaosKind.STEP_RAISE, 2, [0, 1, 2], (2,)),
        (ChaosKind.ENGINE_CORE, 0, [0, 1, 2], (1,)),  # never rank 0's: its server would stop
        (ChaosKind.ENGINE_CORE, 1, [0], ()),
        (ChaosKind.POISON, 0, [0, 1, 2], (0,)),  # sent to any rank, rank 0's server too
        (ChaosKind.POISON, 4, [0, 1, 2], (1,)),
        (ChaosKind.NET_CUT, 0, [0, 1, 2], ()),  # one host: nothing to cut
    ],
)
def test_victims(kind: ChaosKind, pick: int, live: list[int], expected: tuple[int, ...]) -> None:
    assert victims(fault(kind, pick), live) == expected


@pytest.mark.parametrize(
    ("layout", "pick", "live", "expected"),
    [
        ((2, 2), 0, [0, 1, 2, 3], (2, 3)),  # host 1: both its ranks at once
        ((2, 2), 7, [0, 1, 2, 3], (2, 3)),  # the only host but rank 0's
        ((2, 2), 0, [0, 1, 3], (3,)),  # what is left of host 1
        ((2, 2), 0, [0, 1], ()),  # host 1 gone already: no victim
        ((2, 1, 1), 1, [0, 1, 2, 3], (3,)),  # hosts 1 and 2, the pick chooses host 2
        ((2, 1, 1), 0, [0, 1, 3], (3,)),  # host 1's rank gone: host 2 is the only one left
        ((3,), 0, [0, 1, 2], ()),  # one host: rank 0's, never hit
    ],
)
def test_a_hosts_victims_are_its_live_ranks_never_rank_0s_host(
    layout: tuple[int, ...], pick: int, live: list[int], expected: tuple[int, ...]
) -> None:
    assert victims(fault(ChaosKind.HOST, pick), live, HostLayout(layout)) == expected
    assert victims(fault(ChaosKind.HOST, pick), live) == ()  # one host: no host to lose


@pytest.mark.parametrize(
    ("layout", "pick", "live", "expected"),
    [
        ((2, 1), 0, [0, 1, 2], (2,)),  # host 1 cut off: 1 of 3 live ranks
        ((2, 2), 0, [0, 1, 2, 3], (2, 3)),  # an even split: rank 0's side keeps serving
        ((1, 1, 1), 1, [0, 1, 2], (2,)),
        ((1, 2), 0, [0, 1, 2], ()),  # host 1 holds the majority: it would serve, not stop
        ((1, 2), 0, [0, 2], (2,)),  # rank 1 removed: an even split, rank 0's side serves
        ((2, 1, 1), 0, [0, 1, 2, 3], (2,)),
    ],
)
def test_a_cut_off_host_is_one_the_other_hosts_outvote(
    layout: tuple[int, ...], pick: int, live: list[int], expected: tuple[int, ...]
) -> None:
    assert victims(fault(ChaosKind.NET_CUT, pick), live, HostLayout(layout)) == expected


def test_a_cuts_sides_are_the_victims_host_and_all_the_others() -> None:
    assert cut_hosts((2,), HostLayout((2, 1))) == ([0], [1])
    assert cut_hosts((3,), HostLayout((2, 1, 1))) == ([0, 1], [2])
    assert rebuild_first(fault(ChaosKind.NET_CUT), [0, 1, 2], layout=HostLayout((2, 1))) is None
    assert "no victim" in str(
        rebuild_first(fault(ChaosKind.NET_CUT), [0, 1, 2], layout=HostLayout((1, 2)))
    )


def test_a_host_loss_takes_its_live_ranks_and_needs_a_survivor() -> None:
    two_by_two = HostLayout((2, 2))
    assert rebuild_first(fault(ChaosKind.HOST), [0, 1, 2, 3], layout=two_by_two) is None
    assert rebuild_first(fault(ChaosKind.HOST), [0, 2, 3], layout=two_by_two) is None
    # rank 0 alone would be left with a follow-up kill on top: rebuild first
    assert "takes 3" in str(rebuild_first(fault(ChaosKind.HOST), [0, 2, 3], 1, two_by_two))
    assert "no victim" in str(rebuild_first(fault(ChaosKind.HOST), [0, 1], layout=two_by_two))


def test_on_hosts_the_plan_adds_a_hosts_loss_and_the_cluster_never_draws_it(
    tmp_path: Path,
) -> None:
    on_hosts = VllmCampaignOptions(tmp_path, faults=12, seed=3, dp_size=4, hosts=2)
    assert on_hosts.layout == HostLayout((2, 2))
    assert VllmCampaignOptions(tmp_path, dp_size=4).layout is None
    drawn = plan(3, 12, VLLM_KINDS + HOST_KINDS)
    first = {f.kind for f in drawn[: len(VLLM_KINDS) + 2]}  # every kind first
    assert {ChaosKind.HOST, ChaosKind.NET_CUT} <= first
    assert ChaosKind.HOST not in PROCESS_KINDS  # the cluster's namespaces hold one rank each
    assert ChaosKind.POISON not in PROCESS_KINDS  # (the cluster's serving tests cover it)
    assert NOT_COVERED.keys() - NOT_COVERED_ON_HOSTS.keys() == {"net_cut"}  # injected on hosts
    assert "namespace" in NOT_COVERED["net_cut"]


def test_rebuild_first_when_a_fault_cannot_run_on_what_is_left() -> None:
    full = [0, 1, 2]
    assert rebuild_first(fault(ChaosKind.STEP_RAISE), full) is None
    # after a scale-down too: the retry rebuilds among the survivors
    assert rebuild_first(fault(ChaosKind.STEP_RAISE), [0, 1]) is None
    assert rebuild_first(fault(ChaosKind.SIGKILL), [0, 1]) is None
    assert rebuild_first(fault(ChaosKind.SIGKILL), [0]) is not None  # no victim
    assert rebuild_first(fault(ChaosKind.RANK0), [0]) is not None  # no survivor
    assert rebuild_first(fault(ChaosKind.RANK0), [1, 2]) is not None  # rank 0 gone
    assert rebuild_first(fault(ChaosKind.TWO_RANKS), full) is None
    assert rebuild_first(fault(ChaosKind.TWO_RANKS), full, extra_lost=1) is not None


def test_rebuild_after_only_a_recovery_that_did_not_settle() -> None:
    """Rank 0 lost with two survivors goes on: its parked engine core keeps the DP
    coordinator up (coordinator_host.py)."""
    assert rebuild_after("settled") is None
    assert rebuild_after("dead") == "recovery ended dead"
    assert rebuild_after("stuck") == "recovery ended stuck"


def test_a_follow_up_sigkill_lands_during_recovery_only_with_a_survivor_to_spare() -> None:
    first = fault(ChaosKind.SIGKILL, pick=1)  # hits rank 2 of [0, 1, 2]
    during = fault(ChaosKind.SIGKILL, when=When.RECOVERY, index=1)
    assert follows(first, during, [0, 1, 2])
    assert not follows(first, during, [0, 2])  # rank 0 alone would be left: no victim
    assert not follows(first, fault(ChaosKind.SIGKILL, index=1), [0, 1, 2])  # steady
    assert not follows(first, fault(ChaosKind.STEP_RAISE, when=When.RECOVERY), [0, 1, 2])
    assert follows(fault(ChaosKind.STEP_RAISE), during, [0, 1])
    assert not follows(first, None, [0, 1, 2])


def test_detection_bounds_and_who_must_see_the_fault() -> None:
    assert detection_bound(ChaosKind.SIGKILL, 3.0) == 3.0
    assert detection_bound(ChaosKind.SIGSTOP, 3.0) == 4.0
    assert detection_bound(ChaosKind.STEP_RAISE, 3.0) == 4.0  # peers see it at the op timeout
    assert detection_bound(ChaosKind.POISON, 3.0) == 4.0  # a step exception of its own
    assert detection_bound(ChaosKind.NET_CUT, 3.0) == 4.0  # silence, or the op timeout
    assert detectors(ChaosKind.SIGSTOP, [0, 1, 2], (1,)) == (0, 2)  # the stopped one cannot
    assert detectors(ChaosKind.SIGKILL, [0, 1, 2], (1,)) == (0, 1, 2)
    assert detectors(ChaosKind.SIGKILL, [0, 1], (1,), When.RECOVERY) == (1,)  # peers faulted


def test_decide_retry_when_every_engine_faulted_and_none_died() -> None:
    engines = {r: engine(r, "unhealthy") for r in range(3)}
    decision = decide(engines, (), 0.0, 5.0)
    assert (decision.action, decision.instruction) == ("command", "retry")
    assert decision.targets == (0, 1, 2)


def test_decide_scale_down_past_the_dead_cumulatively() -> None:
    engines = {0: engine(0, "unhealthy", (2,)), 1: engine(1, "dead"), 2: engine(2, "dead")}
    decision = decide(engines, (1,), 0.0, 5.0)
    assert decision.action == "command" and decision.instruction == "scale_down"
    assert decision.targets == (0,) and decision.params == {"removed_dp_ranks": [1, 2]}


def test_a_rank_rejoining_is_down_for_the_decision_never_commanded() -> None:
    """Rank 0 relaunching its worker in place (``loading``, then ``ready``, which reads
    ``unhealthy``) while its survivors still have to scale it down, or after they died too."""
    ready = engine(0, "unhealthy", phase="ready")
    peers = {1: engine(1, "unhealthy"), 2: engine(2, "unhealthy")}
    decision = decide({0: ready, **peers}, (0,), 0.0, 5.0)
    assert (decision.action, decision.targets) == ("command", (1, 2))
    assert decision.params == {"removed_dp_ranks": [0]}
    loading = engine(0, "dead", phase="loading")
    assert decide({0: loading, **peers}, (0,), 0.0, 5.0).params == {"removed_dp_ranks": [0]}
    gone = {1: engine(1, "dead"), 2: engine(2, "dead")}
    assert decide({0: ready, **gone}, (0, 1), 0.0, 5.0) == Decision("done", state="dead")
    assert as_dead(ready)["status"] == "dead"  # the fault's victim: not a member yet
    assert as_dead(engine(1, "healthy", phase="healthy"))["status"] == "healthy"


def test_a_partitions_stopping_minority_is_down_for_the_decision() -> None:
    """Seen on hosts: the cut-off rank reported ``unhealthy`` for a moment before it went
    ``dead``; a retry of all three then waited 30 s for it. Its status says it is stopping."""
    why = "network partition: engine 2 reaches live DP ranks [2] of [0, 1, 2], not a majority"
    cut = engine(2, "unhealthy", fault_info=why)
    peers = {0: engine(0, "unhealthy"), 1: engine(1, "unhealthy")}
    decision = decide({**peers, 2: cut}, (2,), 0.0, 5.0)
    assert (decision.instruction, decision.targets) == ("scale_down", (0, 1))
    assert decision.params == {"removed_dp_ranks": [2]}
    # the majority not faulted yet: wait for it, never fence it for the minority's sake
    assert decide({0: engine(0, "healthy"), 1: engine(1, "healthy"), 2: cut}, (2,), 9.0, 5.0) == (
        Decision("wait")
    )
    assert stopping(cut) and not stopping(engine(2, "unhealthy", fault_info="PeerDead"))
    assert not stopping(engine(2, "dead", fault_info=why))  # dead already: down as such


def test_a_failed_relaunch_is_seen_as_one_and_the_heal_gives_up_at_once(tmp_path: Path) -> None:
    """Seen in the 60-fault campaign on hosts: rank 0's relaunch failed and the heal waited
    its whole 600 s deadline for a ``ready`` that could not come."""
    why = "engine 0's worker process died and relaunching it failed: RelaunchFailed: x"
    failed = engine(0, "dead", phase="dead", fault_info=why)
    assert relaunch_failed(failed)
    assert not relaunch_failed(engine(0, "dead", phase="loading", fault_info="relaunching"))
    assert not relaunch_failed(engine(0, "dead", phase="dead", fault_info="RuntimeError"))

    class Watch:
        def poll(self) -> dict[int, dict[str, Any]]:
            return {0: failed, 1: engine(1, "healthy")}

    target = VllmTarget(VllmCampaignOptions(tmp_path, dp_size=3), lambda line: None)
    target.running = SimpleNamespace(watch=Watch())  # type: ignore[assignment]
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"ranks \[0\] will not be ready"):
        target._await([0], lambda e: e.get("phase") == "ready", "ready",
                      started + 600.0, failed=relaunch_failed)  # fmt: skip
    assert time.monotonic() - started < 5.0
    target.close()


def test_decide_waits_for_a_slow_peer_then_fences_it() -> None:
    engines = {0: engine(0, "unhealthy"), 1: engine(1, "healthy"), 2: engine(2, "unhealthy")}
    assert decide(engines, (), 1.0, 5.0).action == "wait"
    decision = decide(engines, (), 5.5, 5.0)
    assert (decision.action, decision.targets) == ("fence", (1,))


def test_decide_settled_dead_and_waiting_for_detection() -> None:
    settled = {0: engine(0, "healthy", (2,)), 1: engine(1, "healthy", (2,)), 2: engine(2, "dead")}
    assert decide(settled, (2,), 0.0, 5.0).state == "settled"
    undetected = {0: engine(0, "healthy"), 1: engine(1, "healthy"), 2: engine(2, "dead")}
    assert decide(undetected, (2,), 0.0, 5.0).action == "wait"
    assert decide(undetected, (), 0.0, 5.0).state == "dead"  # no victim should have died
    gone = {0: engine(0, "unreachable"), 1: engine(1, "dead", (0,))}
    assert decide(gone, (0, 1), 0.0, 5.0).state == "dead"
    assert removed_ranks(settled) == {2}


def result(**changes: Any) -> FaultResult:
    fields: dict[str, Any] = dict(
        index=0, kind=ChaosKind.SIGKILL, when=When.STEADY, step=-1, victims=(2,),
        detect_s=0.2, recover_s=2.0, outcome="settled",
        engines=(engine(0, "healthy", (2,)), engine(1, "healthy", (2,)),
                 engine(2, "dead", ft_error="worker process died")),
    )  # fmt: skip
    return FaultResult(**{**fields, **changes})


def test_judge_passes_a_clean_fault_and_catches_each_planted_violation() -> None:
    assert judge(result(), 3.0) == []
    assert judge(result(detect_s=3.5), 3.0)[0].startswith("detection: 3.500 s > bound 3.0")
    assert judge(result(kind=ChaosKind.STEP_RAISE, detect_s=3.5, victims=(1,)), 3.0) == []
    assert judge(result(detect_s=None), 3.0)[0].startswith("detection: not detected")
    assert judge(result(detect_s=None, when=When.RECOVERY), 3.0) == []
    stuck = judge(result(outcome="stuck", engines=(engine(0, "unhealthy"),)), 3.0)
    assert any(p.startswith("stuck_unhealthy") for p in stuck)
    alive = judge(result(engines=(engine(0, "healthy"), engine(2, "healthy"))), 3.0)
    assert any(p.startswith("victims_dead") for p in alive)
    silent = judge(result(engines=(engine(0, "healthy"), engine(2, "dead"))), 3.0)
    assert any(p.startswith("dead_without_reason") for p in silent)


class ScriptedWatch(StatusWatch):
    """A status watch whose engines change only when the test (or a command) says so."""

    def __init__(self, engines: dict[int, dict[str, Any]]) -> None:  # no thread, no HTTP
        self.engines = engines
        self.changes = []

    def poll(self) -> dict[int, dict[str, Any]]:
        return self.latest()

    def latest(self) -> dict[int, dict[str, Any]]:
        return {r: dict(e) for r, e in self.engines.items()}


def orchestrator(
    watch: ScriptedWatch, on_apply: Any, workers: dict[int, int] | None = None
) -> tuple[Orchestrator[Any], VllmChannel, list[tuple[int, dict[str, Any]]]]:
    """An orchestrator with vLLM's rules, its channel, whose POSTs reach
    ``on_apply(rank, body)`` (vLLM's 202), and what was POSTed."""
    sent: list[tuple[int, dict[str, Any]]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        rank = int(str(request.url.host).removeprefix("rank"))
        body = json.loads(request.content)
        sent.append((rank, body))
        on_apply(rank, body)
        return httpx.Response(202, json={"request_id": "x"})

    urls = [f"http://rank{r}" for r in watch.engines]
    http = httpx.Client(transport=httpx.MockTransport(handler))
    channel = VllmChannel(urls, workers or {}, watch, History(), command_timeout_s=2.0, http=http)
    return Orchestrator(channel, lambda: VllmRules(grace_s=0.3)), channel, sent


def test_the_orchestrator_retries_every_faulted_rank_until_all_are_healthy() -> None:
    watch = ScriptedWatch({r: engine(r, "unhealthy", epoch=0) for r in range(3)})

    def apply(rank: int, body: dict[str, Any]) -> None:
        assert body == {"instruction": "retry", "params": {}}
        watch.engines[rank] = engine(rank, "healthy", epoch=1)

    made, _channel, sent = orchestrator(watch, apply)
    outcome = made.recover(0, deadline_s=5.0)
    assert outcome.state == "settled"
    assert sorted(rank for rank, _ in sent) == [0, 1, 2] and len(outcome.commands) == 1


def test_the_orchestrator_fences_a_hung_engine_then_scales_down_past_it() -> None:
    hung = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watch = ScriptedWatch(
            {0: engine(0, "unhealthy"), 1: engine(1, "unhealthy"), 2: engine(2, "healthy")}
        )
        fenced: list[int] = []

        def apply(rank: int, body: dict[str, Any]) -> None:
            assert body == {"instruction": "scale_down", "params": {"removed_dp_ranks": [2]}}
            watch.engines[rank] = engine(rank, "healthy", (2,))

        made, channel, sent = orchestrator(watch, apply, workers={2: hung.pid})

        def fence(rank: int) -> None:  # the campaign stops that rank's streams; vLLM: dead
            fenced.append(rank)
            watch.engines[rank] = engine(rank, "dead", ft_error="worker process died")

        channel.on_fence = fence
        outcome = made.recover(0, deadline_s=5.0)
        assert hung.wait(timeout=5.0) == -signal.SIGKILL  # the hung worker was killed
        assert fenced == [2] == channel.fenced
        assert outcome.state == "settled" and sorted(r for r, _ in sent) == [0, 1]
    finally:
        hung.kill()
        hung.wait()


def test_the_orchestrator_reports_stuck_at_its_deadline() -> None:
    watch = ScriptedWatch({0: engine(0, "unhealthy"), 1: engine(1, "unhealthy")})
    made, _channel, sent = orchestrator(watch, lambda rank, body: None)  # commands change nothing
    outcome = made.recover(0, deadline_s=1.0)
    assert outcome.state == "stuck" and len(sent) >= 2


def record(chunks: list[list[int]], finish: str = "length") -> StreamRecord:
    return StreamRecord(client=0, prompt=0, started=0.0, chunks=chunks, finish_reason=finish)


def test_vllms_coalesced_chunks_are_no_gap_but_a_real_gap_or_wrong_token_still_is() -> None:
    reference = [5, 6, 7, 8]
    merged = record([[5], [6, 7], [8]])  # vLLM merged two deltas: every token, in order
    assert coalesced(merged, check_request(merged, reference, 4))
    gap = record([[5], [7], [8]])
    assert not coalesced(gap, check_request(gap, reference, 4))
    repeat = record([[5], [6, 6], [7, 8]])
    assert not coalesced(repeat, check_request(repeat, reference, 4))
    wrong = record([[5], [6, 9], [8]])
    assert not coalesced(wrong, check_request(wrong, reference, 4))
    cut = record([[5], [6, 7]], finish="abort")
    assert not coalesced(cut, check_request(cut, reference, 4))


def test_chaos_vllm_refuses_more_hosts_than_ranks_saying_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from ftengine.testbed.cli import chaos_vllm

    parser = argparse.ArgumentParser()
    chaos_vllm.register(parser)
    given = ["--checkpoint", str(tmp_path / "ckpt")]
    assert parser.parse_args(given).hosts == 1  # one host (the root namespace) by default
    args = parser.parse_args([*given, "--dp", "2", "--hosts", "3"])
    assert args.func(args) == 2
    assert "--hosts 3 is more than --dp 2" in capsys.readouterr().err
    assert not (tmp_path / "ckpt").exists()  # refused before anything was made
    with pytest.raises(SystemExit):
        parser.parse_args([*given, "--hosts", "0"])
