"""What both campaigns find with the same code (``chaos/findings.py``): a stream's problem
blamed on the fault injected last before it ended, a fault's problems as violations with
their history, the survivors' memory growth; and the real-vLLM campaign loads nothing of
the CPU cluster's world."""

from __future__ import annotations

import json
import subprocess
import sys

from ftengine.testbed.chaos.catalogue import ChaosKind, Injected, PlannedFault, When
from ftengine.testbed.chaos.findings import fault_violations, request_violations, rss_ratio
from ftengine.testbed.chaos.history import History
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


def test_the_vllm_campaign_loads_nothing_of_the_cpu_clusters_world() -> None:
    cluster_world = (
        "ftengine.testbed.cluster",
        "ftengine.testbed.control",
        "ftengine.testbed.chaos.campaign",
        "ftengine.testbed.chaos.deployment",
        "ftengine.testbed.chaos.report",
        "fastapi",
        "uvicorn",
    )
    probe = (
        "import json, sys\n"
        "import ftengine.testbed.chaos.vllm_report\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({cluster_world!r}))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=180, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []
