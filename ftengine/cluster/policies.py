"""The recovery policy each cluster worker runs, built from ``ClusterConfig.policy``."""

from __future__ import annotations

from ftengine.errors import ConfigError
from ftengine.policies import AutoRecovery, OrchestratorDriven, Policy


def build_policy(name: str, recovery_timeout_s: float) -> Policy:
    """``"orchestrator"``: wait up to ``recovery_timeout_s`` for a command (vLLM's default).

    ``"auto"``: retry transient faults and scale down peers the supervisor confirmed
    dead; whatever AutoRecovery abstains on (a peer fault not yet attributed to a rank)
    waits for that confirmation or a command, up to ``recovery_timeout_s``.
    """
    if name == "orchestrator":
        return OrchestratorDriven(recovery_timeout=recovery_timeout_s)
    if name == "auto":
        return AutoRecovery() | OrchestratorDriven(recovery_timeout=recovery_timeout_s)
    raise ConfigError(f"unknown cluster policy {name!r}: expected 'orchestrator' or 'auto'")
