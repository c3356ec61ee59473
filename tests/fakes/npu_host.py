"""A host worker for the NPU backend in tests: real checkpoint and slots, a tiny MoE step.

``FakeNpuHost`` implements ``NpuHost`` over a checkpoint written by the weights module; its
model step routes tokens through per-layer routing tables built from the EPLB maps (as
vllm-ascend's are, densified after a scale-down) and, with EP >= 2, through MC2
dispatch_v2 / combine_v2 of the (fake) torch_npu, which needs H >= 1024 on A3.
``RecordingGroupFactory`` stands in for ``torch.distributed.new_group``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

from ftengine.backends.npu import NpuBackend
from ftengine.backends.npu_config import NpuFtConfig
from ftengine.backends.npu_host import NpuTopology
from ftengine.backends.npu_mc2 import Mc2Communicator, densify_routing_table
from ftengine.backends.npu_preconditions import NpuDeployment
from ftengine.backends.npu_reload import ExpertSlotsStorage, NzPolicy, SlotStorage
from ftengine.backends.npu_runtime import NpuRuntime
from ftengine.placement.maps import ExpertPlacement
from ftengine.weights.index import CheckpointIndex
from ftengine.weights.reload import load_experts_into_slots
from ftengine.weights.slots import ExpertSlots
from tests.fakes.npu_routing import build_routing_table
from tests.fakes.npu_state import STATE

EP_GROUP = "fake_hccl_ep_group"
"""The HCCL name of the fake host's EP group (registered with the fake torch_npu)."""


@attrs.frozen
class FakeGroup:
    """A process group made by ``RecordingGroupFactory``."""

    serial: int
    ranks: tuple[int, ...]
    backend: str
    timeout_s: float | None


class RecordingGroupFactory:
    """Records every group created and destroyed, in order."""

    def __init__(self) -> None:
        self.created: list[FakeGroup] = []
        self.destroyed: list[object] = []

    def new_group(self, ranks: Sequence[int], *, backend: str, timeout_s: float | None) -> object:
        group = FakeGroup(len(self.created), tuple(ranks), backend, timeout_s)
        self.created.append(group)
        return group

    def destroy_group(self, group: object) -> None:
        self.destroyed.append(group)


class FakeNpuHost:
    """One worker of an EP group of ``ep_size``: EP rank ``ep_rank``'s slots hold its experts."""

    top_k = 2

    def __init__(
        self,
        index: CheckpointIndex,
        *,
        ep_size: int,
        ep_rank: int,
        num_redundant: int,
        nz: NzPolicy | None = None,
        fused_scales: bool = False,
    ) -> None:
        self.index = index
        self.ep_rank = ep_rank
        self.nz = nz if nz is not None else NzPolicy()
        self._placement = ExpertPlacement.default(
            index.num_layers, index.num_experts, num_redundant, ep_size
        )
        local = self._placement.local_slots
        self.slots = ExpertSlots.allocate(index, index.num_layers, local, fused_scales=fused_scales)
        p2l = self._placement.physical_to_logical_map
        first = ep_rank * local
        # What the model loader did at start-up (with the reference NZ transform).
        load_experts_into_slots(
            index,
            self.slots,
            [
                (layer, s, int(p2l[layer, first + s]))
                for layer in range(index.num_layers)
                for s in range(local)
            ],
        )
        self.routing = [self._routing_table(layer) for layer in range(index.num_layers)]
        self.mc2: Mc2Communicator | None = None
        self.step: Callable[[torch.Tensor], torch.Tensor] = self._step
        self.dummy_batches = 0
        self.checkpoint_reads = 0

    def attach(self, backend: NpuBackend) -> None:
        """Wire the backend in: MC2 with its elastic_info, the model call behind its barrier."""
        if self._placement.ep_size >= 2:
            STATE.add_hccl_group(EP_GROUP)
            self.mc2 = backend.make_mc2(EP_GROUP)
        self.step = backend.guard(self._step, self._empty)

    def _routing_table(self, layer: int) -> torch.Tensor:
        placement = self._placement
        return build_routing_table(
            placement.logical_to_physical_map[layer],
            placement.logical_replica_count[layer],
            self.ep_rank,
        )

    # NpuHost -------------------------------------------------------------------------------

    def placement(self) -> ExpertPlacement:
        return self._placement

    def slot_storage(self) -> SlotStorage:
        return ExpertSlotsStorage(self.slots, nz=self.nz)

    def checkpoint(self) -> CheckpointIndex:
        self.checkpoint_reads += 1
        return self.index

    def run_dummy_batch(self) -> None:
        out = self.step(self.tokens(4))
        if out.numel() == 0:
            raise RuntimeError("the dummy batch got an empty output: the worker is still fenced")
        self.dummy_batches += 1

    def refresh_routing(self, table1: torch.Tensor) -> None:
        """Rebuild every layer's table from the maps, then densify it, each in place."""
        local = self._placement.local_slots
        for layer, table in enumerate(self.routing):
            table.copy_(self._routing_table(layer))
            densify_routing_table(table, table1, local)

    # The model step ------------------------------------------------------------------------

    def tokens(self, count: int) -> torch.Tensor:
        """Hidden states ``[count, H]`` bf16, deterministic."""
        hidden = self.index.hidden_size
        return (
            torch.arange(count * hidden, dtype=torch.float32)
            .reshape(count, hidden)
            .div(count * hidden)
            .to(torch.bfloat16)
        )

    def logical_ids(self, count: int) -> torch.Tensor:
        """The router's top-k logical experts ``[count, K]``: token t picks t, t+1, ..."""
        num_logical = self._placement.num_logical
        return torch.tensor(
            [[(t + k) % num_logical for k in range(self.top_k)] for t in range(count)]
        )

    def expert_ids(self, count: int, layer: int = 0) -> torch.Tensor:
        """The ids MC2 gets ``[count, K]`` int32: token t reads row ``t % rows`` of the
        layer's routing table (dense ids after a scale-down)."""
        table = self.routing[layer]
        rows = torch.arange(count).unsqueeze(1) % table.shape[0]
        return table[rows, self.logical_ids(count)]

    def _step(self, x: torch.Tensor) -> torch.Tensor:
        if self.mc2 is None:
            return x
        ids = self.expert_ids(x.shape[0])
        scales = torch.full(ids.shape, 0.5, dtype=torch.float32)
        dispatched = self.mc2.dispatch(x, ids)
        return self.mc2.combine(dispatched, dispatched.expand_x, scales)

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, self.index.hidden_size, dtype=torch.bfloat16)


@attrs.frozen(eq=False)
class NpuRig:
    """A backend on the fake torch_npu with its host and group factory."""

    backend: NpuBackend
    host: FakeNpuHost
    groups: RecordingGroupFactory
    environ: dict[str, str]


def make_npu_rig(
    index: CheckpointIndex,
    *,
    dp_size: int = 1,
    dp_rank: int = 0,
    num_redundant: int = 2,
    device_index: int = 0,
    tp_size: int = 1,
    nz: NzPolicy | None = None,
    fused_scales: bool = False,
    config: NpuFtConfig | None = None,
    deployment: NpuDeployment | None = None,
    environ: dict[str, str] | None = None,
) -> NpuRig:
    """Build the NPU backend for DP rank ``dp_rank`` of ``dp_size`` (TP rank 0; the fake
    must be installed)."""
    env = {} if environ is None else environ
    groups = RecordingGroupFactory()
    host = FakeNpuHost(
        index,
        ep_size=dp_size * tp_size,
        ep_rank=dp_rank * tp_size,
        num_redundant=num_redundant,
        nz=nz,
        fused_scales=fused_scales,
    )
    backend = NpuBackend(
        host,
        NpuTopology(dp_rank=dp_rank, dp_size=dp_size, device_index=device_index, tp_size=tp_size),
        config=config,
        deployment=deployment,
        runtime=NpuRuntime.load(aclnn_probe=STATE.has_aclnn),
        group_factory=groups,
        environ=env,
        device=torch.device("cpu"),
    )
    host.attach(backend)
    return NpuRig(backend, host, groups, env)


class SentinelHooks:
    """``WorkerHooks`` of the fake host, for driving the NPU backend through a RankSentinel."""

    def __init__(self, host: FakeNpuHost) -> None:
        self.host = host
        self.cleaned = 0

    def clean_state(self) -> None:
        self.cleaned += 1

    def run_dummy_batch(self) -> None:
        self.host.run_dummy_batch()

    def expert_layers(self) -> Sequence[object]:
        return [self.host.slots]
