"""Both worlds a chaos campaign runs in are :class:`Target`\\ s with every member the loop
uses, and each plans only the kinds it can inject."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import attrs
import pytest

from ftengine.integrations.vllm.engine_core.quorum import HEALS
from ftengine.testbed.chaos.catalogue import ChaosKind
from ftengine.testbed.chaos.cluster_options import PROCESS_KINDS, ClusterCampaignOptions
from ftengine.testbed.chaos.cluster_target import ClusterTarget
from ftengine.testbed.chaos.target import Target
from ftengine.testbed.chaos.vllm_options import VllmCampaignOptions
from ftengine.testbed.chaos.vllm_plan import VLLM_KINDS
from ftengine.testbed.chaos.vllm_target import VllmTarget
from ftengine.weights.checkpoint_gen import make_checkpoint


def _quiet(line: str) -> None:
    return None


def test_the_cluster_and_vllm_are_targets_planning_only_what_they_inject(tmp_path: Path) -> None:
    checkpoint = make_checkpoint(tmp_path / "ckpt", layers=1, experts=4, hidden=16, intermediate=8)
    cluster = ClusterTarget(ClusterCampaignOptions(faults=30, seed=5), checkpoint, _quiet)
    netns = ClusterTarget(ClusterCampaignOptions(faults=30, seed=5, netns=True), checkpoint, _quiet)
    vllm = VllmTarget(VllmCampaignOptions(tmp_path / "hf", faults=30, seed=5), _quiet)
    try:
        for target in (cluster, netns, vllm):
            assert isinstance(target, Target), type(target)
        assert {f.kind for f in cluster.plan()} == set(PROCESS_KINDS)
        assert {f.kind for f in netns.plan()} == {*PROCESS_KINDS, ChaosKind.NET_CUT}
        assert {f.kind for f in vllm.plan()} == set(VLLM_KINDS)
        assert len(vllm.bench.fleet.traffic) == 3 and len(cluster.bench.fleet.traffic) == 1
    finally:
        for target in (cluster, netns, vllm):
            target.close()


def test_a_class_missing_a_member_is_no_target(tmp_path: Path) -> None:
    vllm = VllmTarget(VllmCampaignOptions(tmp_path / "hf"), _quiet)
    try:
        assert isinstance(vllm, Target)
        del vllm.bench  # an instance attribute the loop reads
        assert not isinstance(vllm, Target)
    finally:
        vllm.close()


class Deployment:
    """What the vLLM target's heal uses of ``VllmDeployment``: restart, admit, pids."""

    def __init__(self, watch: Watch) -> None:
        self.watch = watch
        self.urls = [f"http://127.0.0.1:{9000 + r}" for r in range(3)]
        self.ranks = [SimpleNamespace(process=SimpleNamespace(pid=os.getpid())) for _ in range(3)]
        self.calls: list[object] = []

    def restart(self, rank: int) -> None:
        self.calls.append(("restart", rank))
        self.watch.engines[rank] = {"id": rank, "status": "unhealthy", "phase": "ready"}

    def admit(
        self, added: list[int], survivors: list[int], timeout_s: float
    ) -> dict[int, dict[str, Any]]:
        assert timeout_s > 0
        self.calls.append(("admit", added, survivors))
        for rank in (*added, *survivors):
            self.watch.engines[rank] = {"status": "healthy", "phase": "healthy",
                                        "removed_ranks": []}  # fmt: skip
        return {r: dict(self.watch.engines[r]) for r in (*survivors, *added)}

    def pids(self) -> dict[int, dict[str, int]]:
        return {r: {"api_server": 10 + r, "worker": 20 + r} for r in range(3)}


class Watch:
    def __init__(self, engines: dict[int, dict[str, Any]]) -> None:
        self.engines = engines

    def poll(self) -> dict[int, dict[str, Any]]:
        return {r: dict(e) for r, e in self.engines.items()}


def test_the_vllm_target_heals_a_removed_rank_by_restart_and_scale_up(tmp_path: Path) -> None:
    vllm = VllmTarget(VllmCampaignOptions(tmp_path / "hf"), _quiet)
    shrunk = {"status": "healthy", "phase": "healthy", "removed_ranks": [2]}
    watch = Watch({0: dict(shrunk), 1: dict(shrunk), 2: {"status": "dead"}})
    deployment = Deployment(watch)
    workers = {0: 1, 1: 2, 2: 3}
    running: Any = SimpleNamespace(deployment=deployment, watch=watch, workers=workers)
    vllm.running = running
    paused: list[object] = []
    real_restart = deployment.restart

    def restart(rank: int) -> None:  # the survivors' clients wait while it starts
        paused.append([vllm.bench.fleet.traffic[r].streaming_to for r in range(3)])
        real_restart(rank)

    deployment.restart = restart  # type: ignore[method-assign]
    try:
        assert vllm.heal(4) == [2]
        assert deployment.calls == [("restart", 2), ("admit", [2], [0, 1])]
        assert paused == [[None, None, None]]
        assert [t.streaming_to for t in vllm.bench.fleet.traffic] == deployment.urls
        assert workers[2] == 22  # the new worker: the next kill's target
        kinds = [entry.what for entry in vllm.bench.history.entries()]
        assert kinds[-2:] == ["restart", "scale_up"]
        assert vllm.heal(5) == []  # nothing removed any more
        off = VllmTarget(VllmCampaignOptions(tmp_path / "hf", rejoin=False), _quiet)
        assert off.heal(4) == []
        off.close()
    finally:
        vllm.running = None
        vllm.close()


def test_rank_0_relaunches_in_place_and_is_admitted_a_rank_never_ready_raises(
    tmp_path: Path,
) -> None:
    vllm = VllmTarget(VllmCampaignOptions(tmp_path / "hf", rejoin_deadline_s=5.0), _quiet)
    shrunk = {"status": "healthy", "phase": "healthy", "removed_ranks": [0]}
    loading = {"status": "dead", "phase": "loading"}  # its engine core relaunches its worker
    watch = Watch({0: dict(loading), 1: dict(shrunk), 2: dict(shrunk)})
    deployment = Deployment(watch)
    workers: dict[int, int] = {}
    running: Any = SimpleNamespace(deployment=deployment, watch=watch, workers=workers)
    vllm.running = running
    threading.Timer(0.6, lambda: watch.engines[0].update(status="unhealthy", phase="ready")).start()
    try:
        assert vllm.heal(1) == [0]  # waited for its relaunch, never restarted
        assert deployment.calls == [("admit", [0], [1, 2])] and workers[0] == 20
        kinds = [entry.what for entry in vllm.bench.history.entries()]
        assert kinds[-2:] == ["relaunch", "scale_up"]
        watch.engines[1]["removed_ranks"] = watch.engines[0]["removed_ranks"] = [2]
        watch.engines[2] = {"status": "dead"}
        deployment.restart = lambda rank: None  # type: ignore[method-assign]  # never ready
        vllm.options = attrs.evolve(vllm.options, rejoin_deadline_s=0.0)
        with pytest.raises(RuntimeError, match=r"ranks \[2\] not ready in time"):
            vllm.heal(2)
    finally:
        vllm.running = None
        vllm.close()


def test_a_cut_off_minority_parked_for_the_link_comes_back_in_place_a_late_one_restarts(
    tmp_path: Path,
) -> None:
    """After a ``net_cut``: rank 2 parked DEAD for the link (``quorum.HEALS``) relaunches
    its own worker once the link is back: waited for, never restarted. A minority that
    learnt of the cut after its fault (no such words) exits at vLLM's deadline: restarted."""
    vllm = VllmTarget(VllmCampaignOptions(tmp_path / "hf", rejoin_deadline_s=5.0), _quiet)
    shrunk = {"status": "healthy", "phase": "healthy", "removed_ranks": [2]}
    why = f"policy gave up: network partition: engine 2 reaches ...; {HEALS}"
    watch = Watch({0: dict(shrunk), 1: dict(shrunk), 2: {"status": "dead", "fault_info": why}})
    deployment = Deployment(watch)
    running: Any = SimpleNamespace(deployment=deployment, watch=watch, workers={})
    vllm.running = running
    threading.Timer(0.6, lambda: watch.engines[2].update(status="unhealthy", phase="ready")).start()
    try:
        assert vllm.heal(3) == [2]
        assert deployment.calls == [("admit", [2], [0, 1])]  # no restart
        kinds = [entry.what for entry in vllm.bench.history.entries()]
        assert kinds[-2:] == ["relaunch", "scale_up"]
        watch.engines[0]["removed_ranks"] = watch.engines[1]["removed_ranks"] = [2]
        watch.engines[2] = {"status": "dead", "fault_info": "policy gave up: network partition"}
        assert vllm.heal(4) == [2]
        assert deployment.calls[-2:] == [("restart", 2), ("admit", [2], [0, 1])]
    finally:
        vllm.running = None
        vllm.close()
