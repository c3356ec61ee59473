"""Stand-in of vLLM-Ascend's routed-experts MoE layer: its weights as its loader leaves them,
and a forward that reads them and routes through the (fake) MC2 ops.

``process_weights_after_loading`` mirrors vLLM-Ascend's: w13 ``[slots, H, 2I]`` / w2
``[slots, I, H]``; unquantised weights stay stacked (NZ only with ``weight_nz_mode`` 2); W8A8
weights are NZ and, under the v2 runner with EPLB, split into the per-expert lists the
forward reads (``w13_weight_list``, ``w2_weight_list``, ``w13_weight_scale_fp32_list``,
``w2_weight_scale_list``), the stacked ones deleted. :meth:`AscendFusedMoE.forward_weights`
is what the forward reads, so a reload that writes anything else is caught.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch_npu

from ftengine.weights.nz import ACL_FORMAT_FRACTAL_NZ
from ftengine.weights.slots import ExpertSlots

from ..distributed.eplb_state import AscendEplbLayerState

PARAMS = {
    "w13": "w13_weight",
    "w2": "w2_weight",
    "w13_scale": "w13_weight_scale",
    "w2_scale": "w2_weight_scale",
    "w13_offset": "w13_weight_offset",
    "w2_offset": "w2_weight_offset",
}
"""FusedMoE's parameter for each of ftengine's slot fields, as loaded (before processing)."""
MC2_GROUP = "hccl_mc2_ep"
"""The HCCL name of the stand-in's MC2 (EP) communicator."""
TOP_K = 2


def _nz(tensor: torch.Tensor, weight_nz_mode: int) -> torch.Tensor:
    """vLLM-Ascend's ``maybe_trans_nz``: bf16 / fp16 weights go NZ only with mode 2."""
    if tensor.dtype in (torch.bfloat16, torch.float16) and weight_nz_mode != 2:
        return tensor
    cast: torch.Tensor = torch_npu.npu_format_cast(tensor, ACL_FORMAT_FRACTAL_NZ)
    return cast


class AscendFusedMoE(torch.nn.Module):
    """One MoE layer's routed experts on one EP rank (weights on the layer itself)."""

    # Registered by ``load`` (the stacked ones deleted again when lists replace them).
    w13_weight: torch.nn.Parameter
    w2_weight: torch.nn.Parameter
    w13_weight_scale: torch.nn.Parameter
    w2_weight_scale: torch.nn.Parameter
    w13_weight_scale_fp32: torch.Tensor
    w13_weight_list: list[torch.Tensor]
    w2_weight_list: list[torch.Tensor]
    w13_weight_scale_fp32_list: list[torch.Tensor]
    w2_weight_scale_list: list[torch.Tensor]

    def __init__(
        self,
        layer_index: int,
        eplb_state: AscendEplbLayerState,
        *,
        num_local_experts: int,
        num_physical: int,
        ep_world_size: int,
        ep_rank: int,
    ) -> None:
        super().__init__()
        self.layer_name = f"model.layers.{layer_index}.mlp.experts"
        self.eplb_state = eplb_state
        parallel = SimpleNamespace(tp_rank=0, tp_size=1, ep_rank=ep_rank, ep_size=ep_world_size)
        self.moe_config = SimpleNamespace(
            num_local_experts=num_local_experts, moe_parallel_config=parallel
        )
        self.num_physical = num_physical
        self.quantized = False

    # Loading -------------------------------------------------------------------------------

    def load(self, slots: ExpertSlots, layer: int, *, use_lists: bool, nz_mode: int) -> None:
        """The layer's parameters from this rank's loaded slots, then vLLM-Ascend's
        ``process_weights_after_loading``."""
        self.quantized = slots.quant == "w8a8_dynamic"
        for name, tensor in slots.tensors().items():
            if name in PARAMS:  # the int64 scale forms exist with fused MC2 only
                loaded = torch.nn.Parameter(tensor[layer].clone(), requires_grad=False)
                self.register_parameter(PARAMS[name], loaded)
        if self.quantized:
            self._process_w8a8(use_lists)
        else:
            self.w13_weight.data = _nz(self.w13_weight.data, nz_mode)
            self.w2_weight.data = _nz(self.w2_weight.data, nz_mode)

    def _process_w8a8(self, use_lists: bool) -> None:
        self.w13_weight.data = _nz(self.w13_weight.data, 2)
        self.w2_weight.data = _nz(self.w2_weight.data, 2)
        self.w13_weight_scale_fp32 = self.w13_weight_scale.data.to(torch.float32)
        if not use_lists:
            return
        # Each list entry keeps NZ (torch_npu's clone keeps the format; the fake's does not).
        self.w13_weight_list = [_nz(w, 2) for w in self.w13_weight.data.unbind(0)]
        self.w2_weight_list = [_nz(w, 2) for w in self.w2_weight.data.unbind(0)]
        self.w13_weight_scale_fp32_list = [w.clone() for w in self.w13_weight_scale_fp32.unbind(0)]
        self.w2_weight_scale_list = [w.clone() for w in self.w2_weight_scale.data.unbind(0)]
        del self.w13_weight, self.w2_weight, self.w13_weight_scale, self.w2_weight_scale
        del self.w13_weight_scale_fp32

    # Forward -------------------------------------------------------------------------------

    def forward_weights(self) -> dict[str, list[torch.Tensor]]:
        """Per slot, the tensors the forward hands the grouped matmuls (by ftengine's names)."""
        if not self.quantized:
            return {
                "w13": list(self.w13_weight.data.unbind(0)),
                "w2": list(self.w2_weight.data.unbind(0)),
            }
        if hasattr(self, "w13_weight_list"):
            return {
                "w13": self.w13_weight_list,
                "w2": self.w2_weight_list,
                "w13_scale": self.w13_weight_scale_fp32_list,
                "w2_scale": self.w2_weight_scale_list,
            }
        return {
            "w13": list(self.w13_weight.data.unbind(0)),
            "w2": list(self.w2_weight.data.unbind(0)),
            "w13_scale": list(self.w13_weight_scale_fp32.unbind(0)),
            "w2_scale": list(self.w2_weight_scale.data.unbind(0)),
        }

    def expert_ids(self, count: int, num_logical: int) -> torch.Tensor:
        """The router's top-k through the routing table: token t picks logical t, t+1, ..."""
        table = self.eplb_state.expert_replica_routing_table
        assert table is not None
        logical = torch.tensor(
            [[(t + k) % num_logical for k in range(TOP_K)] for t in range(count)]
        )
        rows = torch.arange(count).unsqueeze(1) % table.shape[0]
        return table[rows, logical]

    def forward(self, x: torch.Tensor, manager: Any, num_logical: int) -> torch.Tensor:
        """dispatch_v2 -> grouped matmuls over ``forward_weights`` -> combine_v2."""
        weights = self.forward_weights()  # read every step, as the real forward does
        assert len(weights["w13"]) == self.moe_config.num_local_experts
        parallel = self.moe_config.moe_parallel_config
        common = {
            "group_ep": MC2_GROUP,
            "ep_world_size": parallel.ep_size,
            "ep_rank_id": parallel.ep_rank,
            "moe_expert_num": self.num_physical,
            "elastic_info": manager.get_elastic_info(),
            "tp_world_size": 1,
            "tp_rank_id": 0,
        }
        ids = self.expert_ids(x.shape[0], num_logical)
        out = torch_npu.npu_moe_distribute_dispatch_v2(
            x=x, expert_ids=ids, quant_mode=2 if self.quantized else 0, **common
        )
        scales = torch.full(ids.shape, 1.0 / TOP_K, dtype=torch.float32)
        combined: torch.Tensor = torch_npu.npu_moe_distribute_combine_v2(
            expand_x=out[0],
            expert_ids=ids,
            assist_info_for_combine=out[2],
            ep_send_counts=out[4],
            expert_scales=scales,
            tp_send_counts=out[5],
            **common,
        )
        return combined
