"""The Ascend NPU backend: op timeouts, poisoned-stream quarantine, device reset, MC2 masking.

It acts through torch_npu (imported when the backend is built, never at ftengine import
time) and reaches the model only through :class:`~ftengine.backends.npu_host.NpuHost`.
The engine drives it in the order documented in ``ftengine.backends.base``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, MutableMapping
from typing import TYPE_CHECKING, ParamSpec, TypedDict, TypeVar

import attrs
import torch

from ftengine.backends.base import RepairReport
from ftengine.backends.npu_config import NpuFtConfig
from ftengine.backends.npu_env import apply_ft_environment
from ftengine.backends.npu_groups import GroupFactory, OwnedGroups, TorchGroupFactory
from ftengine.backends.npu_host import NpuHost, NpuTopology
from ftengine.backends.npu_mc2 import Mc2Communicator, Mc2Params
from ftengine.backends.npu_preconditions import (
    NpuDeployment,
    check_scale_down,
    scale_down_problems,
)
from ftengine.backends.npu_reload import NpuExpertReloader, NpuReloadStats
from ftengine.backends.npu_reset import DeviceResetter, FaultBarrier
from ftengine.backends.npu_runtime import NpuRuntime
from ftengine.backends.npu_timeouts import OpTimeoutController
from ftengine.errors import BackendError, PreconditionFailed
from ftengine.faults import Fault
from ftengine.placement.elastic import ElasticInfo
from ftengine.placement.maps import ExpertPlacement
from ftengine.placement.planner import apply_plan, plan_redistribution
from ftengine.placement.ranks import check_ep_ranks, dp_to_ep_ranks, neutralize_dead_columns
from ftengine.placement.rejoin import apply_rejoin, grown_copies_for, plan_rejoin

if TYPE_CHECKING:  # typing.Unpack is 3.11+; annotations are never evaluated at run time
    from typing import Unpack

logger = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

NO_RELOAD = NpuReloadStats(experts=0, bytes_read=0, format_casts=0, seconds=0.0)


class NpuSeams(TypedDict, total=False):
    """What a host or a test may swap in for ``NpuBackend``'s defaults (see its docstring)."""

    runtime: NpuRuntime | None
    group_factory: GroupFactory | None
    environ: MutableMapping[str, str] | None
    device: torch.device | None


def _observed(
    declared: NpuDeployment | None,
    topology: NpuTopology,
    placement: ExpertPlacement,
    runtime: NpuRuntime,
) -> NpuDeployment:
    """The host's ``declared`` deployment with the facts this process sees for itself put
    over the host's word (an aclnn probe that cannot tell keeps the host's answer)."""
    base = declared if declared is not None else NpuDeployment()
    kernels = runtime.has_elastic_info_kernels
    return attrs.evolve(
        base,
        num_redundant_experts=placement.num_redundant,
        has_dispatch_v2=runtime.has_mc2_v2,
        elastic_info_kernels=base.elastic_info_kernels if kernels is None else kernels,
    )


def _owned_groups(
    topology: NpuTopology, config: NpuFtConfig, factory: GroupFactory | None
) -> OwnedGroups:
    """The groups ftengine owns, over every TP rank of every DP rank to begin with."""
    return OwnedGroups(
        factory if factory is not None else TorchGroupFactory(),
        topology.global_ranks(frozenset(range(topology.dp_size))),
        cpu_timeout_s=config.cpu_distributed_timeout_s,
    )


class NpuBackend:
    """Backend for one vLLM-Ascend worker (one NPU, one original DP rank).

    ``runtime`` defaults to the real torch_npu (``TorchNpuUnavailable`` if it is missing);
    ``group_factory`` to ``torch.distributed``; ``environ`` to ``os.environ``; ``device`` to
    ``npu:<device_index>``. With ``config.scale_down`` every unmet scale-down precondition
    is reported at once (``PreconditionFailed``) here, at start-up. The FT environment
    (``npu_env``) and the op timeout are applied here too, the op timeout on the initialised
    device and again after every device restart (torch_npu's lazy initialisation and
    ``restart_device`` set its default again); vllm-ascend's glue applies the environment
    earlier, before the device is set up.
    """

    name = "npu"

    def __init__(
        self,
        host: NpuHost,
        topology: NpuTopology,
        *,
        config: NpuFtConfig | None = None,
        deployment: NpuDeployment | None = None,
        runtime: NpuRuntime | None = None,
        group_factory: GroupFactory | None = None,
        environ: MutableMapping[str, str] | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.runtime = runtime if runtime is not None else NpuRuntime.load()
        self.host = host
        self.topology = topology
        self.config = config if config is not None else NpuFtConfig()
        placement = host.placement()
        topology.check_placement(placement)
        self.deployment = _observed(deployment, topology, placement, self.runtime)
        if self.config.scale_down:
            check_scale_down(self.deployment)
        self.device = device if device is not None else self.runtime.device(topology.device_index)
        env = os.environ if environ is None else environ
        apply_ft_environment(env, topology.tp_size)
        self.timeouts = OpTimeoutController(self.runtime, env, device_index=topology.device_index)
        self.timeouts.apply(self.config.communication_abort_timeout_s)
        self.groups = _owned_groups(topology, self.config, group_factory)
        self._resetter = DeviceResetter(
            self.runtime, topology.device_index, self.groups, after_restart=self.timeouts.reapply
        )
        self.barrier = FaultBarrier(lambda: self._resetter.reset(recreate_groups=False))
        # One elastic_info per worker, shared by every MoE layer and every MC2 call.
        self.elastic = ElasticInfo(
            placement.ep_size,
            placement.local_slots,
            device=self.device,
            moe_expert_num=placement.num_physical,
        )
        self._reloader = NpuExpertReloader(self.runtime, self.device)
        # The slot map at start-up: what a returning rank gets back, and what it loaded.
        self._original = placement.physical_to_logical_map.detach().to("cpu").clone()
        self._dead_dp: frozenset[int] = frozenset()
        self._epoch = 0

    @classmethod
    def from_additional_config(
        cls,
        additional_config: Mapping[str, object] | None,
        host: NpuHost,
        topology: NpuTopology,
        *,
        deployment: NpuDeployment | None = None,
        **seams: Unpack[NpuSeams],
    ) -> NpuBackend:
        """Build from vLLM's ``additional_config`` (``npu_config``); the rest as ``__init__``."""
        config = NpuFtConfig.from_additional_config(additional_config)
        return cls(host, topology, config=config, deployment=deployment, **seams)

    # What the host uses ----------------------------------------------------------------------

    @property
    def dead_dp_ranks(self) -> frozenset[int]:
        """Original DP ranks masked so far (cumulative)."""
        return self._dead_dp

    @property
    def epoch(self) -> int:
        return self._epoch

    def guard(self, fn: Callable[P, T], empty: Callable[[], T]) -> Callable[P, T]:
        """Wrap the host's model call with the fault barrier (see ``FaultBarrier.guard``)."""
        return self.barrier.guard(fn, empty)

    def make_mc2(
        self,
        group_ep: str,
        *,
        global_bs: int = 0,
        quant_mode: int = 0,
        expert_token_nums_type: int = 1,
        group_tp: str = "",
    ) -> Mc2Communicator:
        """An MC2 dispatch/combine caller sharing this worker's single ``elastic_info``.

        ``group_ep`` is the HCCL name of the EP group; the other arguments are the
        :class:`Mc2Params` fields of the same name.
        """
        placement = self.host.placement()
        mc2 = Mc2Params(
            group_ep=group_ep,
            ep_world_size=self.topology.ep_size,
            ep_rank_id=self.topology.ep_rank,
            moe_expert_num=placement.num_physical,
            global_bs=global_bs,
            quant_mode=quant_mode,
            expert_token_nums_type=expert_token_nums_type,
            group_tp=group_tp,
        )
        return Mc2Communicator(self.runtime, mc2, self.elastic)

    def neutralize_dp_columns(self, tensor: torch.Tensor, neutral: float | int | bool) -> None:
        """Overwrite the dead DP ranks' columns of a DP-sync tensor ``[..., dp]`` in place."""
        neutralize_dead_columns(tensor, self._dead_dp, neutral)

    # Backend protocol ------------------------------------------------------------------------

    def set_op_timeout(self, seconds: float) -> None:
        """T seconds (0 = off, else a whole number >= 2): HCCL env + ``set_op_timeout_ms``."""
        self.timeouts.apply(seconds)

    def quarantine(self, fault: Fault) -> None:
        """Mark the worker faulted and reset the device now, once per fault (no peer waits).

        The local reset does not re-create groups (that is a rendezvous with peers that may
        be dead); it marks them stale until ``rebuild_groups``.
        """
        self.barrier.trip(f"{fault.kind.value}: {fault.info}" if fault.info else fault.kind.value)

    def reset_device(self) -> None:
        """Full reset: set/stop/restart device, reinit HCCL, synchronize, re-create groups."""
        self._resetter.reset(recreate_groups=True)

    def rebuild_groups(self, alive_ranks: frozenset[int], epoch: int) -> None:
        """Re-create every owned group among ``alive_ranks``; model calls reach the device again."""
        self._check_alive(frozenset(alive_ranks))
        self.groups.rebuild(self.topology.global_ranks(alive_ranks), epoch)
        self._epoch = epoch
        self.barrier.release()

    def mask_ranks(self, dead_ranks: frozenset[int]) -> None:
        """Rebuild ``elastic_info`` in place for the cumulative dead DP ranks."""
        self._require_scale_down()
        dead = frozenset(dead_ranks)
        if self.topology.dp_rank in dead:
            raise PreconditionFailed(
                f"rank {self.topology.dp_rank} was asked to mask itself; only survivors mask"
            )
        if not self._dead_dp <= dead:
            raise PreconditionFailed(
                f"dead ranks are cumulative: {sorted(dead)} drops earlier dead ranks "
                f"{sorted(self._dead_dp - dead)}"
            )
        dead_ep = check_ep_ranks(dp_to_ep_ranks(dead, self.topology.tp_size), self.topology.ep_size)
        if self.elastic.dead_ep_ranks:
            # The previous non-blocking copy may still read the pinned host buffer.
            self.runtime.synchronize()
        self.elastic.update(dead_ep)
        self._dead_dp = dead
        logger.info(
            "npu ranks masked",
            extra={"rank": self.topology.dp_rank, "epoch": self._epoch, "dead": sorted(dead)},
        )

    def repair_experts(self, dead_ranks: frozenset[int]) -> RepairReport:
        """Plan the redistribution (same plan on every survivor), reload this rank's moves,
        update the maps, then the host's routing tables (densified once, in place)."""
        self._require_scale_down()
        dead_ep = dp_to_ep_ranks(dead_ranks, self.topology.tp_size)
        if not dead_ep:
            return RepairReport()  # nothing dead: every expert still has its replicas
        placement = self.host.placement()
        plan = plan_redistribution(placement, dead_ep)
        mine = plan.local_assignments(self.topology.ep_rank)
        # Weights first, maps second: the router never points at a slot still being written.
        stats = (
            self._reloader.reload(self.host.checkpoint(), self.host.slot_storage(), mine)
            if mine
            else NO_RELOAD
        )
        apply_plan(placement, plan)
        self.host.refresh_routing(self.elastic.table1())
        return RepairReport(
            reloads=stats.experts,
            reload_lower_bound=plan.lower_bound,
            bytes_reloaded=stats.bytes_read,
            reloaded=tuple((layer, expert) for layer, _, expert in mine),
        )

    def admit_ranks(self, added: frozenset[int], removed: frozenset[int]) -> RepairReport:
        """Take ``added`` back: un-mask ``elastic_info`` in place to the cumulative ``removed``
        (all zeros, the full physical width, once none is removed), give the returning
        ranks their original experts in the maps (survivors drop the copies grown for them,
        or keep them as standby under failure-aware placement; nothing reloaded), then
        rebuild the host's routing tables in place.

        On the returning rank (``added`` holds its rank) the host's maps must already be
        the survivors' (its own slots empty: the host copies them from a survivor before
        the admission); it reloads only the slots it must hold that differ from what it
        loaded at start-up. Checks everything before changing anything.
        """
        self._require_scale_down()
        added, removed = frozenset(added), frozenset(removed)
        me, topology = self.topology.dp_rank, self.topology
        joining = me in added
        problems = []
        if not added or added & removed:
            problems.append(
                f"added ranks {sorted(added)} must be non-empty and outside the removed set "
                f"{sorted(removed)}"
            )
        if me in removed:
            problems.append(f"rank {me} admits ranks only as a member (it is in {sorted(removed)})")
        if not joining and not added <= self._dead_dp:
            problems.append(
                f"ranks {sorted(added - self._dead_dp)} are not masked here (masked: "
                f"{sorted(self._dead_dp)}); only removed ranks can be admitted"
            )
        if not joining and removed != self._dead_dp - added:
            problems.append(
                f"the removed set after admitting {sorted(added)} must be "
                f"{sorted(self._dead_dp - added)}, got {sorted(removed)}"
            )
        if problems:
            raise PreconditionFailed("admit_ranks refused: " + "; ".join(problems), tuple(problems))
        dead_ep = check_ep_ranks(dp_to_ep_ranks(removed, topology.tp_size), topology.ep_size)
        added_ep = dp_to_ep_ranks(added, topology.tp_size)
        placement = self.host.placement()
        if joining:
            own = placement.rank_slots(dp_to_ep_ranks(frozenset({me}), topology.tp_size))
            if bool(
                (placement.physical_to_logical_map[:, own.to(self._original.device)] >= 0).any()
            ):
                raise PreconditionFailed(
                    f"returning rank {me}: the host's expert maps must be the survivors' "
                    "(this rank's slots empty) before admit_ranks; copy them from a survivor"
                )
        plan = plan_rejoin(
            placement, added_ep, self._original, grown=grown_copies_for(self.config.placement)
        )
        todo: tuple[tuple[int, int, int], ...] = ()
        if joining:
            first = topology.ep_rank * placement.local_slots
            loaded = self._original[:, first : first + placement.local_slots]
            todo = tuple(
                move
                for move in plan.local_assignments(topology.ep_rank, placement.local_slots)
                if int(loaded[move[0], move[1]]) != move[2]
            )
        # Weights first, maps second: the router never points at a slot still being written.
        stats = (
            self._reloader.reload(self.host.checkpoint(), self.host.slot_storage(), todo)
            if todo
            else NO_RELOAD
        )
        apply_rejoin(placement, plan)
        if self.elastic.dead_ep_ranks:
            self.runtime.synchronize()  # the last non-blocking copy may still read the buffer
        self.elastic.update(dead_ep)
        self._dead_dp = removed
        self.host.refresh_routing(self.elastic.table1())
        logger.info(
            "npu ranks admitted",
            extra={"rank": me, "epoch": self._epoch, "added": sorted(added)},
        )
        return RepairReport(
            reloads=stats.experts,
            bytes_reloaded=stats.bytes_read,
            reloaded=tuple((layer, expert) for layer, _, expert in todo),
        )

    def run_dummy_batch(self) -> None:
        """The host's dummy step (through MC2 with the current elastic_info), then a device
        synchronize: the step's kernels are queued, and their errors surface there."""
        try:
            self.host.run_dummy_batch()
            self.runtime.synchronize()
        except Exception as exc:
            raise BackendError(
                f"the dummy batch failed on NPU rank {self.topology.dp_rank}: {exc}"
            ) from exc

    def synchronize(self) -> None:
        """Wait for queued device work, unless the stream is poisoned and not yet reset."""
        if self.barrier.tripped and not self.barrier.reset_done:
            logger.warning("synchronize skipped: the device stream is poisoned and not reset")
            return
        self.runtime.synchronize()

    def _check_alive(self, alive: frozenset[int]) -> None:
        size = self.topology.dp_size
        problems = []
        if self.topology.dp_rank not in alive:
            problems.append(f"alive ranks {sorted(alive)} must include this rank")
        outside = sorted(r for r in alive if not 0 <= r < size)
        if outside:
            problems.append(f"alive ranks {outside} are not DP ranks of [0, {size})")
        if problems:
            message = "cannot rebuild groups: " + "; ".join(problems)
            raise PreconditionFailed(message, tuple(problems))

    def _require_scale_down(self) -> None:
        if not self.config.scale_down:
            problems = scale_down_problems(self.deployment)
            raise PreconditionFailed(
                "scale-down is disabled for this NPU worker (ftengine.scale_down = false)"
                + (f"; it would also need: {'; '.join(problems)}" if problems else ""),
                reasons=("scale-down is disabled (ftengine.scale_down = false)", *problems),
            )
