"""Recovery policies: decide what to do about a fault; never act.

A policy is any callable ``RecoveryContext -> Decision | None``. Compose with ``|``
(first opinion wins) and ``&`` (every policy is asked; the most escalated decision wins).
"""

from ftengine.policies.algebra import (
    AllOf,
    Composable,
    FirstOf,
    FromCallable,
    NotAPolicyError,
    Policy,
    as_policy,
    decide,
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
    WaitForOrchestrator,
    describe,
    escalation,
    merge,
    strictest,
)
from ftengine.policies.registry import POLICIES, Deployment, by_name

__all__ = [
    "POLICIES",
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
    "WaitForOrchestrator",
    "as_policy",
    "by_name",
    "decide",
    "describe",
    "escalation",
    "merge",
    "strictest",
]
