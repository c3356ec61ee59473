"""The CPU reference cluster: real DP+EP MoE worker processes over gloo.

``Cluster.launch(ClusterConfig(checkpoint, dp_size=4))`` starts a supervisor (in the
caller's process) and ``dp_size`` workers; ``status()``, ``apply()``, ``generate()``,
``kill()`` and ``shutdown()`` drive it; ``reference_generate`` is the single-process,
fault-free run its outputs must match (``compare_outputs``).
"""

from ftengine.testbed.cluster.config import ClusterConfig
from ftengine.testbed.cluster.faults_inject import ENV_VAR as INJECT_ENV_VAR
from ftengine.testbed.cluster.faults_inject import FaultSpec, InjectKind
from ftengine.testbed.cluster.generation import Generation, RequestAborted
from ftengine.testbed.cluster.handles import ClusterEvent
from ftengine.testbed.cluster.reference import (
    LOGITS_ATOL,
    OutputsCheck,
    compare_outputs,
    reference_generate,
)
from ftengine.testbed.cluster.roster import ClusterError
from ftengine.testbed.cluster.supervisor import Cluster

__all__ = [
    "INJECT_ENV_VAR",
    "LOGITS_ATOL",
    "Cluster",
    "ClusterConfig",
    "ClusterError",
    "ClusterEvent",
    "FaultSpec",
    "Generation",
    "InjectKind",
    "OutputsCheck",
    "RequestAborted",
    "compare_outputs",
    "reference_generate",
]
