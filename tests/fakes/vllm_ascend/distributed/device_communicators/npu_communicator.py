"""Stand-in of ``vllm_ascend.distributed.device_communicators.npu_communicator``.

``_NpuAll2AllManager`` owns the MC2 dead-rank mask as the ``elastic_info`` tensor the token
dispatcher reads through ``get_elastic_info()``; ``update_mask`` rebuilds it in place.
``clean_buffers()`` is a no-op as in #16145, or, with ``mega_moe_bound`` (a later revision
with a MegaMoE buffer bound; the binding itself is not modelled), clears the mask.
"""

from __future__ import annotations

import torch


class _NpuAll2AllManager:
    """The MC2 all2all manager of one EP rank (``NPUCommunicator.all2all_manager``)."""

    support_fault_tolerance = False  # MC2 finds no fault itself; the mask is written by FT

    def __init__(self, ep_world_size: int, device: torch.device | None = None) -> None:
        self._ep_world_size = ep_world_size
        self._device = device if device is not None else torch.device("cpu")
        self._dead: set[int] = set()
        self._num_local_experts = 0
        self._elastic_info_host = torch.zeros(4 + 2 * ep_world_size, dtype=torch.int32)
        self._elastic_info: torch.Tensor | None = None
        self.updates: list[tuple[int, bool]] = []
        self.mega_moe_bound = False

    def update_mask(self, rank: int, masked: bool = True) -> None:
        """Mark EP ``rank`` dead (or alive again) and rebuild ``elastic_info`` in place."""
        self.updates.append((rank, masked))
        if masked:
            self._dead.add(rank)
        else:
            self._dead.discard(rank)
        self._rebuild_elastic_info()

    def query_active_mask(self) -> torch.Tensor:
        """Per EP rank: 1 dead, 0 alive (a CPU tensor)."""
        mask = torch.zeros(self._ep_world_size, dtype=torch.int32)
        mask[sorted(self._dead)] = 1
        return mask

    def query_fault(self) -> torch.Tensor:
        return torch.tensor(False)

    def clean_buffers(self) -> None:
        """Nothing to clean (#16145); with a MegaMoE buffer bound, every rank alive again."""
        if self.mega_moe_bound:
            self._dead.clear()
            self._rebuild_elastic_info()

    def get_elastic_info(self) -> torch.Tensor:
        if self._elastic_info is None:
            self._elastic_info = self._elastic_info_host.to(self._device)
        return self._elastic_info

    def set_num_local_physical_experts(self, num_local_experts: int) -> None:
        self._num_local_experts = num_local_experts
        self._rebuild_elastic_info()

    def _rebuild_elastic_info(self) -> None:
        world = self._ep_world_size
        alive = [rank for rank in range(world) if rank not in self._dead]
        table1 = [alive.index(rank) if rank in alive else -1 for rank in range(world)]
        table2 = alive + [-1] * (world - len(alive))
        header = [int(bool(self._dead)), len(alive), 0, len(alive) * self._num_local_experts]
        self._elastic_info_host.copy_(torch.tensor(header + table1 + table2, dtype=torch.int32))
        if self._elastic_info is not None:
            self._elastic_info.copy_(self._elastic_info_host)


class NPUCommunicator:
    """The EP group's device communicator, as far as ``all2all_manager`` goes."""

    def __init__(self, world_size: int, device: torch.device) -> None:
        self.world_size = world_size
        self.device = device
        self.all2all_manager = _NpuAll2AllManager(world_size, device)
