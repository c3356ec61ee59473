"""The CPU backend: gloo process groups with per-op timeouts, elastic_info masking, in-place
expert repair and a model-less dummy batch, for the CPU reference cluster.

Groups are rebuilt among the alive ranks on a fresh store prefix per epoch
(``cpu_comm.GlooGroup``); while quarantined, every collective is refused so a worker
never blocks on a peer that is dead or hung. Ranks are original DP ranks (TP = 1, so
EP rank = DP rank).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch._C._distributed_c10d import Store

from ftengine.backends.base import RepairReport
from ftengine.errors import BackendError, ConfigError
from ftengine.faults import Fault
from ftengine.placement.ranks import neutralize_dead_columns
from ftengine.placement.rejoin import GrownCopies
from ftengine.testbed.cpu.comm import GlooGroup
from ftengine.testbed.cpu.experts import CpuExperts
from ftengine.testbed.cpu.moe import DistributedMoe

logger = logging.getLogger(__name__)

Tensor = torch.Tensor


class CpuBackend:
    """Backend of one CPU worker (``rank`` of ``world_size``) over the shared ``store``.

    ``experts`` is the worker's :class:`CpuExperts`; ``reload_fails`` (optional) is
    asked before each repair and makes it raise WeightLoadError when it returns True
    (fault injection). Call ``rebuild_groups(all ranks, 0)`` once to join the first
    group; every peer must do the same within ``rendezvous_timeout_s``.
    """

    name = "cpu"

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        store: Store,
        experts: CpuExperts,
        op_timeout_s: float,
        rendezvous_timeout_s: float,
        reload_fails: Callable[[], bool] | None = None,
        grown: GrownCopies = "drop",
    ) -> None:
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank must be in [0, {world_size}), found {rank}")
        self.rank = rank
        self.world_size = world_size
        self.experts = experts
        self._store = store
        self._op_timeout_s = op_timeout_s
        self._rendezvous_timeout_s = rendezvous_timeout_s
        self._reload_fails = reload_fails
        self.grown: GrownCopies = grown
        self._group: GlooGroup | None = None
        self.alive: frozenset[int] = frozenset(range(world_size))
        self.dead: frozenset[int] = frozenset()
        self.epoch = -1
        self.quarantined = False
        self.moe = DistributedMoe(
            self.comm, experts, experts.routing, experts.densify, experts.local_slots
        )

    # -- what the worker's model uses -------------------------------------------------
    def comm(self) -> GlooGroup:
        """The current group; raises BackendError while quarantined or before the first build."""
        if self.quarantined or self._group is None:
            raise BackendError(
                f"rank {self.rank} has no usable process group (quarantined={self.quarantined},"
                f" epoch={self.epoch}); recover it (retry / scale_down) before running steps"
            )
        return self._group

    def dp_sync(self, num_tokens: int, step: int) -> Tensor:
        """The per-step DP all-reduce: every rank's token count, dead columns neutralised.

        Also checks lockstep: every alive rank must be at the same ``step``. Returns the
        token counts ``[world_size]`` (0 for dead ranks).
        """
        group = self.comm()
        table = torch.zeros(2, self.world_size, dtype=torch.int64)
        table[0, self.rank] = num_tokens
        table[1, self.rank] = step + 2  # dummy steps are -1; 0 stays "nobody wrote"
        group.all_reduce_sum(table)
        neutralize_dead_columns(table, self.dead, 0)
        steps = {int(table[1, r]) - 2 for r in self.alive}
        if steps != {step}:
            raise BackendError(
                f"lockstep broken on rank {self.rank}: expected every alive rank at step "
                f"{step}, found steps {sorted(steps)}"
            )
        return table[0]

    # -- Backend protocol ---------------------------------------------------------------
    def set_op_timeout(self, seconds: float) -> None:
        if seconds < 0:
            raise ConfigError(f"op timeout must be >= 0 seconds, found {seconds}")
        # Gloo has no "off": 0 means a day, long enough to count as no timeout.
        self._op_timeout_s = seconds if seconds > 0 else 86400.0
        if self._group is not None:
            self._group.op_timeout_s = self._op_timeout_s

    @property
    def op_timeout_s(self) -> float:
        return self._op_timeout_s

    def quarantine(self, fault: Fault) -> None:
        # Dropping the group never talks to peers; gloo cannot abort a running op anyway,
        # and this runs after the op that failed has returned.
        self.quarantined = True
        self._drop_group()
        logger.info(
            "quarantined",
            extra={"rank": self.rank, "epoch": self.epoch, "fault": fault.kind.value},
        )

    def reset_device(self) -> None:
        # A CPU has no device state to reset; the groups are rebuilt next.
        self._drop_group()

    def rebuild_groups(self, alive_ranks: frozenset[int], epoch: int) -> None:
        self._drop_group()
        self._group = GlooGroup(
            self._store,
            alive_ranks,
            self.rank,
            epoch,
            op_timeout_s=self._op_timeout_s,
            rendezvous_timeout_s=self._rendezvous_timeout_s,
        )
        self.alive = frozenset(alive_ranks)
        self.epoch = epoch
        self.quarantined = False

    def mask_ranks(self, dead_ranks: frozenset[int]) -> None:
        self.dead = frozenset(dead_ranks)
        self.experts.mask(self.dead)

    def repair_experts(self, dead_ranks: frozenset[int]) -> RepairReport:
        fail = self._reload_fails is not None and self._reload_fails()
        return self.experts.repair(frozenset(dead_ranks), fail=fail)

    def admit_ranks(self, added: frozenset[int], removed: frozenset[int]) -> RepairReport:
        """Admit ``added`` over the new group: the lowest survivor's slot map reaches every
        member (one all-reduce; a survivor checks its own agrees), each rank restores the
        returning ranks' experts locally and reloads only its own slots it lacks (none on
        a survivor), then ``elastic_info`` and the DP-sync columns are un-masked in place."""
        group = self.comm()
        added = frozenset(added)
        survivors = [r for r in group.members if r not in added]
        if not survivors or not added <= frozenset(group.members):
            raise BackendError(
                f"admit_ranks({sorted(added)}) on rank {self.rank}: the epoch-{self.epoch} "
                f"group {list(group.members)} must span the added ranks and a survivor"
            )
        p2l = self.experts.placement.physical_to_logical_map
        table = p2l + 1 if self.rank == survivors[0] else torch.zeros_like(p2l)
        group.all_reduce_sum(table)
        report = self.experts.admit(added, table - 1, grown=self.grown)
        self.dead = frozenset(removed)
        self.experts.mask(self.dead)
        logger.info(
            "admitted",
            extra={"rank": self.rank, "epoch": self.epoch, "added": sorted(added)},
        )
        return report

    def run_dummy_batch(self) -> None:
        """One model-less MoE pass: DP sync, then one token per rank through every layer."""
        self.dp_sync(1, -1)
        group = self.comm()
        num_logical = self.experts.placement.num_logical
        k = min(2, num_logical)
        hidden = torch.full((1, self.experts.slots.hidden), 0.01)
        for layer in range(self.experts.placement.num_layers):
            first = (group.rank + layer) % num_logical
            ids = torch.tensor([[(first + j) % num_logical for j in range(k)]])
            out = self.moe(
                layer, hidden, ids, torch.full((1, k), 1.0 / k), torch.zeros(1, dtype=torch.long)
            )
            if not bool(torch.isfinite(out).all()):
                raise BackendError(
                    f"dummy batch on rank {self.rank}: layer {layer} gave non-finite output"
                )

    def close(self) -> None:
        """Drop the process group (the store belongs to whoever created it)."""
        self._drop_group()
        self.quarantined = True

    def _drop_group(self) -> None:
        """Forget the current group; its teardown runs off this thread (GlooGroup.release)."""
        group, self._group = self._group, None
        if group is not None:
            group.release()

    def synchronize(self) -> None:
        # CPU collectives here are blocking: nothing is ever queued.
        return None
