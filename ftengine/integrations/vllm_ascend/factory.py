"""ftengine's NPU backend for one vLLM-Ascend worker (imports torch_npu; model loaded).

The topology comes from vLLM's parallel config (EP rank = DP rank x TP + TP rank), the
scale-down facts from vLLM-Ascend's own config (``config.read_facts``); the MC2 manager is
told the slots per EP rank, as vLLM-Ascend's own sentinel does after the model loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ftengine.integrations.vllm.config import VllmFtSettings
from ftengine.integrations.vllm.shapes import WorkerLike
from ftengine.integrations.vllm.worker.factory import DeviceBackend
from ftengine.integrations.vllm.worker.hooks import VllmWorkerHooks
from ftengine.integrations.vllm_ascend.hooks import AscendWorkerHooks

if TYPE_CHECKING:  # typing.Unpack is 3.11+; annotations are never evaluated at run time
    from typing import Unpack

    from ftengine.backends.npu import NpuSeams


def npu_backend(
    worker: WorkerLike,
    hooks: VllmWorkerHooks,
    settings: VllmFtSettings,
    **seams: Unpack[NpuSeams],
) -> DeviceBackend:
    """The NPU backend over ``worker`` and its ``elastic_info`` (the mask it computes).

    ``hooks`` must be :class:`AscendWorkerHooks`; ``seams`` are ``NpuBackend``'s (defaults:
    the real torch_npu, torch's process groups, ``os.environ``, the worker's NPU).
    """
    from ftengine.backends.npu import NpuBackend
    from ftengine.backends.npu_host import NpuTopology

    if not isinstance(hooks, AscendWorkerHooks):
        raise TypeError(
            f"the NPU backend needs vLLM-Ascend's worker hooks (AscendWorkerHooks), got "
            f"{type(hooks).__name__}: build the sentinel with ftengine.integrations.vllm_ascend"
        )
    parallel = worker.parallel_config
    tp = parallel.tensor_parallel_size
    topology = NpuTopology(
        dp_rank=parallel.data_parallel_rank,
        dp_size=parallel.data_parallel_size,
        device_index=worker.local_rank,
        tp_size=tp,
        tp_rank=worker.rank % tp,
    )
    backend = NpuBackend(
        hooks, topology, config=settings.npu, deployment=hooks.facts.deployment, **seams
    )
    hooks.prepare_mc2(hooks.placement().local_slots)
    hooks.bind_device(backend.synchronize)
    # Once more after warm-up: whatever the warm-up initialised set torch_npu's default.
    timeout = settings.npu.communication_abort_timeout_s
    return DeviceBackend(backend, backend.elastic.tensor, serving_op_timeout_s=timeout or None)
