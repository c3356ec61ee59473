"""ClusterConfig: what it takes to launch the CPU reference cluster (sizes, timeouts, policy)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import attrs

from ftengine.cluster.faults_inject import FaultSpec
from ftengine.errors import ConfigError

PolicyName = Literal["orchestrator", "auto"]


def _to_path(value: str | Path) -> Path:
    return Path(value)


def _to_fault(value: FaultSpec | str | None) -> FaultSpec | None:
    if value is None or isinstance(value, FaultSpec):
        return value
    return FaultSpec.parse(value) if value.strip() else None


def _positive(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if value <= 0:
        raise ConfigError(f"ClusterConfig.{attribute.name} must be > 0 seconds, found {value!r}")


@attrs.frozen
class ClusterConfig:
    """How to launch a CPU cluster of ``dp_size`` workers (DP = EP = ``dp_size``, TP = 1).

    Durations are float seconds. ``op_timeout_s`` bounds every gloo collective (a hung
    peer surfaces after it); a worker that misses heartbeats for
    ``heartbeat_s * heartbeat_misses`` seconds is declared hung and fenced.
    ``num_redundant_experts`` EPLB slots are added to the checkpoint's logical experts
    (None: as many as there are logical experts, so half the ranks may die).
    ``inject_fault`` (a :class:`FaultSpec` or its text) overrides
    ``FTENGINE_INJECT_FAULT`` for the workers.
    """

    checkpoint: Path = attrs.field(converter=_to_path)
    dp_size: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    policy: PolicyName = attrs.field(
        default="orchestrator", validator=attrs.validators.in_(("orchestrator", "auto"))
    )
    op_timeout_s: float = attrs.field(default=5.0, validator=_positive)
    heartbeat_s: float = attrs.field(default=0.25, validator=_positive)
    heartbeat_misses: int = attrs.field(default=8, validator=attrs.validators.ge(2))
    recovery_timeout_s: float = attrs.field(default=120.0, validator=_positive)
    num_redundant_experts: int | None = None
    inject_fault: FaultSpec | None = attrs.field(default=None, converter=_to_fault)
    start_timeout_s: float = attrs.field(default=120.0, validator=_positive)
    host: str = "127.0.0.1"
    torch_threads: int = attrs.field(default=1, validator=attrs.validators.ge(1))

    @property
    def heartbeat_timeout_s(self) -> float:
        """Seconds without a heartbeat after which a live worker is declared hung."""
        return self.heartbeat_s * self.heartbeat_misses

    @property
    def rendezvous_timeout_s(self) -> float:
        """Seconds a group rebuild waits for its peers (a peer may still be stuck in an op)."""
        return max(10.0, 3.0 * self.op_timeout_s)

    @property
    def command_timeout_s(self) -> float:
        """Seconds the supervisor waits for every worker's answer to one command."""
        return 2.0 * self.rendezvous_timeout_s + 8.0 * self.op_timeout_s + 30.0
