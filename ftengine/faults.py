"""Shared vocabulary: health values (vLLM's), recovery phases, fault kinds and the Fault record."""

from __future__ import annotations

import enum

import attrs


class HealthStatus(enum.IntEnum):
    """Engine health as vLLM reports it (same integer values)."""

    HEALTHY = 0
    DEAD = 1
    UNHEALTHY = 2


class Phase(str, enum.Enum):
    """The recovery FSM's states."""

    RUNNING = "running"
    QUARANTINED = "quarantined"
    RETRYING = "retrying"
    SCALING_DOWN = "scaling_down"
    HEALTHY = "healthy"
    DEAD = "dead"
    # Admitting a removed rank back (``scale_up``): the survivors' phase while they rebuild
    # their groups with it, and the returning rank's own phases from its start to healthy.
    SCALING_UP = "scaling_up"
    LOADING = "loading"
    READY = "ready"
    JOINING = "joining"

    @property
    def health(self) -> HealthStatus:
        """The vLLM health value an engine in this phase reports."""
        return _PHASE_HEALTH[self]

    @property
    def serving(self) -> bool:
        """Running or healthy: the worker may run real steps (vLLM reports it HEALTHY)."""
        return self in _SERVING

    @property
    def member(self) -> bool:
        """A healthy member of the deployment: serving, or admitting a rank (``scaling_up``,
        still HEALTHY to vLLM). A fault in one of these phases opens a fault episode."""
        return self.health is HealthStatus.HEALTHY

    @property
    def rejoining(self) -> bool:
        """A returning rank not yet admitted: loading, ready or joining (not a member)."""
        return self in _REJOINING

    @property
    def recovering(self) -> bool:
        """Retrying or scaling down: a recovery run owns the worker."""
        return self in _RECOVERING


_PHASE_HEALTH = {
    Phase.RUNNING: HealthStatus.HEALTHY,
    Phase.HEALTHY: HealthStatus.HEALTHY,
    Phase.QUARANTINED: HealthStatus.UNHEALTHY,
    Phase.RETRYING: HealthStatus.UNHEALTHY,
    Phase.SCALING_DOWN: HealthStatus.UNHEALTHY,
    Phase.DEAD: HealthStatus.DEAD,
    Phase.SCALING_UP: HealthStatus.HEALTHY,
    Phase.LOADING: HealthStatus.UNHEALTHY,
    Phase.READY: HealthStatus.UNHEALTHY,
    Phase.JOINING: HealthStatus.UNHEALTHY,
}
_SERVING = frozenset({Phase.RUNNING, Phase.HEALTHY})
_RECOVERING = frozenset({Phase.RETRYING, Phase.SCALING_DOWN})
_REJOINING = frozenset({Phase.LOADING, Phase.READY, Phase.JOINING})


class FaultKind(str, enum.Enum):
    """What kind of fault was detected; policies decide on this."""

    TRANSIENT = "transient"  # an error that a retry may clear (injected raise, flaky link)
    DEAD_PEER = "dead_peer"  # a peer's socket closed / its process exited
    HUNG_PEER = "hung_peer"  # a collective timed out: a peer stopped answering
    DEVICE_ERROR = "device_error"  # the local device reported an error (poisoned stream)
    SELF_DEAD = "self_dead"  # this worker's own process is gone (reported by a supervisor)
    RECOVERY_ERROR = "recovery_error"  # an action failed while recovering


@attrs.frozen
class Fault:
    """One detected fault.

    ``rank`` is the (original) DP rank the fault points at, when known; ``step`` the
    model step it happened in; ``info`` the exception type name or a short text
    (vLLM's ``fault_info``); ``at`` the monotonic time of detection in seconds.
    """

    kind: FaultKind
    rank: int | None = None
    step: int | None = None
    info: str = ""
    at: float = 0.0


def fault_text(fault: Fault) -> str:
    """``"dead_peer fault on rank 3 (PeerDead)"``, for logs, reasons and policy verdicts."""
    rank = "" if fault.rank is None else f" on rank {fault.rank}"
    info = f" ({fault.info})" if fault.info else ""
    return f"{fault.kind.value} fault{rank}{info}"
