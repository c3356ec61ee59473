"""Stand-in of vLLM-Ascend's ``AscendAsyncOutput`` (the v2 runner's async step output).

Its ``get_output`` waits for the step's device work (the D2H copy of the sampled tokens),
so a device fault of an async step surfaces there, not in ``execute_model``. The real
module path is not confirmed; ftengine wraps the returned object, whatever its class.
"""

from __future__ import annotations

import torch_npu
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

from ..sentinel.npu_worker_sentinel import fault_barrier_wrapper


class AscendAsyncOutput(AsyncModelRunnerOutput):
    """One step's output, ready once the device has finished the step."""

    def __init__(self, req_ids: list[str]) -> None:
        self.req_ids = req_ids
        self.calls = 0

    @fault_barrier_wrapper
    def get_output(self) -> ModelRunnerOutput:
        self.calls += 1
        torch_npu.npu.synchronize()  # the D2H copy: queued device errors surface here
        return ModelRunnerOutput(
            req_ids=list(self.req_ids),
            req_id_to_index={req_id: i for i, req_id in enumerate(self.req_ids)},
            sampled_token_ids=[[7] for _ in self.req_ids],
        )

    def get_kv_connector_output(self) -> None:
        return None
