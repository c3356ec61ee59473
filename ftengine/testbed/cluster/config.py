"""ClusterConfig: what it takes to launch the CPU reference cluster (sizes, timeouts, policy,
fault tolerance on or off, and the command adapter its workers answer commands through)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import attrs

from ftengine.errors import ConfigError
from ftengine.policies.registry import PolicyName, check_name
from ftengine.reinference import DEFAULT_MAX_REINFERENCE, Reinference
from ftengine.testbed.cluster.faults_inject import FaultSpec

# torch.distributed's default process-group timeout (30 min): what a gloo collective waits
# for a peer in a cluster without ftengine.
TORCH_DEFAULT_TIMEOUT_S = 1800.0

WORKER_STARTS = ("spawn", "forkserver")
"""How the supervisor may start workers (``ftengine.testbed.cluster.starts``); never ``fork``, which
would copy the supervisor's threads and locks into each worker."""


def _policy_name(_instance: object, _attribute: object, value: object) -> None:
    """A registered policy name or a factory's import path (imported and checked now)."""
    check_name(value)


def _to_path(value: str | Path) -> Path:
    return Path(value)


def _to_fault(value: FaultSpec | str | None) -> FaultSpec | None:
    if value is None or isinstance(value, FaultSpec):
        return value
    return FaultSpec.parse(value) if value.strip() else None


def _to_names(value: Iterable[str] | None) -> tuple[str, ...] | None:
    return None if value is None else tuple(value)


def _adapter_spec(
    instance: object, attribute: attrs.Attribute[str | None], value: str | None
) -> None:
    if value is None:
        return
    module, _, function = value.partition(":")
    if not module.strip() or not function.strip() or ":" in function:
        raise ConfigError(
            f"ClusterConfig.command_adapter must be 'package.module:function', found {value!r}"
        )


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

    ``command_adapter`` (``"package.module:function"``) names a factory each worker calls
    once as ``factory(sentinel, rank)``; every orchestrator command then goes through the
    returned object's ``run_command(instruction, params, request_id)`` (see
    :mod:`ftengine.testbed.cluster.adapters`). ``fault_tolerance=False`` runs the cluster as one
    without ftengine would run (see :attr:`fault_tolerance`).
    """

    checkpoint: Path = attrs.field(converter=_to_path)
    dp_size: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    policy: PolicyName | str = attrs.field(default="orchestrator", validator=_policy_name)
    op_timeout_s: float = attrs.field(default=5.0, validator=_positive)
    heartbeat_s: float = attrs.field(default=0.25, validator=_positive)
    heartbeat_misses: int = attrs.field(default=8, validator=attrs.validators.ge(2))
    recovery_timeout_s: float = attrs.field(default=120.0, validator=_positive)
    num_redundant_experts: int | None = None
    inject_fault: FaultSpec | None = attrs.field(default=None, converter=_to_fault)
    start_timeout_s: float = attrs.field(default=120.0, validator=_positive)
    host: str = "127.0.0.1"
    torch_threads: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    command_adapter: str | None = attrs.field(default=None, validator=_adapter_spec)
    worker_netns: tuple[str, ...] | None = attrs.field(default=None, converter=_to_names)
    """One network namespace per rank (``ftengine.testbed.cluster.netns.Hosts.namespaces``): each
    worker enters its own at start and heartbeats over the network; ``host`` is then the
    supervisor's address on the bridge. None: every worker in the supervisor's namespace."""
    worker_start: str = attrs.field(default="spawn", validator=attrs.validators.in_(WORKER_STARTS))
    """How workers start (``ftengine.testbed.cluster.starts``): ``spawn``, a fresh interpreter each;
    ``forkserver``, forked from a server process that imported torch and ftengine once, so a
    relaunch costs no imports (the chaos campaign's rebuilds)."""
    fault_tolerance: bool = True
    """False: the baseline a cluster without ftengine is. Gloo ops and group set-up use
    torch's default timeout (30 min, ``op_timeout_s`` is ignored); no heartbeats; the
    supervisor records a worker's exit but tells nobody and fences nobody; steps are not
    watched for hung ranks nor announced as transient faults; workers neither poll their
    engine nor report faults to it and publish no status after steps; a step error kills
    the worker (as an exception kills vLLM's engine core) and ``apply`` refuses every
    command. The same in both modes: the model, the MC2-style dispatch (its elastic_info
    lookup is skipped while no rank is masked, being the identity then), the per-step DP
    sync all-reduce and its lockstep check, and fault injection."""
    rejoin_grown: Literal["drop", "keep"] = attrs.field(
        default="drop", validator=attrs.validators.in_(("drop", "keep"))
    )
    """What survivors do with the expert copies they grew for a rank that rejoins (scale_up):
    ``drop`` (the original layout comes back) or ``keep`` (standby replicas for the next
    fault). Either way no survivor reloads anything."""
    reinference: bool = True
    """Token-level re-inference (``ftengine.reinference``): a fault holds the serving loop's
    in-flight requests and resumes them after recovery instead of aborting them. Off (or
    with fault tolerance off): a fault aborts every in-flight request, as before."""
    max_reinference: int = attrs.field(
        default=DEFAULT_MAX_REINFERENCE, validator=attrs.validators.ge(0)
    )
    """How many times one request may be re-run after faults before it is aborted."""

    @property
    def reinference_bounds(self) -> Reinference | None:
        """The bounds held requests live under, or None when re-inference is off (held
        requests never wait past ``recovery_timeout_s``, the engines' own deadline)."""
        if not (self.reinference and self.fault_tolerance):
            return None
        return Reinference(self.max_reinference, self.recovery_timeout_s)

    @property
    def worker_op_timeout_s(self) -> float:
        """The per-op gloo timeout the workers use (torch's default with fault tolerance off)."""
        return self.op_timeout_s if self.fault_tolerance else TORCH_DEFAULT_TIMEOUT_S

    @property
    def heartbeat_timeout_s(self) -> float:
        """Seconds without a heartbeat after which a live worker is declared hung."""
        return self.heartbeat_s * self.heartbeat_misses

    @property
    def rendezvous_timeout_s(self) -> float:
        """Seconds a group rebuild waits for its peers (a peer may still be stuck in an op)."""
        if not self.fault_tolerance:
            return TORCH_DEFAULT_TIMEOUT_S
        return max(10.0, 3.0 * self.op_timeout_s)

    @property
    def command_timeout_s(self) -> float:
        """Seconds the supervisor waits for every worker's answer to one command."""
        return 2.0 * self.rendezvous_timeout_s + 8.0 * self.op_timeout_s + 30.0
