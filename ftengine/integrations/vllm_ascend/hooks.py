"""The NPU backend's ``NpuHost`` over a vLLM-Ascend worker: what its kernels and forward read.

Besides the generic vLLM worker steps (``VllmWorkerHooks``): the MC2 dead-rank mask goes
through the all2all manager's own accessor (``update_mask``, checked against
``get_elastic_info()``, which the token dispatcher reads); a redistribution is made live by
``refresh_model_routing_tables`` and one in-place densification of every MoE layer's
``expert_replica_routing_table``; a reload writes the tensors the forward reads (the
per-expert lists of the v2 runner with EPLB, else the stacked parameters).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, cast

import torch

from ftengine.backends.npu_mc2 import densify_routing_table
from ftengine.backends.npu_reload import NzPolicy, SlotStorage, TpShard
from ftengine.errors import BackendError
from ftengine.integrations.vllm.shapes import VllmDistributed, WorkerLike
from ftengine.integrations.vllm.worker.hooks import VllmWorkerHooks
from ftengine.integrations.vllm_ascend.config import AscendFacts, read_facts
from ftengine.integrations.vllm_ascend.names import (
    LAYER_EPLB_STATE,
    MOE_CONFIG,
    MOE_LAYERS,
    MTP,
    REFRESH_ROUTING,
    ROUTED_EXPERTS,
    ROUTING_MODULES,
    ROUTING_TABLE,
    SLOT_LISTS,
    SLOT_TENSORS,
    SPECULATIVE_CONFIG,
    resolve_first,
)

logger = logging.getLogger(__name__)


class Mc2ManagerLike(Protocol):
    """vLLM-Ascend's ``_NpuAll2AllManager`` (``get_ep_all2all_manager()`` on an NPU)."""

    def update_mask(self, rank: int, masked: bool = True) -> None: ...
    def query_active_mask(self) -> torch.Tensor: ...
    def get_elastic_info(self) -> torch.Tensor | None: ...
    def set_num_local_physical_experts(self, num_local_experts: int) -> None: ...
    def clean_buffers(self) -> None: ...


def _tp_shard(layer: torch.nn.Module) -> TpShard:
    """The layer's MoE tensor-parallel shard (``moe_config.moe_parallel_config``)."""
    parallel = getattr(getattr(layer, MOE_CONFIG, None), "moe_parallel_config", None)
    if parallel is None:
        return TpShard()
    return TpShard(rank=int(parallel.tp_rank), size=int(parallel.tp_size))


class AscendMoeSlots:
    """:class:`SlotStorage` over vLLM-Ascend's MoE layers: each slot field is the entry of
    the per-expert list the forward reads when the layer has one, else a view of the
    stacked parameter; fields a layer lacks are left out (the reload then refuses)."""

    def __init__(self, layers: Sequence[torch.nn.Module], *, nz: NzPolicy) -> None:
        self.layers = layers
        self._nz = nz
        self._tp = _tp_shard(layers[0]) if layers else TpShard()

    @property
    def nz(self) -> NzPolicy:
        return self._nz

    @property
    def tp(self) -> TpShard:
        return self._tp

    def slot(self, layer: int, slot: int) -> Mapping[str, torch.Tensor]:
        module = self.layers[layer]
        views: dict[str, torch.Tensor] = {}
        for field, attr in SLOT_TENSORS.items():
            listed = getattr(module, SLOT_LISTS[field], None) if field in SLOT_LISTS else None
            if isinstance(listed, list | tuple):
                views[field] = listed[slot]
                continue
            tensor = getattr(module, attr, None)
            if isinstance(tensor, torch.Tensor):
                views[field] = tensor.data[slot]
        return views


class AscendWorkerHooks(VllmWorkerHooks):
    """``WorkerHooks`` and ``NpuHost`` of one vLLM-Ascend worker.

    ``dist.all2all_manager()`` must be vLLM-Ascend's MC2 manager (:class:`Mc2ManagerLike`).
    The worker's vLLM-Ascend facts (``config.read_facts``) are read on first use.
    """

    def __init__(self, worker: WorkerLike, dist: VllmDistributed) -> None:
        super().__init__(worker, dist)
        self._facts: AscendFacts | None = None
        self._synchronize: Callable[[], None] | None = None
        self._masked: tuple[frozenset[int], torch.Tensor | None] | None = None

    def bind_device(self, synchronize: Callable[[], None]) -> None:
        """The device backend's ``synchronize``, run after every dummy batch."""
        self._synchronize = synchronize

    def run_dummy_batch(self) -> None:
        """vLLM-Ascend's dummy step, then a device synchronize: the step's kernels are only
        queued, and a failure of theirs must fail the recovery, not the next request."""
        super().run_dummy_batch()
        if self._synchronize is None:
            raise BackendError("no device backend is bound to synchronize the dummy batch")
        self._synchronize()

    @property
    def facts(self) -> AscendFacts:
        """Read once the model is loaded (the EPLB model states exist then)."""
        if self._facts is None:
            self._facts = read_facts(self.worker, unmanaged_eplb_models=self._unmanaged_models())
        return self._facts

    def _unmanaged_models(self) -> tuple[str, ...]:
        """EPLB models a redistribution would not update: every model state but the served
        one, and an MTP drafter (vLLM-Ascend's own sentinel refreshes its EPLB state)."""
        state = getattr(self.worker.model_runner, "eplb_state", None)
        others = list(getattr(state, "model_states", {}))[1:]
        found = [f"EPLB model state {name!r}" for name in others]
        spec = getattr(self.worker.vllm_config, SPECULATIVE_CONFIG, None)
        method = str(getattr(spec, "method", None) or "")
        if MTP in method.lower() and not found:
            found.append(f"the MTP drafter (speculative method {method!r})")
        return tuple(found)

    def _model_state(self) -> object:
        state = getattr(self.worker.model_runner, "eplb_state", None)
        states = list(getattr(state, "model_states", {}).values())
        if not states:
            raise BackendError("the vLLM-Ascend model runner has no EPLB state (--enable-eplb)")
        return states[0]  # the served model, as in ``placement``

    def moe_layers(self) -> list[torch.nn.Module]:
        """The EPLB model's MoE layers in map order (``model.moe_layers``)."""
        model = getattr(self._model_state(), "model", None)
        layers = getattr(model, MOE_LAYERS, None)
        if layers is None:
            raise BackendError(f"the EPLB model state's model has no {MOE_LAYERS}")
        return list(cast("Sequence[torch.nn.Module]", layers))

    def expert_layers(self) -> Sequence[torch.nn.Module]:
        """The modules holding each MoE layer's expert weights, in map order."""
        return [getattr(layer, ROUTED_EXPERTS, layer) for layer in self.moe_layers()]

    def slot_storage(self) -> SlotStorage:
        return AscendMoeSlots(self.expert_layers(), nz=self.facts.nz)

    def manager(self) -> Mc2ManagerLike:
        manager = self.dist.all2all_manager()
        if manager is None or not callable(getattr(manager, "update_mask", None)):
            raise BackendError(
                f"the EP all2all manager {type(manager).__name__} has no update_mask: "
                "MC2 scale-down needs vLLM-Ascend's fault-tolerant manager (PR #16145)"
            )
        return cast(Mc2ManagerLike, manager)

    def prepare_mc2(self, local_slots: int) -> None:
        """Tell the manager the slots per EP rank (vLLM-Ascend's sentinel did it after load)."""
        self.manager().set_num_local_physical_experts(local_slots)

    def mask_all2all(self, dead_ep_ranks: frozenset[int], mask: torch.Tensor | None) -> None:
        """Mask the newly dead EP ranks in the manager, then check that the elastic_info it
        rebuilt (in place) is the one the backend computed, ``mask``."""
        self._masked = (frozenset(dead_ep_ranks), mask)
        manager = self.manager()
        masked = {rank for rank, dead in enumerate(manager.query_active_mask().tolist()) if dead}
        for rank in sorted(frozenset(dead_ep_ranks) - masked):
            manager.update_mask(rank, True)
        info = manager.get_elastic_info()
        if info is None:
            raise BackendError("the all2all manager has no elastic_info: is fault tolerance on?")
        if mask is not None and info.tolist() != mask.tolist():
            raise BackendError(
                f"vLLM-Ascend's all2all manager built elastic_info {info.tolist()}, ftengine "
                f"expects {mask.tolist()} for dead EP ranks {sorted(dead_ep_ranks)}"
            )

    def rebuild_dp_group(self, alive_dp_ranks: frozenset[int], epoch: int) -> None:
        """vLLM's DP-group rebuild, whose ``clean_buffers()`` clears the manager's mask in
        vLLM-Ascend's MegaMoE revision; then the mask again (and checked), so the kernels
        never run a step with dead ranks unmasked."""
        super().rebuild_dp_group(alive_dp_ranks, epoch)
        if self._masked is not None:
            self.mask_all2all(*self._masked)

    def refresh_routing(self, table1: torch.Tensor) -> None:
        """``refresh_model_routing_tables`` (from the updated maps), then every layer's
        ``expert_replica_routing_table`` densified once, in place."""
        state = self._model_state()
        resolve_first(ROUTING_MODULES, REFRESH_ROUTING)(state)
        local = self.placement().local_slots
        for index, layer in enumerate(self.moe_layers()):
            table = getattr(getattr(layer, LAYER_EPLB_STATE, None), ROUTING_TABLE, None)
            if not isinstance(table, torch.Tensor):
                raise BackendError(f"MoE layer {index} has no {ROUTING_TABLE} to densify")
            densify_routing_table(table, table1, local)
        logger.info("vLLM-Ascend routing tables refreshed", extra={"dense_ranks": table1.tolist()})
