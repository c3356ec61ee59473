"""The recovery policy each cluster worker runs, built from ``ClusterConfig.policy``."""

from __future__ import annotations

from ftengine.policies import Deployment, Policy, by_name


def build_policy(name: str, recovery_timeout_s: float) -> Policy:
    """The registry's policy ``name`` as a deployed worker runs it: the supervisor confirms
    which peer died and an orchestrator may command for ``recovery_timeout_s`` (see
    :class:`~ftengine.policies.Deployment` for why "auto" waits on rank-less peer faults).
    """
    return by_name(name, deployment=Deployment(recovery_timeout=recovery_timeout_s))
