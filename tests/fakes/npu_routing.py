"""The rank-aware expert routing table vllm-ascend's MoE layers route tokens through.

Row ``r``, logical expert ``e`` holds the physical replica
``logical_to_physical_map[e, (r + ep_rank + e) % replica_count[e]]``, so ranks and rows
spread tokens over the replicas. The router reads ``table[row, e]`` for a token; after a
scale-down the table is rebuilt from the maps and densified once, in place.
"""

from __future__ import annotations

import torch

ROUTING_ROWS = 16
"""Rows of the tables the test doubles build (vllm-ascend uses 1024)."""


def build_routing_table(
    logical_to_physical: torch.Tensor,
    replica_count: torch.Tensor,
    ep_rank: int,
    rows: int = ROUTING_ROWS,
) -> torch.Tensor:
    """int32 ``[rows, num_logical]`` physical ids from one layer's maps:
    ``logical_to_physical`` ``[num_logical, max_replicas]``, ``replica_count``
    ``[num_logical]``."""
    logical = torch.arange(replica_count.shape[0], dtype=torch.int64)
    row = torch.arange(rows, dtype=torch.int64).unsqueeze(1)
    replica = (row + ep_rank + logical) % replica_count.to(torch.int64).clamp_min(1)
    return logical_to_physical.gather(1, replica.t()).t().to(torch.int32).contiguous()
