"""What a campaign on the CPU cluster runs: the plan's size and seed, the cluster (DP, the
recovery policy, timeouts, EPLB redundancy, network namespaces) and the traffic."""

from __future__ import annotations

import attrs

from ftengine.testbed.chaos.catalogue import ChaosKind

# Every kind this cluster mode can inject (the network cut needs hosts in namespaces; an
# engine core is vLLM's process, which the cluster has none of; a host of several ranks is
# the real-vLLM campaign's: the cluster's namespaces hold one rank each; so is the poison
# request, the cluster's re-inference of which its serving tests cover).
PROCESS_KINDS = tuple(
    k
    for k in ChaosKind
    if k not in (ChaosKind.NET_CUT, ChaosKind.ENGINE_CORE, ChaosKind.HOST, ChaosKind.POISON)
)


@attrs.frozen
class ClusterCampaignOptions:
    """What a campaign runs: ``faults`` faults of ``kinds`` planned from ``seed`` on a
    ``dp_size`` cluster under ``clients`` streams of ``max_tokens`` tokens each."""

    faults: int = 20
    seed: int = 0
    policy: str = "orchestrator"
    dp_size: int = 4
    clients: int = 6
    max_tokens: int = 24
    op_timeout_s: float = 2.0
    recover_deadline_s: float = 60.0
    min_survivors: int = 1
    redundancy: int = 3
    """EPLB slots per logical expert minus one (``num_redundant_experts = redundancy x
    experts``): 3 on DP=4 lets every rank host every expert, so three ranks may go before a
    rebuild."""
    max_reinference: int = 8
    kinds: tuple[ChaosKind, ...] = PROCESS_KINDS
    netns: bool = False
    """Each worker in its own network namespace (``ftengine.testbed.cluster.netns``), which adds
    the network cut to the kinds."""
    rejoin: bool = True
    """After a fault settles with ranks removed, restart them and admit them back
    (``scale_up``), so the cluster keeps its size instead of shrinking to a rebuild."""
    only: tuple[int, ...] | None = None
    """Run only these fault numbers of the ``faults``-fault plan (``--only``), each as it is
    planned there: replays a reported fault without the ones before it."""

    @property
    def planned_kinds(self) -> tuple[ChaosKind, ...]:
        """``kinds``, plus ``net_cut`` in namespace mode."""
        if self.netns and ChaosKind.NET_CUT not in self.kinds:
            return (*self.kinds, ChaosKind.NET_CUT)
        return self.kinds
