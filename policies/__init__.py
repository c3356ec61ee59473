"""Recovery policies: decide what to do about a fault; never act.

A policy is any callable ``RecoveryContext -> Decision | None``. Compose with ``|``
(first opinion wins) and ``&`` (every policy is asked; the most escalated decision wins).
"""

# This folder is the source of ``ftengine.policies`` (pyproject's package-dir; a symlink
# ftengine/policies points here for tools run from the repository root). Imported under any
# other name, the same files would load a second time as unrelated modules.
if __name__ != "ftengine.policies":
    raise ImportError(
        f"{__name__!r} is the source folder of ftengine.policies; import ftengine.policies instead"
    )


from ftengine.policies.algebra import (
    Admitter,
    AllOf,
    Composable,
    FirstOf,
    FromCallable,
    NotAPolicyError,
    Policy,
    as_policy,
    decide,
    decide_admission,
)
from ftengine.policies.builtin import (
    AutoRecovery,
    ExponentialBackoff,
    FlapGuard,
    MaxAttempts,
    OrchestratorDriven,
    RecoveryDeadline,
)
from ftengine.policies.decisions import (
    Decision,
    GiveUp,
    Retry,
    ScaleDown,
    ScaleUp,
    WaitForOrchestrator,
    describe,
    escalation,
    merge,
    strictest,
)
from ftengine.policies.registry import POLICIES, Deployment, by_name

__all__ = [
    "POLICIES",
    "Admitter",
    "AllOf",
    "AutoRecovery",
    "Composable",
    "Decision",
    "Deployment",
    "ExponentialBackoff",
    "FirstOf",
    "FlapGuard",
    "FromCallable",
    "GiveUp",
    "MaxAttempts",
    "NotAPolicyError",
    "OrchestratorDriven",
    "Policy",
    "RecoveryDeadline",
    "Retry",
    "ScaleDown",
    "ScaleUp",
    "WaitForOrchestrator",
    "as_policy",
    "by_name",
    "decide",
    "decide_admission",
    "describe",
    "escalation",
    "merge",
    "strictest",
]
