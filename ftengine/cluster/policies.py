"""The recovery policy each cluster worker runs, built from ``ClusterConfig.policy``."""

from __future__ import annotations

from ftengine.errors import ConfigError
from ftengine.faults import FaultKind
from ftengine.policies import AutoRecovery, OrchestratorDriven, Policy
from ftengine.policies.import_path import is_import_path, policy_from_import_path


def build_policy(name: str, recovery_timeout_s: float) -> Policy:
    """``"orchestrator"``: wait up to ``recovery_timeout_s`` for a command (vLLM's default).

    ``"auto"``: retry transient faults and scale down peers the supervisor confirmed
    dead. A collective error only says *some* peer closed or stopped answering, so those
    (``DEAD_PEER`` / ``HUNG_PEER`` without a rank) wait for the supervisor's verdict — a
    dead rank, or "transient, everyone is alive" — or a command, up to
    ``recovery_timeout_s``; retrying at once would rebuild a group with a dead member.
    """
    if is_import_path(name):  # "package.module:factory": the user's policy, else wait
        return policy_from_import_path(name) | OrchestratorDriven(recovery_timeout_s)
    if name == "orchestrator":
        return OrchestratorDriven(recovery_timeout=recovery_timeout_s)
    if name == "auto":
        auto = AutoRecovery(retry_kinds=frozenset({FaultKind.TRANSIENT, FaultKind.DEVICE_ERROR}))
        return auto | OrchestratorDriven(recovery_timeout=recovery_timeout_s)
    raise ConfigError(f"unknown cluster policy {name!r}: expected 'orchestrator' or 'auto'")
