"""vLLM's fault-tolerance flags mapped to ftengine's settings for one worker.

- ``--enable-fault-tolerance``: ftengine runs only when it is on.
- ``--fault-tolerance-config '{"engine_recovery_timeout_sec": N}'``: how long a faulted
  worker waits for a command before it is DEAD (``ftengine.recovery_timeout_sec``, if
  given, must say the same: vLLM's engine core waits N whatever ftengine does).
- ``--cpu-distributed-timeout-seconds S``: timeout of the gloo DP groups
  (``ftengine.cpu_distributed_timeout_sec`` wins).
- ``--additional-config '{"ft_communication_abort_timeout": T, "ftengine": {...}}'``: the NPU
  op timeout and ftengine's own options, parsed by ``ftengine.backends.npu_config``
  (``"reinference": true`` and ``"max_reinference": N`` hold in-flight requests through a
  fault, see ``ftengine.integrations.vllm.engine_core.reinference``;
  ``"placement": "failure-aware"`` loads standby expert copies so that a one-rank
  scale-down reloads nothing, see ``ftengine.integrations.vllm.worker.experts_standby``;
  ``"handoff_urls": [...]`` hands a DEAD engine core's held requests to those survivors,
  see ``...vllm.engine_core.handoff``).

Invalid values raise :class:`VllmConfigError` at start-up, naming the flag and the key.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from ftengine.backends.npu_config import FTENGINE_KEY, NpuFtConfig, ftengine_options
from ftengine.errors import ConfigError
from ftengine.integrations.vllm.shapes import VllmConfigLike
from ftengine.policies import Deployment, Policy, by_name

FT_CONFIG_FLAG = "--fault-tolerance-config"
CPU_TIMEOUT_FLAG = "--cpu-distributed-timeout-seconds"
ADDITIONAL_FLAG = "--additional-config"
RECOVERY_KEY = "engine_recovery_timeout_sec"


class VllmConfigError(ConfigError):
    """A vLLM flag carries a value ftengine cannot run with; names the flag and the key."""


def _seconds(value: object, flag: str, key: str, *, optional: bool) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise VllmConfigError(
            f"Invalid {flag}: {key} must be a positive number of seconds, found {value!r}"
        )
    return float(value)


def _additional(vllm_config: VllmConfigLike) -> tuple[Mapping[str, object], Mapping[str, object]]:
    """``(additional_config, its "ftengine" sub-dict)``, both checked to be JSON objects."""
    raw = vllm_config.additional_config
    additional: Mapping[str, object] = {} if raw is None else raw  # type: ignore[assignment]
    if not isinstance(additional, Mapping):
        raise VllmConfigError(
            f"Invalid {ADDITIONAL_FLAG}: expected a JSON object such as "
            f'\'{{"{FTENGINE_KEY}": {{"policy": "auto"}}}}\', found {type(raw).__name__}'
        )
    try:
        return additional, ftengine_options(additional)
    except ConfigError as exc:
        raise VllmConfigError(f"Invalid {ADDITIONAL_FLAG}: {exc}") from exc


@attrs.frozen
class VllmFtSettings:
    """ftengine's settings for one vLLM worker.

    ``enabled``: ``--enable-fault-tolerance``. ``npu``: the NPU backend's options with the
    recovery and CPU-group timeouts resolved (seconds; ``cpu_distributed_timeout_s`` None =
    torch's default). ``policy``: a registered policy name ("orchestrator" or "auto").
    """

    enabled: bool
    npu: NpuFtConfig

    @property
    def policy(self) -> str:
        return self.npu.policy

    @property
    def recovery_timeout_s(self) -> float:
        return self.npu.recovery_timeout_s

    @property
    def cpu_distributed_timeout_s(self) -> float | None:
        return self.npu.cpu_distributed_timeout_s

    @property
    def reinference(self) -> bool:
        """``ftengine.reinference``: faults hold requests (``engine_core.reinference``)."""
        return self.npu.reinference

    @property
    def max_reinference(self) -> int:
        return self.npu.max_reinference

    @property
    def placement(self) -> str:
        """``ftengine.placement``: "failure-aware" loads standby copies (``experts_standby``)."""
        return self.npu.placement

    @property
    def handoff_urls(self) -> tuple[str, ...]:
        """``ftengine.handoff_urls``: survivors a DEAD engine core resumes its requests on
        (``integrations.vllm.engine_core.handoff``)."""
        return self.npu.handoff_urls

    @classmethod
    def from_vllm_config(cls, vllm_config: VllmConfigLike) -> VllmFtSettings:
        """Read and check the flags above; raise ``VllmConfigError`` naming the bad one."""
        parallel = vllm_config.parallel_config
        ft_config = parallel.fault_tolerance_config
        recovery = _seconds(
            ft_config.engine_recovery_timeout_sec, FT_CONFIG_FLAG, RECOVERY_KEY, optional=False
        )
        cpu_timeout = _seconds(
            parallel.cpu_distributed_timeout_seconds,
            CPU_TIMEOUT_FLAG,
            "the value",
            optional=True,
        )
        additional, sub = _additional(vllm_config)
        try:
            npu = NpuFtConfig.from_additional_config(additional)
        except ConfigError as exc:
            raise VllmConfigError(f"Invalid {ADDITIONAL_FLAG}: {exc}") from exc
        # vLLM's engine core waits engine_recovery_timeout_sec for a command whatever
        # ftengine does, so ftengine's key may only repeat it: two clocks must not disagree.
        if "recovery_timeout_sec" in sub and npu.recovery_timeout_s != recovery:
            raise VllmConfigError(
                f"Invalid {ADDITIONAL_FLAG}: {FTENGINE_KEY}.recovery_timeout_sec "
                f"({npu.recovery_timeout_s:g}) must equal {FT_CONFIG_FLAG}'s {RECOVERY_KEY} "
                f"({recovery:g}), which vLLM's engine core waits for; set only {RECOVERY_KEY}"
            )
        if recovery is not None:
            npu = attrs.evolve(npu, recovery_timeout_s=recovery)
        if "cpu_distributed_timeout_sec" not in sub:
            npu = attrs.evolve(npu, cpu_distributed_timeout_s=cpu_timeout)
        enabled = bool(parallel.enable_fault_tolerance)
        return cls(enabled=enabled, npu=npu)

    def build_policy(self) -> Policy:
        """The registry's ``policy`` as a deployed worker runs it, waiting up to
        ``recovery_timeout_s`` for a command (see :class:`~ftengine.policies.Deployment`)."""
        return by_name(self.policy, deployment=Deployment(recovery_timeout=self.recovery_timeout_s))
