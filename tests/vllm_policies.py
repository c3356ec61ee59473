"""Policies the real-vLLM tests name by import path (``"policy": "tests.vllm_policies:..."``,
with the repository root on the servers' ``PYTHONPATH``)."""

from __future__ import annotations

from ftengine.policies import AutoRecovery
from ftengine.policies.registry import LOCAL_FAULT_KINDS


def auto_without_admission() -> AutoRecovery:
    """``"auto"`` as deployed (local faults retried, dead peers scaled down with no
    command) that leaves every admission to a ``scale_up`` command: the operator's path."""
    return AutoRecovery(retry_kinds=LOCAL_FAULT_KINDS, admit_ready=False)
