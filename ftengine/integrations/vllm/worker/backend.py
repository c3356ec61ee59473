"""The backend a vLLM worker's engine drives: the device backend, hosted by the worker.

The one wrapper around the device backend. As every host's (``HostedBackend``), quarantine
also cleans the worker's state and the dummy batch is the worker's full model step; the
device backend (NPU) masks ranks and rebuilds the groups it owns, and the vLLM worker also
has a gloo DP group and an all2all manager of its own, which are brought along here in the
engine's order (``mask_ranks`` -> ``rebuild_groups`` -> ...).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ftengine.backends.base import Backend, RepairReport
from ftengine.placement.ranks import dp_to_ep_ranks
from ftengine.sentinel import HostedBackend, WorkerHooks


class VllmHostSteps(WorkerHooks, Protocol):
    """A host worker's hooks plus the vLLM-side steps (``VllmWorkerHooks`` implements them)."""

    def mask_all2all(self, dead_ep_ranks: frozenset[int], mask: torch.Tensor | None) -> None: ...

    def rebuild_dp_group(self, alive_dp_ranks: frozenset[int], epoch: int) -> None: ...


class VllmHostedBackend(HostedBackend):
    """``device`` hosted by a vLLM worker's ``steps``: after the device masks ranks, the
    all2all manager gets the dead EP ranks and ``mask`` (the device's mask tensor, e.g. the
    NPU ``elastic_info``); after the device rebuilds its groups, the worker's DP group is
    rebuilt. Ranks are original DP ranks; ``tp_size`` maps them to EP ranks. Quarantine and
    the dummy batch are ``HostedBackend``'s; every other call is the device's."""

    def __init__(
        self,
        device: Backend,
        steps: VllmHostSteps,
        *,
        tp_size: int = 1,
        mask: torch.Tensor | None = None,
    ) -> None:
        super().__init__(device, steps)
        self.steps = steps
        self.tp_size = tp_size
        self.mask = mask

    def rebuild_groups(self, alive_ranks: frozenset[int], epoch: int) -> None:
        super().rebuild_groups(alive_ranks, epoch)
        self.steps.rebuild_dp_group(alive_ranks, epoch)

    def mask_ranks(self, dead_ranks: frozenset[int]) -> None:
        super().mask_ranks(dead_ranks)
        self.steps.mask_all2all(dp_to_ep_ranks(dead_ranks, self.tp_size), self.mask)

    def admit_ranks(self, added: frozenset[int], removed: frozenset[int]) -> RepairReport:
        report = super().admit_ranks(added, removed)
        self.steps.mask_all2all(dp_to_ep_ranks(removed, self.tp_size), self.mask)
        return report
