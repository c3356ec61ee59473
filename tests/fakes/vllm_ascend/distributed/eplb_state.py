"""Stand-in of ``vllm_ascend.distributed.eplb_state``: per-layer routing tables.

Each MoE layer's ``AscendEplbLayerState`` holds views of its row of the model's EPLB maps
and the ``expert_replica_routing_table`` its router reads, rebuilt in place from them by
``refresh_expert_replica_routing_table`` (physical ids; ftengine densifies them afterwards).
"""

from __future__ import annotations

from typing import Any

import torch

from tests.fakes.npu_routing import build_routing_table


class AscendEplbLayerState:
    """One MoE layer's EPLB state (``layer.eplb_state``)."""

    def __init__(
        self,
        logical_to_physical_map: torch.Tensor,
        logical_replica_count: torch.Tensor,
        ep_rank: int,
    ) -> None:
        self.logical_to_physical_map = logical_to_physical_map
        self.logical_replica_count = logical_replica_count
        self.ep_rank = ep_rank
        self.expert_replica_routing_table: torch.Tensor | None = None
        self.refresh_expert_replica_routing_table()

    def refresh_expert_replica_routing_table(self) -> None:
        table = build_routing_table(
            self.logical_to_physical_map, self.logical_replica_count, self.ep_rank
        )
        current = self.expert_replica_routing_table
        if current is not None and current.shape == table.shape:
            current.copy_(table)  # in place: captured graphs keep reading it
        else:
            self.expert_replica_routing_table = table


def refresh_model_routing_tables(model_state: Any, layer_idx: int | None = None) -> None:
    """Refresh every layer's routing table (or one) from the model state's maps."""
    layers = list(model_state.model.moe_layers)
    chosen = layers if layer_idx is None else [layers[layer_idx]]
    for layer in chosen:
        layer.eplb_state.refresh_expert_replica_routing_table()
