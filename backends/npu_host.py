"""What the host worker (vLLM-Ascend's NPU worker, or a test double) gives the NPU backend.

The backend never reaches into a model: it sees this worker's expert slot tensors, the EPLB
placement maps, the MoE routing tables and the checkpoint index through :class:`NpuHost`,
and where it runs through :class:`NpuTopology`. vLLM-Ascend's worker adapter
(``ftengine.integrations.vllm_ascend``) implements ``NpuHost`` over its MoE layers.
"""

from __future__ import annotations

from typing import Protocol

import attrs
import torch

from ftengine.backends.npu_reload import SlotStorage
from ftengine.errors import ConfigError, PlacementError
from ftengine.placement.maps import ExpertPlacement
from ftengine.weights.index import CheckpointIndex


class NpuHost(Protocol):
    """The host worker, as the NPU backend needs it."""

    def placement(self) -> ExpertPlacement:
        """The EPLB maps the router reads (updated in place by a scale-down)."""
        ...

    def slot_storage(self) -> SlotStorage:
        """This rank's device expert slots (written in place by a reload)."""
        ...

    def checkpoint(self) -> CheckpointIndex:
        """The index of the checkpoint the model was loaded from (for selective reloads)."""
        ...

    def run_dummy_batch(self) -> None:
        """One model step on dummy input through every collective (all survivors together)."""
        ...

    def refresh_routing(self, table1: torch.Tensor) -> None:
        """Make a redistribution live for the router: rebuild the kernel-facing routing
        tables from the (already updated) maps and densify them once, in place.

        ``table1``: original -> dense EP rank, int64 ``[W]`` (identity when none is dead).
        """
        ...


def _non_negative(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 0:
        raise ConfigError(f"{attribute.name} must be >= 0, found {value}")


def _positive(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ConfigError(f"{attribute.name} must be >= 1, found {value}")


@attrs.frozen
class NpuTopology:
    """Where this worker runs: its original DP rank, the DP and TP sizes, its NPU index.

    Global (torch.distributed) rank of DP rank ``d``'s TP rank ``t`` is ``d * tp_size + t``;
    so is its EP rank (EP world = DP x TP).
    """

    dp_rank: int = attrs.field(validator=_non_negative)
    dp_size: int = attrs.field(validator=_positive)
    device_index: int = attrs.field(validator=_non_negative)
    tp_size: int = attrs.field(default=1, validator=_positive)
    tp_rank: int = attrs.field(default=0, validator=_non_negative)

    def __attrs_post_init__(self) -> None:
        if self.dp_rank >= self.dp_size:
            raise ConfigError(f"dp_rank must be < dp_size {self.dp_size}, found {self.dp_rank}")
        if self.tp_rank >= self.tp_size:
            raise ConfigError(f"tp_rank must be < tp_size {self.tp_size}, found {self.tp_rank}")

    @property
    def ep_size(self) -> int:
        return self.dp_size * self.tp_size

    @property
    def ep_rank(self) -> int:
        return self.dp_rank * self.tp_size + self.tp_rank

    def check_placement(self, placement: ExpertPlacement) -> None:
        """``PlacementError`` unless ``placement`` spans this topology's whole EP group."""
        if placement.ep_size != self.ep_size:
            raise PlacementError(
                f"the placement is for EP size {placement.ep_size}, but DP {self.dp_size} x "
                f"TP {self.tp_size} = {self.ep_size}; build it for the whole EP group"
            )

    def global_ranks(self, dp_ranks: frozenset[int]) -> tuple[int, ...]:
        """Global ranks of every TP rank of ``dp_ranks``, ascending."""
        return tuple(sorted(d * self.tp_size + t for d in dp_ranks for t in range(self.tp_size)))
