"""Stand-in of vLLM-Ascend's v2 model runner: loads this EP rank's experts, EPLB maps,
requests, and runs the MoE layers (through the fake MC2) for real and dummy steps."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from ftengine.placement.maps import ExpertPlacement
from ftengine.weights.index import CheckpointIndex
from ftengine.weights.reload import load_experts_into_slots
from ftengine.weights.slots import ExpertSlots

from ...ascend_config import get_ascend_config
from ...distributed.eplb_state import AscendEplbLayerState
from ...ops.fused_moe import AscendFusedMoE
from .async_utils import AscendAsyncOutput


@dataclass
class EplbModelState:
    """The fields of vLLM's ``EplbModelState`` ftengine reads (maps updated in place)."""

    physical_to_logical_map: torch.Tensor
    logical_to_physical_map: torch.Tensor
    logical_replica_count: torch.Tensor
    model: Any


@dataclass
class EplbState:
    model_states: dict[str, EplbModelState]


@dataclass
class RequestStates:
    req_id_to_index: dict[str, int] = field(default_factory=dict)


class MoeModel(torch.nn.Module):
    """A model of MoE layers only (what EPLB's ``MixtureOfExperts`` exposes)."""

    def __init__(self, layers: list[AscendFusedMoE]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    @property
    def moe_layers(self) -> list[AscendFusedMoE]:
        return [layer for layer in self.layers if isinstance(layer, AscendFusedMoE)]


class NPUModelRunner:
    """``vllm_ascend.worker.v2.model_runner.NPUModelRunner`` as far as FT goes."""

    def __init__(self, vllm_config: Any, device: Any, ep_group: Any) -> None:
        self.vllm_config = vllm_config
        self.device = device
        self.ep_group = ep_group
        self.model: MoeModel | None = None
        self.eplb = SimpleNamespace(state=None)  # vLLM's EPLBController: eplb_state is its state
        self.req_states = RequestStates()
        self.execute_model_state: object = None
        self.dummy_runs = 0
        self.hidden = 0
        self.num_logical = 0

    @property
    def eplb_state(self) -> EplbState | None:
        state: EplbState | None = self.eplb.state
        return state

    def load_model(self) -> None:
        parallel = self.vllm_config.parallel_config
        index = CheckpointIndex.open(self.vllm_config.model_config.model)
        size, rank = self.ep_group.world_size, self.ep_group.rank_in_group
        redundant = int(parallel.eplb_config.num_redundant_experts)
        placement = ExpertPlacement.default(index.num_layers, index.num_experts, redundant, size)
        local = placement.local_slots
        slots = ExpertSlots.allocate(index, index.num_layers, local)
        p2l = placement.physical_to_logical_map
        chosen = [
            (layer, s, int(p2l[layer, rank * local + s]))
            for layer in range(index.num_layers)
            for s in range(local)
        ]
        load_experts_into_slots(index, slots, chosen)
        self.model = MoeModel(self._layers(placement, slots, rank))
        self.hidden, self.num_logical = index.hidden_size, index.num_experts
        state = EplbModelState(
            p2l, placement.logical_to_physical_map, placement.logical_replica_count, self.model
        )
        states = {"main": state}
        speculative = getattr(self.vllm_config, "speculative_config", None)
        if "mtp" in str(getattr(speculative, "method", "")):
            # vLLM's EPLB keeps one model state per MoE model: the MTP drafter has its own.
            states["mtp_drafter"] = EplbModelState(
                p2l.clone(),
                placement.logical_to_physical_map.clone(),
                placement.logical_replica_count.clone(),
                self.model,
            )
        self.eplb.state = EplbState(states)

    def _layers(
        self, placement: ExpertPlacement, slots: ExpertSlots, rank: int
    ) -> list[AscendFusedMoE]:
        parallel = self.vllm_config.parallel_config
        use_lists = bool(self.vllm_config.use_v2_model_runner and parallel.enable_eplb)
        nz_mode = get_ascend_config().weight_nz_mode
        layers = []
        for layer in range(placement.num_layers):
            state = AscendEplbLayerState(
                placement.logical_to_physical_map[layer],
                placement.logical_replica_count[layer],
                rank,
            )
            moe = AscendFusedMoE(
                layer,
                state,
                num_local_experts=placement.local_slots,
                num_physical=placement.num_physical,
                ep_world_size=placement.ep_size,
                ep_rank=rank,
            )
            moe.load(slots, layer, use_lists=use_lists, nz_mode=nz_mode)
            layers.append(moe)
        return layers

    def _forward(self, num_tokens: int) -> torch.Tensor:
        assert self.model is not None, "load_model first"
        x = torch.ones(num_tokens, self.hidden, dtype=torch.bfloat16)
        manager = self.ep_group.device_communicator.all2all_manager
        for layer in self.model.moe_layers:
            x = layer(x, manager, self.num_logical)
        return x

    def _dummy_run(self, num_tokens: int, uniform_decode: bool = False) -> None:
        self._forward(num_tokens)
        self.dummy_runs += 1

    def _remove_request(self, req_id: str) -> None:
        del self.req_states.req_id_to_index[req_id]

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> None:
        for req_id in scheduler_output.req_ids:
            self.req_states.req_id_to_index.setdefault(req_id, len(self.req_states.req_id_to_index))
        self.execute_model_state = self._forward(len(scheduler_output.req_ids))

    def sample_tokens(self, grammar_output: Any) -> AscendAsyncOutput:
        self.execute_model_state = None
        return AscendAsyncOutput(list(self.req_states.req_id_to_index))
