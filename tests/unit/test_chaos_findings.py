"""What both campaigns find with the same code (``chaos/findings.py``): a stream's problem
blamed on the fault injected last before it ended, a fault's problems as violations with
their history, the survivors' memory growth; and the real-vLLM campaign loads nothing of
the CPU cluster's world."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import attrs

from ftengine.testbed.chaos.catalogue import ChaosKind, Injected, PlannedFault, When
from ftengine.testbed.chaos.census import Census, Leftovers
from ftengine.testbed.chaos.findings import (
    Findings,
    fault_violations,
    request_violations,
    rss_ratio,
    summary_fields,
)
from ftengine.testbed.chaos.history import History
from ftengine.testbed.chaos.invariants import FaultResult
from ftengine.testbed.chaos.shares import (
    REASON_CHARS,
    answered_share,
    by_kind_shares,
    minority_side,
    unanswered_reasons,
)
from ftengine.testbed.chaos.traffic import StreamRecord


def planned(index: int, kind: ChaosKind) -> PlannedFault:
    return PlannedFault(index=index, kind=kind, when=When.STEADY, delay_steps=0, pick=0)


def shot(fault: PlannedFault, at: float) -> Injected:
    return Injected(fault, at, victims=(1,), detectors=(0,), step=-1)


def test_a_streams_problem_is_blamed_on_the_fault_injected_last_before_it_ended() -> None:
    # An --only replay: the plan holds faults 3 and 7 only, so a fault's number is no
    # position in it.
    faults = [planned(3, ChaosKind.SIGKILL), planned(7, ChaosKind.SIGSTOP)]
    history = History()
    history.add("inject", 3)
    records = [
        StreamRecord(client=0, prompt=0, started=0.0, ended=5.0),  # after fault 3 only
        StreamRecord(client=1, prompt=1, started=0.0, ended=25.0),  # after both
        StreamRecord(client=2, prompt=2, started=0.0, ended=None),  # never ended: its start
        StreamRecord(client=3, prompt=3, started=0.0, ended=30.0),  # no problem
    ]
    verdicts = [["lost: no reason"], ["wrong_tokens: 9 != 8"], ["lost: none"], []]
    # Injected out of order: a follow-up fault's record can come first.
    injections = [shot(faults[1], 20.0), shot(faults[0], 1.0)]
    found = request_violations(records, verdicts, injections, faults, history)
    assert [(v.invariant, v.fault, v.kind, v.detail) for v in found] == [
        ("lost", 3, "sigkill", "no reason"),
        ("wrong_tokens", 7, "sigstop", "9 != 8"),
        ("lost", None, None, "none"),
    ]


def test_a_faults_problems_become_violations_with_the_history_around_it() -> None:
    history = History()
    history.add("before")
    injected = shot(planned(4, ChaosKind.STEP_RAISE), at=history.entries()[0].at + 0.5)
    history.add("after")
    found = fault_violations(injected, 12, ["stuck_unhealthy: rank 2"], injected.at, history)
    assert [(v.invariant, v.fault, v.kind, v.step, v.detail) for v in found] == [
        ("stuck_unhealthy", 4, "step_raise", 12, "rank 2")
    ]
    assert len(found[0].excerpt) == 2
    assert fault_violations(injected, None, [], injected.at, history) == []


def test_the_rss_ratio_is_the_largest_over_the_ranks_measured_at_both_ends() -> None:
    assert rss_ratio({0: 100, 1: 200, 2: 100}, {0: 110, 1: 300}) == 1.5
    assert rss_ratio({0: 100}, {1: 100}) is None


@attrs.define
class Ran:
    """A campaign's state as either campaign keeps it (``findings.Judged``)."""

    plan: list[PlannedFault]
    found: Findings
    history: History = attrs.field(factory=History)
    interrupted: threading.Event = attrs.field(factory=threading.Event)
    error: str | None = None
    rebuilds: int = 0


def settled(kind: ChaosKind, victim: int, detect_s: float, recover_s: float) -> FaultResult:
    """Fault 0 of ``kind``, steady, on ``victim``, settled."""
    return FaultResult(
        index=0, kind=kind, when=When.STEADY, step=-1, victims=(victim,),
        detect_s=detect_s, recover_s=recover_s, outcome="settled", engines=(),
    )  # fmt: skip


def ran() -> Ran:
    fault = planned(0, ChaosKind.SIGKILL)
    result = settled(ChaosKind.SIGKILL, 1, 0.5, 2.0)
    found = Findings([result], injections=[shot(fault, 1.0)], recoveries_per_deployment=[1])
    return Ran([fault], found)


def test_findings_keep_a_judged_fault_and_a_recovered_deployments_growth() -> None:
    found, history = Findings(), History()
    injected = shot(planned(2, ChaosKind.SIGSTOP), at=time.monotonic())
    result = attrs.evolve(ran().found.results[0], index=2, kind=ChaosKind.SIGSTOP)
    found.judged(result, injected, None, ["no_reason: rank 1"], injected.at + 1.0, history)
    assert found.results == [result]
    assert [(v.invariant, v.fault, v.step) for v in found.violations] == [("no_reason", 2, None)]
    found.deployment_ended({0: 100, 1: 100}, {0: 150}, recoveries=0)  # never recovered
    found.deployment_ended({0: 100, 1: 100}, {0: 150}, recoveries=3)
    assert (found.rss_ratios, found.recoveries_per_deployment) == ([1.5], [3])


def test_the_shared_summary_counts_streams_faults_and_the_runs_violations() -> None:
    campaign = ran()
    campaign.found.rss_ratios.append(1.2)
    campaign.error = "RuntimeError: boom"
    campaign.history.add("hang", why="streams did not end before a rebuild")
    records = [
        StreamRecord(0, 0, 0.0, [[5], [6]], finish_reason="length", ended=2.0),
        StreamRecord(1, 0, 0.0, [[5], [7]], finish_reason="length", ended=3.0),
        StreamRecord(2, 0, 0.0, [[5]]),  # never ended
    ]
    verdicts = [[], ["wrong_tokens: got [5, 7], reference [5, 6]"], ["lost: ended None"]]
    found = summary_fields(campaign, records, verdicts, Leftovers((4321,), ()))
    assert found["faults_injected"] == found["faults_planned"] == 1
    assert found["by_kind"] == {"sigkill": 1} and found["during_recovery"] == 0
    assert (found["requests_completed"], found["wrong_tokens"], found["requests_lost"]) == (
        2,
        1,
        1,
    )
    assert found["hangs"] == 2  # the history's hang and the stream that never ended
    assert (found["orphans"], found["rss_growth_ratio"]) == (1, 1.2)
    assert found["detect_s"] == {"sigkill": {"median": 0.5, "p90": 0.5, "max": 0.5}}
    assert found["outcomes"] == {"settled": 1}
    assert found["requests_answered_share"] == round(2 / 3, 4)  # the wrong one ran to length
    assert found["unanswered_reasons"] == {"ended None": 1}
    assert found["per_kind"]["sigkill"]["requests"] == 2  # ended after the fault at 1.0 s
    assert found["per_kind"]["none"]["requests"] == 1  # the unended one, blamed on its start
    assert sorted((v["invariant"], v["fault"]) for v in found["violations"]) == [
        ("campaign_error", None),
        ("lost", None),  # it started, and so ended as far as blame goes, before the fault
        ("orphans", None),
        ("rss_growth", None),
        ("wrong_tokens", 0),
    ]


def test_without_a_reference_no_stream_is_checked_but_an_unended_one_still_hangs() -> None:
    records = [StreamRecord(0, 0, 0.0, [[9]])]
    found = summary_fields(ran(), records, None, Leftovers((), ()))
    assert (found["requests_completed"], found["requests_lost"], found["wrong_tokens"]) == (
        0,
        0,
        0,
    )
    assert found["hangs"] == 1
    assert found["violations"] == []


def test_the_vllm_campaign_loads_nothing_of_the_cpu_clusters_world() -> None:
    cluster_world = (
        "ftengine.testbed.cluster",
        "ftengine.testbed.control",
        "ftengine.testbed.chaos.actions",
        "ftengine.testbed.chaos.cluster_target",
        "ftengine.testbed.chaos.deployment",
        "fastapi",
        "uvicorn",
    )
    probe = (
        "import json, sys\n"
        "import ftengine.testbed.chaos.run\n"
        "import ftengine.testbed.chaos.vllm_target\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({cluster_world!r}))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=180, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []


def test_per_kind_the_share_of_faults_left_dead_and_why_and_of_requests_answered() -> None:
    kill, raised = planned(0, ChaosKind.SIGKILL), planned(1, ChaosKind.RELOAD_ERROR)
    victim_dead = {"id": 1, "status": "dead", "ft_error": "worker exited"}
    removed_before = {"id": 2, "status": "dead", "ft_error": "killed by an earlier fault"}
    survivor_dead = {"id": 0, "status": "dead", "fault_info": "scale_down failed: reload\nat x"}
    results = [
        FaultResult(
            index=0, kind=ChaosKind.SIGKILL, when=When.STEADY, step=-1, victims=(1,),
            detect_s=0.1, recover_s=0.3, outcome="settled",
            engines=({"id": 0, "status": "healthy"}, victim_dead, removed_before),
        ),
        FaultResult(
            index=1, kind=ChaosKind.RELOAD_ERROR, when=When.RECOVERY, step=-1, victims=(),
            detect_s=None, recover_s=1.0, outcome="dead", engines=(survivor_dead,),
        ),
    ]  # fmt: skip
    records = [
        StreamRecord(0, 0, 0.0, [[5]], finish_reason="length", ended=0.5),  # before any
        StreamRecord(1, 0, 0.0, [[5]], finish_reason="length", ended=2.0),  # after the kill
        StreamRecord(2, 0, 0.0, [[5]], finish_reason="abort", stop_reason="x", ended=3.0),
        StreamRecord(3, 0, 0.0, error="HTTP 503: dead", ended=12.0),  # after the reload error
        StreamRecord(4, 0, 0.0, [[5]], finish_reason="length", error="reset", ended=13.0),
    ]
    shares = by_kind_shares(results, records, [shot(kill, 1.0), shot(raised, 10.0)])
    assert shares == {
        "none": {"faults": 0, "dead": 0, "dead_share": None, "dead_reasons": {},
                 "requests": 1, "answered": 1, "answered_share": 1.0, "minority_ended": 0},
        # settled: the victim and a rank removed before are dead, but the recovery was not
        "sigkill": {"faults": 1, "dead": 0, "dead_share": 0.0, "dead_reasons": {},
                    "requests": 2, "answered": 1, "answered_share": 0.5, "minority_ended": 0},
        "reload_error": {"faults": 1, "dead": 1, "dead_share": 1.0,
                         "dead_reasons": {"scale_down failed: reload": 1},
                         "requests": 2, "answered": 0, "answered_share": 0.0,
                         "minority_ended": 0},
    }  # fmt: skip
    assert answered_share(records) == 0.4
    assert answered_share([]) is None
    # why the three others were not: the abort's reason, the client's error, each once
    assert unanswered_reasons(records) == {"x": 1, "HTTP 503: dead": 1, "reset": 1}
    long = StreamRecord(5, 0, 0.0, finish_reason="abort", stop_reason="y" * 500 + "\nmore")
    assert unanswered_reasons([long, long]) == {"y" * REASON_CHARS: 2}
    assert unanswered_reasons([StreamRecord(6, 0, 0.0, [[5]])]) == {"ended None": 1}


def test_what_a_partitions_minority_ended_or_refused_is_out_of_the_answered_shares() -> None:
    """Issue 30: requests answered >= 95 % of those asked outside the minority side."""
    cut = planned(0, ChaosKind.NET_CUT)
    result = settled(ChaosKind.NET_CUT, 2, 3.1, 5.0)
    why = "engine 2 gave up: network partition: engine 2 reaches live DP ranks [2] of [0, 1, 2]"
    records = [
        StreamRecord(0, 0, 0.0, [[5]], finish_reason="length", ended=2.0),
        StreamRecord(1, 0, 0.0, [[5]], finish_reason="abort", stop_reason=why, ended=3.0),
        StreamRecord(2, 0, 0.0, error=f"HTTP 503: {why}", ended=4.0),  # refused to the end
        StreamRecord(3, 0, 0.0, [[5]], finish_reason="abort", stop_reason="other", ended=5.0),
    ]
    assert [minority_side(r) for r in records] == [False, True, True, False]
    assert answered_share(records) == 0.5  # 1 of the 2 asked outside the minority
    row = by_kind_shares([result], records, [shot(cut, 1.0)])["net_cut"]
    assert (row["requests"], row["answered"], row["minority_ended"]) == (2, 1, 2)
    # an answered request names no partition: never taken out
    assert not minority_side(StreamRecord(4, 0, 0.0, [[5]], finish_reason="length"))


def test_what_a_hosts_deployment_left_of_its_network_is_a_leftover() -> None:
    census = Census(set, grace_s=0.0, poll_s=0.01)
    assert census.leftovers() == Leftovers((), ())
    census.note_network(["ft123abcn1"])  # a namespace its stop did not remove
    left = census.leftovers()
    assert left.count == 1 and left.to_dict()["network"] == ["ft123abcn1"]
    found = summary_fields(ran(), [], None, left)
    assert found["orphans"] == 1 and found["orphan_detail"]["network"] == ["ft123abcn1"]
    assert [v["invariant"] for v in found["violations"]] == ["orphans"]
