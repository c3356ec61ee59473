"""vLLM's process-group functions, imported on first use (``VllmDistributed`` for real)."""

from __future__ import annotations

import weakref
from datetime import timedelta
from typing import cast

import torch.distributed as dist
from torch._C._distributed_c10d import HashStore

from ftengine.integrations.vllm.messages import import_vllm
from ftengine.integrations.vllm.rendezvous import await_store
from ftengine.integrations.vllm.shapes import All2AllManagerLike, GroupCoordinatorLike

DISTRIBUTED_MODULE = "vllm.distributed"
ALL2ALL_MODULE = "vllm.model_executor.layers.fused_moe.all2all_utils"
ALIVE_ATTR = "ftengine_alive_ranks"
"""Set on a DP communicator whose groups a scale-down rebuilt among the survivors: their
original ranks. The coordinator keeps vLLM's original ``world_size`` / ``rank_in_group``
(vLLM's DP padding and all2all index per-rank sizes by the original DP rank)."""


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
        """A new gloo group (``stateless_init_torch_distributed_process_group``); a member
        other than rank 0 first waits for rank 0's store (``rendezvous.await_store``)."""
        if rank != 0:
            await_store(host, port, timeout)
        init = import_vllm(DISTRIBUTED_MODULE).stateless_init_torch_distributed_process_group
        return cast(object, init(host, port, rank, world_size, backend="gloo", timeout=timeout))

    def destroy_group(self, group: object) -> None:
        """Tear down a group: one torch registered (vLLM's start-up groups, ``new_group``)
        or one made by :meth:`init_gloo_group` (no collective: peers need not take part)."""
        try:
            dist.destroy_process_group(cast(dist.ProcessGroup, group))
        except ValueError:  # torch: "Invalid process group specified", i.e. not registered
            import_vllm(DISTRIBUTED_MODULE).stateless_destroy_torch_distributed_process_group(group)

    def closed_group(self, like: object) -> object:
        """What stands where a closed group stood until a rebuild replaces it: a torch
        ``ProcessGroup`` of ``like``'s rank and size with no backend, so ``rank()`` and
        ``size()`` answer and every collective raises (RuntimeError, "No backend type")."""
        group = cast(dist.ProcessGroup, like)
        return dist.ProcessGroup(HashStore(), group.rank(), group.size())

    def close_groups(self, groups: list[object]) -> int:
        """Destroy ``groups`` and let go of them (the list is emptied: the caller must hold
        no other reference), so that gloo closes their connections now and every peer's
        pending or next op on them fails at once ("Connection closed by peer") instead of
        at its op timeout. Returns how many are still referenced elsewhere (their sockets
        stay open until those references go)."""
        refs = [weakref.ref(group) for group in groups]
        while groups:  # no loop variable left holding the last one (it did, measured)
            self.destroy_group(groups.pop())
        # No gc.collect() for a group a reference cycle holds: in a loaded vLLM worker it
        # took seconds, all of them before the fault reaches the engine core.
        return sum(ref() is not None for ref in refs)


GROUP_GETTERS = ("get_world_group", "get_dp_group", "get_ep_group", "get_tp_group", "get_pp_group")


def real_process_groups() -> list[object]:
    """Every torch process group of this worker's vLLM groups (CPU and device side, once
    each), for per-op timeouts; a group vLLM did not build is skipped."""
    state = import_vllm(DISTRIBUTED_MODULE)
    found: list[object] = []
    for getter in GROUP_GETTERS:
        try:
            coordinator = getattr(state, getter)()
        except (AssertionError, AttributeError):  # vLLM asserts a group was initialised
            continue
        for pg in (
            getattr(coordinator, "cpu_group", None),
            getattr(coordinator, "device_group", None),
        ):
            if pg is not None and all(pg is not seen for seen in found):
                found.append(pg)
    return found
