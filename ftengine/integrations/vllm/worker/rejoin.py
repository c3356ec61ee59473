"""A restarted DP rank's worker initialises its distributed state alone (issue 28).

vLLM's ``init_worker_distributed_environment`` with DP > 1 makes a world group across every
DP rank's workers (a TCPStore on DP rank 0's host, ``_coord_store_port``) and builds the
TP / PP / DP / EP groups out of it: a restarted rank would wait there for peers that left
that world long ago. When the start-up handshake said the rank rejoins (``rejoin_flag``),
:func:`init_distributed` runs vLLM's own initialisation as a one-rank deployment (DP size
1 for its duration: a world of this worker alone, on the executor's local init method), then
gives the DP and EP group coordinators (and their communicators) back the original size
and this rank's original place, as a scale-down's rebuilt group keeps them: the MoE layers
read them to pick this rank's experts (``FusedMoEParallelConfig``: ``ep_rank``), vLLM's DP
padding and the all2all index per-rank sizes by them. The groups are marked as holding this
rank alone (``hooks.mark_members``), so ftengine's CPU all-gatherv / reduce-scatterv run
over the one member and the warm-up's dummy batches need no peer. Admission (``scale_up``)
rebuilds the groups with the survivors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ftengine.integrations.vllm.messages import import_vllm
from ftengine.integrations.vllm.rejoin_flag import rejoining
from ftengine.integrations.vllm.worker.hooks import mark_members

logger = logging.getLogger(__name__)

DISTRIBUTED_MODULE = "vllm.distributed.parallel_state"
ALL2ALL_MODULE = "vllm.distributed.device_communicators.all2all"
PLATFORMS_MODULE = "vllm.platforms"
IMPORT_UTILS_MODULE = "vllm.utils.import_utils"
ONE_RANK = {"data_parallel_size": 1, "data_parallel_rank": 0}
"""``ParallelConfig`` fields set for the duration of vLLM's own initialisation."""


@contextmanager
def one_rank_view(parallel: Any) -> Iterator[None]:
    """``parallel`` as a deployment of one DP rank, restored on exit."""
    saved = {name: getattr(parallel, name) for name in ONE_RANK}
    for name, value in ONE_RANK.items():
        setattr(parallel, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(parallel, name, value)


def widen(
    coordinator: Any, world_size: int, rank_in_group: int, *, use_all2all: bool = False
) -> None:
    """``coordinator`` (a one-member group) takes the original size and this rank's place,
    its communicator too (vLLM makes none for a group of one: the platform's is made here,
    with the all2all manager when ``use_all2all``), and is marked as holding this rank alone."""
    coordinator.world_size = world_size
    coordinator.rank_in_group = rank_in_group
    communicator = getattr(coordinator, "device_communicator", None)
    if communicator is None:
        communicator = make_communicator(coordinator, use_all2all)
        coordinator.device_communicator = communicator
    communicator.world_size = world_size
    communicator.rank_in_group = rank_in_group
    mark_members(coordinator, [rank_in_group])


def make_communicator(coordinator: Any, use_all2all: bool) -> Any:
    """The platform's device communicator over ``coordinator``'s groups, as
    ``GroupCoordinator.__init__`` makes it for a group of more than one."""
    platform = import_vllm(PLATFORMS_MODULE).current_platform
    resolve = import_vllm(IMPORT_UTILS_MODULE).resolve_obj_by_qualname
    communicator_class = resolve(platform.get_device_communicator_cls())
    return communicator_class(
        cpu_group=coordinator.cpu_group,
        device=coordinator.device,
        device_group=coordinator.device_group,
        unique_name=coordinator.unique_name,
        use_all2all=use_all2all,
    )


def init_distributed(
    vllm_init: Callable[..., None],
    vllm_config: Any,
    rank: int,
    distributed_init_method: str | None = None,
    local_rank: int = -1,
    backend: str = "nccl",
) -> None:
    """``init_worker_distributed_environment``: vLLM's own unless this worker's rank
    rejoins; then the same as a one-rank deployment, widened (module doc)."""
    parallel = vllm_config.parallel_config
    if not rejoining(parallel) or int(parallel.data_parallel_size) <= 1:
        vllm_init(vllm_config, rank, distributed_init_method, local_rank, backend)
        return
    dp_size, dp_rank = int(parallel.data_parallel_size), int(parallel.data_parallel_rank)
    with one_rank_view(parallel):
        vllm_init(vllm_config, rank, distributed_init_method, local_rank, backend)
    state = import_vllm(DISTRIBUTED_MODULE)
    tp = int(parallel.tensor_parallel_size)
    widen(state.get_dp_group(), dp_size, dp_rank)
    if state._EP is not None:  # a MoE model; after the DP group (its all2all reads it)
        ep = state.get_ep_group()
        use_all2all = bool(parallel.use_all2all)
        widen(ep, dp_size * tp, dp_rank * tp + ep.rank_in_group % tp, use_all2all=use_all2all)
        communicator = ep.device_communicator
        if use_all2all and getattr(communicator, "all2all_manager", None) is None:
            # one vLLM made for a one-rank group has none; the MoE layers need it
            manager = import_vllm(ALL2ALL_MODULE).AgRsAll2AllManager(ep.cpu_group)
            communicator.use_all2all = True
            communicator.all2all_manager = manager
    logger.info(
        "[FT] DP rank %d's worker rejoins: distributed state of its own (DP group of one, "
        "EP rank %d of %d) until it is admitted",
        dp_rank, dp_rank * tp, dp_size * tp,
    )  # fmt: skip
