"""Both worlds a chaos campaign runs in are :class:`Target`\\ s with every member the loop
uses, and each plans only the kinds it can inject."""

from __future__ import annotations

from pathlib import Path

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
