"""``WorkerHooks`` over a vLLM worker.

What the recovery does to a vLLM worker besides the device: drop the model runner's
in-flight requests, run its dummy batch, hand the EPLB map tensors (updated in place) and
the checkpoint to the backend, point the all2all manager at the dead-rank mask, close the
worker's gloo DP group when it faults (so that its peers' waits in it fail at once) and
rebuild it on the ports vLLM's engine core publishes. vLLM-Ascend's
worker is served by ``ftengine.integrations.vllm_ascend.hooks``, a subclass.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Protocol, cast

import torch

from ftengine.errors import BackendError, PlacementError
from ftengine.integrations.vllm.shapes import (
    EplbStateLike,
    ModuleTree,
    VllmDistributed,
    WorkerLike,
)
from ftengine.integrations.vllm.worker.distributed import ALIVE_ATTR
from ftengine.placement.maps import ExpertPlacement
from ftengine.weights.index import CheckpointIndex

logger = logging.getLogger(__name__)

# Where a generic all2all manager is handed the dead ranks and the device's mask tensor:
# upstream's DeepEP / NIXL managers find dead ranks in-kernel (query_active_mask), so these
# attributes are ftengine's own. vLLM-Ascend's manager has a real accessor instead
# (update_mask / get_elastic_info), which ``vllm_ascend.hooks`` uses.
MASK_ATTR = "elastic_info"
DEAD_RANKS_ATTR = "dead_ep_ranks"

MOE_WEIGHTS = ("w13_weight", "w2_weight")
"""The FusedMoE parameters that mark a module as an expert layer."""


class InputBatchLike(Protocol):
    """``vllm.v1.worker.gpu_input_batch.InputBatch``."""

    req_id_to_index: Mapping[str, int]
    req_prompt_embeds: dict[int, torch.Tensor]

    def remove_request(self, req_id: str) -> object: ...
    def condense(self) -> None: ...
    def refresh_metadata(self) -> None: ...


class RunnerV1Like(Protocol):
    """``vllm.v1.worker.gpu_model_runner.GPUModelRunner`` (the v1 runner)."""

    execute_model_state: object
    kv_connector_output: object
    requests: dict[str, object]
    num_prompt_logprobs: dict[str, object]
    input_batch: InputBatchLike


class RequestStatesLike(Protocol):
    req_id_to_index: Mapping[str, int]


class RunnerV2Like(Protocol):
    """``vllm.v1.worker.gpu.model_runner.GPUModelRunner`` (the v2 runner)."""

    execute_model_state: object
    req_states: RequestStatesLike

    def _remove_request(self, req_id: str) -> None: ...


class VllmWorkerHooks:
    """What the recovery does to one vLLM worker (the sentinel's ``WorkerHooks``).

    ``dist`` reaches vLLM's process groups (``RealVllmDistributed`` in a vLLM process).
    ``gloo_device_group``: the DP group's device side is gloo too (vLLM's CPU platform), so
    the rebuilt gloo group replaces it as well. ``group_timeout_s``: per-op timeout of a
    rebuilt group (None: ``--cpu-distributed-timeout-seconds``).
    """

    def __init__(self, worker: WorkerLike, dist: VllmDistributed) -> None:
        self.worker = worker
        self.dist = dist
        self.gloo_device_group = False
        # Re-inference (integrations.vllm.engine_core.reinference): the engine core resumes
        # held requests as preempted ones, and vLLM's runner resumes those from the states
        # it cached.
        self.keep_request_states = False
        self.group_timeout_s: float | None = None
        self._dp_ports: list[int] | None = None
        self._dp_host: str | None = None  # where the rebuilt group's store is (with the ports)
        self._dp_closed = False  # close_dp_group ran since the last rebuild
        self._placement: ExpertPlacement | None = None
        self._checkpoint: CheckpointIndex | None = None

    # -- WorkerHooks ---------------------------------------------------------------------

    def clean_state(self) -> None:
        """Drop every in-flight request from the model runner (no collective, no device op)."""
        runner = self.worker.model_runner
        if self.worker.use_v2_model_runner:
            v2 = cast(RunnerV2Like, runner)
            v2.execute_model_state = None
            for req_id in list(v2.req_states.req_id_to_index):
                v2._remove_request(req_id)
            return
        v1 = cast(RunnerV1Like, runner)
        v1.execute_model_state = None
        v1.kv_connector_output = None
        batch = v1.input_batch
        for req_id in list(batch.req_id_to_index):
            if not self.keep_request_states:
                v1.requests.pop(req_id, None)
                v1.num_prompt_logprobs.pop(req_id, None)
            batch.remove_request(req_id)
        batch.condense()
        batch.refresh_metadata()
        batch.req_prompt_embeds.clear()

    def run_dummy_batch(self) -> None:
        """vLLM's own dummy step (every DP rank runs it in lockstep), unwrapped: inside a
        recovery its failure is the recovery step's, not a new fault to report."""
        step = self.worker.execute_dummy_batch
        getattr(step, "__wrapped__", step)()

    def expert_layers(self) -> Sequence[torch.nn.Module]:
        """The model's FusedMoE layers in model order (modules holding w13/w2 slot weights)."""
        model = cast(ModuleTree, getattr(self.worker.model_runner, "model", None))
        if model is None:
            raise BackendError("the vLLM model runner has no model yet: load_model runs first")
        return [
            m
            for m in model.modules()
            if all(isinstance(getattr(m, name, None), torch.Tensor) for name in MOE_WEIGHTS)
        ]

    # -- what the device backend reads ---------------------------------------------------

    def placement(self) -> ExpertPlacement:
        """vLLM's EPLB maps, adopted without copying (the backend updates them in place)."""
        if self._placement is None:
            self._placement = self._adopt_eplb_maps()
        return self._placement

    def checkpoint(self) -> CheckpointIndex:
        """The checkpoint the model was loaded from (``--model`` must be a local directory)."""
        if self._checkpoint is None:
            self._checkpoint = CheckpointIndex.open(self.worker.vllm_config.model_config.model)
        return self._checkpoint

    # -- vLLM-side recovery steps --------------------------------------------------------

    def publish_dp_ports(self, ports: Sequence[int], host: str | None = None) -> None:
        """Keep the fresh DP-group ports of a command (vLLM's ``new_stateless_dp_group_ports``,
        one per worker of this engine) and the host whose rank serves them (None: vLLM's
        ``data_parallel_master_ip``, as vLLM's own retry) for the next
        :meth:`rebuild_dp_group`."""
        self._dp_ports, self._dp_host = [int(p) for p in ports], host

    def mask_all2all(self, dead_ep_ranks: frozenset[int], mask: torch.Tensor | None) -> None:
        """Give the all2all manager the dead EP ranks and the mask tensor (same storage)."""
        manager = self.dist.all2all_manager()
        if manager is None:
            return
        setattr(manager, DEAD_RANKS_ATTR, frozenset(dead_ep_ranks))
        if mask is not None:
            setattr(manager, MASK_ATTR, mask)

    def close_dp_group(self) -> None:
        """Close this worker's DP group, both gloo sides (vLLM's CPU platform), after a
        fault: peers blocked in the failed step's collectives on it (vLLM's DP padding
        all-reduce, the MoE all-gatherv) fail at once with "Connection closed by peer"
        instead of waiting for the op timeout. A stand-in that raises on any collective
        holds its place until :meth:`rebuild_dp_group` (a retry's or a scale-down's)."""
        parallel = self.worker.parallel_config
        # Elsewhere the device side is NCCL / HCCL, which a closed gloo group does not release.
        if parallel.data_parallel_size <= 1 or self._dp_closed or not self.gloo_device_group:
            return
        group = self.dist.dp_group()
        old = [group.cpu_group]
        device = getattr(group, "device_group", None)
        if device is not None and device is not group.cpu_group:
            old.append(device)
        stand_in = self.dist.closed_group(group.cpu_group)
        group.cpu_group = stand_in
        _replace_device_group(group, stand_in)
        del device  # close_groups must hold the only references
        fields = {"rank": parallel.data_parallel_rank, "groups": len(old)}
        held = self.dist.close_groups(old)
        self._dp_closed = True
        if held:
            logger.warning(
                "vLLM DP group closed, but %d of its groups are still referenced: peers "
                "waiting in them wait for the op timeout",
                held,
                extra=fields,
            )
        else:
            logger.info("vLLM DP group closed", extra=fields)

    def rebuild_dp_group(self, alive_dp_ranks: frozenset[int], epoch: int) -> None:
        """Replace the worker's gloo DP group by one among ``alive_dp_ranks`` (dense ranks in
        ascending original order) on the port vLLM published for this worker."""
        parallel = self.worker.parallel_config
        if parallel.data_parallel_size <= 1:
            return
        ports, self._dp_ports = self._dp_ports, None  # a port serves one rebuild only
        if not ports:
            raise BackendError(
                f"cannot rebuild the DP group for epoch {epoch}: vLLM's engine core sent no "
                "new_stateless_dp_group_ports with the command (it publishes them for retry)"
            )
        alive = sorted(alive_dp_ranks)
        port = ports[self.worker.rank % parallel.world_size]
        manager = self.dist.all2all_manager()
        if manager is not None:
            with contextlib.suppress(NotImplementedError):  # allgather_reducescatter has none
                manager.clean_buffers()
        group = self.dist.dp_group()
        if not self._dp_closed:
            self.dist.destroy_group(group.cpu_group)
        seconds = self.group_timeout_s
        started = time.monotonic()
        new = self.dist.init_gloo_group(
            self._dp_host or parallel.data_parallel_master_ip,
            port,
            alive.index(parallel.data_parallel_rank),
            len(alive),
            _timeout(parallel.cpu_distributed_timeout_seconds if seconds is None else seconds),
        )
        group.cpu_group = new
        self._dp_closed = False
        if self.gloo_device_group:
            _replace_device_group(group, new)
            mark_members(group, alive)
        logger.info(
            "vLLM DP group rebuilt in %.3f s",
            time.monotonic() - started,
            extra={"rank": parallel.data_parallel_rank, "epoch": epoch, "alive": alive},
        )

    def _adopt_eplb_maps(self) -> ExpertPlacement:
        state = cast(EplbStateLike | None, getattr(self.worker.model_runner, "eplb_state", None))
        states = list(state.model_states.values()) if state is not None else []
        if not states:
            raise PlacementError(
                "the vLLM model runner has no EPLB state: start vLLM with --enable-eplb "
                "(scale-down re-hosts experts through the EPLB maps)"
            )
        main = states[0]  # the served model; a draft model's state is added after it
        parallel = self.worker.parallel_config
        return ExpertPlacement.from_tensors(
            main.physical_to_logical_map,
            main.logical_to_physical_map,
            main.logical_replica_count,
            ep_size=parallel.data_parallel_size * parallel.tensor_parallel_size,
        )


def _replace_device_group(group: object, new: object) -> None:
    """The DP group's device side (and its communicator's view of both sides) becomes
    ``new``: on CPU the all2all's all-gatherv runs there, and its old gloo group may hold a
    half-finished op of the failed step."""
    setattr(group, "device_group", new)  # noqa: B010 - GroupCoordinatorLike names cpu_group only
    communicator = getattr(group, "device_communicator", None)
    if communicator is not None:
        communicator.device_group = new
        communicator.cpu_group = new


def mark_members(group: object, alive: Sequence[int]) -> None:
    """Tell the DP communicator which original ranks its rebuilt group holds (the CPU
    all-gatherv drops the removed ranks' empty pieces by it); all ranks: no mark."""
    communicator = getattr(group, "device_communicator", None)
    if communicator is None:
        return
    world = int(getattr(communicator, "world_size", len(alive)))
    members = tuple(sorted(alive))
    setattr(communicator, ALIVE_ATTR, None if members == tuple(range(world)) else members)


def _timeout(seconds: object) -> timedelta | None:
    if isinstance(seconds, int | float) and not isinstance(seconds, bool):
        return timedelta(seconds=seconds)
    return None
