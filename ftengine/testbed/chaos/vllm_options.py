"""What a real-vLLM chaos campaign runs: the plan's size and seed, the deployment (DP,
ports, ftengine's per-op timeout, re-inference) and the traffic; and the vLLM deployment
configuration each generation of the campaign starts."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from ftengine.integrations.vllm.worker.fault_injection import FAULT_FILE_ENV
from ftengine.testbed.vllm.launcher import DeploymentConfig

if TYPE_CHECKING:  # (hosts.py loads the CPU cluster's package: only a run on hosts needs it)
    from ftengine.testbed.vllm.hosts import HostLayout

MODEL_NAME = "chaos"  # what the chaos traffic asks for (vLLM's --served-model-name)


@attrs.frozen
class VllmCampaignOptions:
    """``faults`` faults planned from ``seed`` on a ``dp_size`` deployment of
    ``checkpoint`` (rank r on ``port + r``) under ``clients_per_rank`` streams per rank."""

    checkpoint: Path
    faults: int = 10
    seed: int = 0
    dp_size: int = 3
    clients_per_rank: int = 2
    max_tokens: int = 24
    op_timeout_s: float = 10.0
    """ftengine's per-op timeout inside vLLM: 5 s (the tests') fires on its own under a
    load average of 30-40 on 2 cores (a peer's first steps are descheduled that long)."""
    recovery_timeout_s: float = 120.0
    """vLLM's ``engine_recovery_timeout_sec``: past it the servers exit."""
    recover_deadline_s: float = 60.0
    max_reinference: int = 3
    port: int = 29900
    log_dir: Path = Path("vllm-chaos-logs")
    startup_timeout_s: float = 600.0
    rejoin: bool = True
    """After each recovery, restart the removed ranks (but 0) and admit them (``scale_up``)."""
    rejoin_deadline_s: float = 600.0
    """Restart to admitted, per heal (three processes start beside the loaded survivors)."""
    serve_during_restart: bool = False
    """Whether the survivors' clients keep streaming while a healed rank's server starts.
    Off by default: on 2 cores a server starting beside a busy survivor got ~1.5 % of a CPU
    and missed the heal's deadline (minutes in ``import torch``); the clients pause until it
    is ``ready`` and stream again through its admission (the rejoin test serves throughout)."""
    cpu_nap: bool = False
    """vLLM's queue waits nap instead of yield (``DeploymentConfig.cpu_nap``)."""
    hosts: int = 1
    """Network-namespace hosts the ranks are spread over (``HostLayout.even``; root and
    ``ip``): 2 or more add the loss of a whole host and a partition to the plan
    (``vllm_plan.HOST_KINDS``)."""

    @property
    def layout(self) -> HostLayout | None:
        """Where the ranks run: None on one host (the root namespace)."""
        if self.hosts <= 1:
            return None
        from ftengine.testbed.vllm.hosts import HostLayout

        return HostLayout.even(self.dp_size, self.hosts)

    @property
    def clients(self) -> int:
        return self.clients_per_rank * self.dp_size

    def deployment(self, fault_file: Path, generation: int) -> DeploymentConfig:
        """Generation ``generation``'s deployment (its logs in their own folder)."""
        ftengine = {
            "cpu_distributed_timeout_sec": self.op_timeout_s,
            "reinference": True,
            "max_reinference": self.max_reinference,
        }
        return DeploymentConfig(
            self.checkpoint, dp_size=self.dp_size, port=self.port, dtype="float32",
            recovery_timeout_s=self.recovery_timeout_s, additional_config={"ftengine": ftengine},
            extra_args=("--served-model-name", MODEL_NAME), env={FAULT_FILE_ENV: str(fault_file)},
            log_dir=self.log_dir / f"gen{generation}", startup_timeout_s=self.startup_timeout_s,
            cpu_nap=self.cpu_nap,
        )  # fmt: skip
