"""vLLM's process-group functions, imported on first use (``VllmDistributed`` for real)."""

from __future__ import annotations

from datetime import timedelta
from typing import cast

from ftengine.integrations.vllm.messages import import_vllm
from ftengine.integrations.vllm.shapes import All2AllManagerLike, GroupCoordinatorLike

DISTRIBUTED_MODULE = "vllm.distributed"
ALL2ALL_MODULE = "vllm.model_executor.layers.fused_moe.all2all_utils"


class RealVllmDistributed:
    """:class:`~ftengine.integrations.vllm.shapes.VllmDistributed` over the installed vLLM."""

    def dp_group(self) -> GroupCoordinatorLike:
        """vLLM's DP ``GroupCoordinator`` of this worker (``get_dp_group()``)."""
        return cast(GroupCoordinatorLike, import_vllm(DISTRIBUTED_MODULE).get_dp_group())

    def all2all_manager(self) -> All2AllManagerLike | None:
        """The EP all2all manager (``get_ep_all2all_manager()``), None without EP."""
        utils = import_vllm(ALL2ALL_MODULE)
        return cast(All2AllManagerLike | None, utils.get_ep_all2all_manager())

    def init_gloo_group(
        self, host: str, port: int, rank: int, world_size: int, timeout: timedelta | None
    ) -> object:
        """A new gloo group (``stateless_init_torch_distributed_process_group``)."""
        init = import_vllm(DISTRIBUTED_MODULE).stateless_init_torch_distributed_process_group
        return cast(object, init(host, port, rank, world_size, backend="gloo", timeout=timeout))

    def destroy_group(self, group: object) -> None:
        """Tear down a group made by :meth:`init_gloo_group`."""
        import_vllm(DISTRIBUTED_MODULE).stateless_destroy_torch_distributed_process_group(group)
